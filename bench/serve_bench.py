"""Serving benchmark: start ``ft serve``, measure TTFT / prefill throughput / decode throughput through the
HTTP API, and (optionally) check that an injected out-of-memory error in a large prefill fails only that
request. Prints a table and writes JSON.

    python bench/serve_bench.py --out bench/out/serve.json -- --dummy-weight --model-path configs/qwen3.6-35b-a3b
    FREETOKEN_FAULT=oom@2 python bench/serve_bench.py --oom-check -- <ft serve args>

Dummy weights route tokens pseudo-randomly (random router weights), and every expert is resident with
``--moe-backend fused``, so decode figures are all-resident figures, not offload figures.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import threading
import time

import requests

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
from report import write_report  # noqa: E402
from server_harness import ServerProcess  # noqa: E402

WORDS = (
    "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron pi rho sigma tau "
    "upsilon phi chi psi omega"
).split()


def long_prompt(n_words: int) -> str:
    return " ".join(WORDS[(i * 7 + i // 3) % len(WORDS)] for i in range(n_words))


def stream_completion(url: str, prompt: str, max_tokens: int, timeout: float = 600) -> dict:
    """One streaming /v1/completions request; returns TTFT, the inter-token gaps, usage, and the send time and the
    token arrival times (``time.perf_counter``: other requests' events line up against them)."""
    body = {
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    t0 = time.perf_counter()
    stamps, usage, error = [], None, None
    with requests.post(url + "/v1/completions", json=body, stream=True, timeout=timeout) as r:
        for line in r.iter_lines():
            if not line.startswith(b"data: ") or line == b"data: [DONE]":
                continue
            ev = json.loads(line[6:])
            if "error" in ev:
                error = ev["error"]
            if ev.get("usage"):
                usage = ev["usage"]
            if any(c.get("text") for c in ev.get("choices", [])):
                stamps.append(time.perf_counter())
    if error or not stamps:
        return {"error": error or f"HTTP {r.status_code}", "usage": usage}
    gaps = [b - a for a, b in zip(stamps, stamps[1:])]
    return {
        "ttft_s": stamps[0] - t0,
        "gaps": gaps,
        "usage": usage,
        "e2e_s": stamps[-1] - t0,
        "sent": t0,
        "stamps": stamps,
    }


def stream_together(url: str, prompts: list[str], max_tokens: int) -> list[dict]:
    """Every prompt streamed at once, one thread each; a failed request stops the benchmark."""
    results: list = [None] * len(prompts)

    def run(i: int) -> None:
        results[i] = stream_completion(url, prompts[i], max_tokens)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    bad = [r for r in results if "error" in r]
    if bad:
        raise RuntimeError(f"{len(bad)} of {len(prompts)} requests failed: {bad[0]}")
    return results


def parse_args() -> argparse.Namespace:
    """The command line."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="bench/out/serve.json")
    ap.add_argument("--prefill-words", type=int, default=10000)
    ap.add_argument("--decode-tokens", type=int, default=128)
    ap.add_argument(
        "--max-length-words",
        type=int,
        default=0,
        help="also prefill a prompt of this many words (near the context limit) and compare the "
        "largest step workspace with the memory plan's",
    )
    ap.add_argument(
        "--oom-check", action="store_true", help="FREETOKEN_FAULT=oom@2 is set: the first long prefill must fail alone"
    )
    ap.add_argument("serve_args", nargs=argparse.REMAINDER)
    return ap.parse_args()


def main() -> int:
    a = parse_args()
    serve_args = [x for x in a.serve_args if x != "--"]
    t0 = time.perf_counter()
    srv = ServerProcess(serve_args, ready_timeout=600)
    startup_s = time.perf_counter() - t0
    result = {"serve_args": serve_args, "startup_s": startup_s}
    try:
        prompt = long_prompt(a.prefill_words)
        if a.oom_check:
            failed = stream_completion(srv.url, prompt, 4)
            health = srv.get("/health").status_code
            ok = stream_completion(srv.url, "Hello", 4)
            result["oom_check"] = {
                "first_long_prefill": failed.get("error"),
                "health_after": health,
                "next_request_ok": "error" not in ok,
            }
        warm = stream_completion(srv.url, prompt[: len(prompt) // 4], 2)  # warm-up (what JIT the dry run left)
        if "error" in warm:
            raise RuntimeError(f"warm-up failed: {warm}")
        result["first_request_ttft_s"] = warm["ttft_s"]
        pre = stream_completion(srv.url, prompt + " final", 2)
        prompt_tokens = pre["usage"]["prompt_tokens"]
        result["prefill"] = {
            "prompt_tokens": prompt_tokens,
            "ttft_s": pre["ttft_s"],
            "tokens_per_s": prompt_tokens / pre["ttft_s"],
        }
        dec = stream_completion(srv.url, "Count slowly:", a.decode_tokens)
        itl = statistics.median(dec["gaps"])
        result["decode_bs1"] = {"tokens": len(dec["gaps"]) + 1, "median_itl_ms": itl * 1e3, "tokens_per_s": 1 / itl}
        if a.max_length_words:
            # A prompt near the context limit: every prefill chunk at full size, the last ones attending over
            # the longest prefixes. The memory plan's workspace must cover the largest step seen.
            full = stream_completion(srv.url, long_prompt(a.max_length_words), 2)
            stats = srv.get("/v1/stats").json()
            result["max_length_prefill"] = {
                "prompt_tokens": (full.get("usage") or {}).get("prompt_tokens"),
                "error": full.get("error"),
                "ttft_s": full.get("ttft_s"),
                "planned_workspace_bytes": stats.get("planned_workspace_bytes"),
                "max_step_workspace_bytes": stats.get("max_step_workspace_bytes"),
            }
        log = srv.log()
        result["log_tail"] = log[-3000:]
        result["memory_plan_table"] = log[log.find("Memory plan") :][:1500] if "Memory plan" in log else None
    finally:
        code = srv.stop()
    result["exit_code"] = code
    write_report(a.out, result)
    print_result(result)
    return 0


def print_result(result: dict) -> None:
    print(f"{'metric':<34}{'value':>14}")
    print(f"{'start-up (s)':<34}{result['startup_s']:>14.1f}")
    if "oom_check" in result:
        oc = result["oom_check"]
        print(f"{'OOM prefill failed alone':<34}{str(bool(oc['first_long_prefill']) and oc['next_request_ok']):>14}")
    print(f"{'first request TTFT (s)':<34}{result['first_request_ttft_s']:>14.2f}")
    p = result["prefill"]
    print(f"{'prefill tokens':<34}{p['prompt_tokens']:>14}")
    print(f"{'prefill TTFT (s)':<34}{p['ttft_s']:>14.3f}")
    print(f"{'prefill throughput (tok/s)':<34}{p['tokens_per_s']:>14.0f}")
    d = result["decode_bs1"]
    print(f"{'decode bs1 median ITL (ms)':<34}{d['median_itl_ms']:>14.2f}")
    print(f"{'decode bs1 (tok/s)':<34}{d['tokens_per_s']:>14.1f}")
    if "max_length_prefill" in result:
        m = result["max_length_prefill"]
        planned, seen = m["planned_workspace_bytes"], m["max_step_workspace_bytes"]
        print(f"{'max-length prefill tokens':<34}{str(m['prompt_tokens']):>14}")
        print(f"{'planned workspace (GiB)':<34}{(planned or 0) / 2**30:>14.3f}")
        print(f"{'largest step workspace (GiB)':<34}{(seen or 0) / 2**30:>14.3f}")
        if planned:
            print(f"{'largest / planned':<34}{seen / planned:>14.3f}")


if __name__ == "__main__":
    sys.exit(main())
