"""Prefix-cache reuse on a shared-prefix workload (SGLang's generated-shared-prefix shape): G groups of Q
questions, each group sharing one long system prompt. Runs the same requests against ``--cache-type radix``
and ``--cache-type naive`` servers side by side and reports the cached-token fraction, mean TTFT and total
time. Prints a table and writes JSON.

    python bench/prefix_cache_bench.py --out bench/out/prefix_cache.json -- [ft serve args]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import requests

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
from report import write_report  # noqa: E402
from server_harness import ServerProcess  # noqa: E402


def workload(groups: int, questions: int, prefix_words: int) -> list[list[dict]]:
    reqs = []
    for g in range(groups):
        system = f"Group {g} policy. " + " ".join(f"rule{g}_{i} applies" for i in range(prefix_words // 2))
        for q in range(questions):
            reqs.append(
                [{"role": "system", "content": system}, {"role": "user", "content": f"Question {q}: summarise."}]
            )
    return reqs


def run(srv: ServerProcess, reqs: list[list[dict]], max_tokens: int) -> dict:
    ttfts, cached, prompt = [], 0, 0
    t0 = time.perf_counter()
    for messages in reqs:  # sequential: TTFT then measures prefill, not queueing
        body = {
            "messages": messages,
            "max_tokens": max_tokens,
            "temperature": 0,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        start, first = time.perf_counter(), None
        with requests.post(srv.url + "/v1/chat/completions", json=body, stream=True, timeout=600) as r:
            for line in r.iter_lines():
                if not line.startswith(b"data: {"):
                    continue
                ev = json.loads(line[6:])
                if first is None and any(c.get("delta", {}).get("content") for c in ev.get("choices", [])):
                    first = time.perf_counter()
                if ev.get("usage"):
                    prompt += ev["usage"]["prompt_tokens"]
                    cached += (ev["usage"].get("prompt_tokens_details") or {}).get("cached_tokens", 0)
        ttfts.append((first or time.perf_counter()) - start)
    return {
        "requests": len(reqs),
        "prompt_tokens": prompt,
        "cached_tokens": cached,
        "cached_fraction": cached / max(prompt, 1),
        "mean_ttft_s": statistics.mean(ttfts),
        "p50_ttft_s": statistics.median(ttfts),
        "total_s": time.perf_counter() - t0,
    }


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="bench/out/prefix_cache.json")
    ap.add_argument("--groups", type=int, default=4)
    ap.add_argument("--questions", type=int, default=4)
    ap.add_argument("--prefix-words", type=int, default=600)
    ap.add_argument("--max-tokens", type=int, default=4)
    ap.add_argument("serve_args", nargs=argparse.REMAINDER)
    a = ap.parse_args()
    serve_args = [x for x in a.serve_args if x != "--"]
    reqs = workload(a.groups, a.questions, a.prefix_words)
    results = {}
    for cache in ("radix", "naive"):
        srv = ServerProcess(serve_args + ["--cache-type", cache, "--enable-cache-report"])
        try:
            run(srv, reqs[:1], a.max_tokens)  # warm-up on a prompt outside the measured set's prefixes
            results[cache] = run(srv, reqs, a.max_tokens)
        finally:
            srv.stop()
    results["ttft_speedup"] = results["naive"]["mean_ttft_s"] / results["radix"]["mean_ttft_s"]
    results["serve_args"] = serve_args
    write_report(a.out, results)
    print(f"{'cache':<8}{'requests':>9}{'prompt tok':>12}{'cached':>9}{'mean TTFT s':>13}{'total s':>9}")
    for cache in ("radix", "naive"):
        r = results[cache]
        print(
            f"{cache:<8}{r['requests']:>9}{r['prompt_tokens']:>12}{r['cached_fraction']:>9.1%}"
            f"{r['mean_ttft_s']:>13.3f}{r['total_s']:>9.1f}"
        )
    print(f"TTFT speed-up from the radix cache: {results['ttft_speedup']:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
