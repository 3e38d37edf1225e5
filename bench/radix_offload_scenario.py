"""The hybrid radix + expert offload scenario of issue 12, run ``--repeats`` times against one ``ft serve``: a
short chat, then a ~2,500-token Japanese prompt with ``max_tokens`` 200, then a short one again (the sequence
that hung FreeToken's default Qwen3.6 configuration: hybrid radix, offloaded experts, the prefill stream). Every
request must finish with tokens within ``--request-timeout``; afterwards the engine must be idle with every KV
slot and live state slot free. Prints one row per request (status, finish reason, tokens, cached tokens, TTFT,
total) and writes JSON (command line, date, GPU, the resolved config line, the rows, the end stats) to ``--out``.
Exit status 1 when any request failed or the engine was not left idle.

On the H200 (Qwen3.6-35B-A3B shape, dummy weights, in ``scripts/gpu_session.sh``'s environment):

    python3 bench/radix_offload_scenario.py --out bench/out/radix_offload_scenario.json

CPU smoke run on a tiny random Qwen3.5-MoE: ``python bench/radix_offload_scenario.py --tiny``.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
import tempfile
import time

import requests

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [os.path.join(_ROOT, "tests"), os.path.join(_ROOT, "python")]
from agent_session_bench import gpu_name, has_weights, load_tokenizer, write_tiny  # noqa: E402
from report import write_report  # noqa: E402
from server_harness import ServerProcess  # noqa: E402

DEFAULT_ARGS = (
    "--max-running-requests 1 --max-seq-len-override 32768 --moe-backend offload --moe-cache-size 1024 "
    "--enable-cache-report"
)
TINY_ARGS = (
    "--device cpu --max-running-requests 1 --max-seq-len-override 4096 --moe-backend offload --moe-cache-size 8 "
    "--enable-cache-report"
)
JAPANESE = (
    "吾輩は猫である。名前はまだ無い。どこで生れたかとんと見当がつかぬ。何でも薄暗いじめじめした所でニャーニャー泣いて"
    "いた事だけは記憶している。吾輩はここで始めて人間というものを見た。しかもあとで聞くとそれは書生という人間中で一番"
    "獰悪な種族であったそうだ。"
)


def requests_of_one_round(tok) -> list[tuple[str, str, int]]:
    """(label, user message, max_tokens): short, ~2,500 tokens of Japanese, short."""
    per = len(tok.encode(JAPANESE, add_special_tokens=False).ids)
    long_text = JAPANESE * max(1, round(2500 / per)) + "\n\nこの文章を要約してください。"
    return [("short", "こんにちは。自己紹介してください。", 32), ("japanese", long_text, 200), ("short", "Hi!", 32)]


def chat(url: str, content: str, max_tokens: int, timeout: float) -> dict:
    """One streamed chat request: status, finish reason, tokens, cached tokens, TTFT and total time."""
    body = {
        "messages": [{"role": "user", "content": content}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    t0 = time.perf_counter()
    row = {"status": None, "finish_reason": None, "error": None, "ttft_s": None}
    try:
        with requests.post(url + "/v1/chat/completions", json=body, stream=True, timeout=(5, timeout)) as r:
            row["status"] = r.status_code
            for line in r.iter_lines():
                if not line.startswith(b"data: {"):
                    continue
                ev = json.loads(line[6:])
                row["error"] = ev.get("error", row["error"])
                if ev.get("usage"):
                    u = ev["usage"]
                    row["prompt_tokens"], row["completion_tokens"] = u["prompt_tokens"], u["completion_tokens"]
                    row["cached_tokens"] = (u.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
                for c in ev.get("choices") or []:
                    if (c.get("delta") or {}).get("content") and row["ttft_s"] is None:
                        row["ttft_s"] = time.perf_counter() - t0
                    row["finish_reason"] = c.get("finish_reason") or row["finish_reason"]
    except requests.RequestException as e:
        row["error"] = repr(e)
    row["total_s"] = time.perf_counter() - t0
    row["ok"] = row["status"] == 200 and row["error"] is None and row["finish_reason"] in ("stop", "length")
    return row


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-path", default="configs/qwen3.6-35b-a3b")
    ap.add_argument("--server-args", default=None, help=f"default: {DEFAULT_ARGS!r} ({TINY_ARGS!r} with --tiny)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--request-timeout", type=float, default=600)
    ap.add_argument("--tiny", action="store_true", help="a tiny random Qwen3.5-MoE on the CPU (smoke run)")
    ap.add_argument("--out", default="bench/out/radix_offload_scenario.json")
    a = ap.parse_args()
    model = write_tiny(tempfile.mkdtemp(prefix="ft-radix-scenario-"), 32768) if a.tiny else a.model_path
    args = ["--model-path", model, *shlex.split(a.server_args or (TINY_ARGS if a.tiny else DEFAULT_ARGS))]
    if not has_weights(model):
        args.append("--dummy-weight")
    tok, _ = load_tokenizer(model)
    srv = ServerProcess(args, ready_timeout=1200)
    rows = []
    try:
        for rep in range(a.repeats):
            for label, content, max_tokens in requests_of_one_round(tok):
                rows.append(
                    {"round": rep + 1, "request": label, **chat(srv.url, content, max_tokens, a.request_timeout)}
                )
                print_row(rows[-1])
        stats = srv.get("/v1/stats").json()
        resolved = next((line for line in srv.log().splitlines() if "Resolved config" in line), "")
    finally:
        code = srv.stop()
        log_tail = srv.log()[-6000:]
    # idle: nothing running or queued, no KV held outside the tree, every live state slot free
    idle = (
        stats["running_requests"] == stats["queued_requests"] == stats["kv_used_tokens"] == 0
        and stats["free_state_slots"] == stats["state_slots_total"] - stats["snapshot_slots_total"]
    )
    report = {
        "gpu": gpu_name(),
        "serve_args": args,
        "resolved_config": resolved[resolved.find("Resolved config") :],
        "rows": rows,
        "stats_end": stats,
        "idle_after": idle,
        "exit_code": code,
        "server_log_tail": log_tail,  # how the server ended (its shutdown lines), kept for a nonzero exit
    }
    write_report(a.out, report)
    failed = [r for r in rows if not r["ok"]]
    print(f"{len(rows) - len(failed)}/{len(rows)} requests answered; engine idle after: {idle}; server exit {code}")
    print(report["resolved_config"])
    if code != 0:
        print("server log, last lines:\n" + "\n".join(log_tail.splitlines()[-25:]))
    return 1 if failed or not idle or code != 0 else 0


def print_row(r: dict) -> None:
    ttft = f"{r['ttft_s'] * 1e3:9.1f}" if r["ttft_s"] is not None else "        -"
    print(
        f"round {r['round']} {r['request']:>9}  status {r['status']}  finish {r['finish_reason']!s:>6}  "
        f"prompt {r.get('prompt_tokens', '-')!s:>5}  cached {r.get('cached_tokens', '-')!s:>5}  "
        f"out {r.get('completion_tokens', '-')!s:>4}  TTFT ms {ttft}  total s {r['total_s']:7.2f}"
        + (f"  error {r['error']}" if r["error"] else ""),
        flush=True,
    )


if __name__ == "__main__":
    sys.exit(main())
