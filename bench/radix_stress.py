"""Issue 12's stress run at the real shape: concurrent multi-turn sessions with client hang-ups against one
``ft serve`` with the hybrid radix cache (optionally with experts offloaded), then the accounting: every request
completed or (the hang-ups) cancelled, none failed or timed out, and afterwards the engine idle with every KV slot,
page-table row and live state slot free, every snapshot held by the tree evictable and within the pool, the tree's
tokens all evictable, ``/health`` 200, and no integrity-check failure or panic in the log.

Half of the sessions share one system prompt; each turn sends the history so far (the previous prompt, the answer
as the client saw it re-encoded, the turn's new ids); every ``--hang-up-every``-th request streams and hangs up
after two chunks of a long answer (the next turn carries on from what the client saw). ``tests/test_hybrid_radix_load.py``
is the CPU test of the same load (it also checks every answer against a naive server, which bf16 on the GPU cannot
promise); this script runs it at the size a GPU serves and prints a table: requests by outcome, latency p50/p99,
snapshot hits and hit tokens, the end stats. Writes JSON; exit status 1 when any check fails.

    python3 bench/radix_stress.py --out bench/out/radix_stress.json                     # H200, Qwen3.6-35B-A3B dummy
    python3 bench/radix_stress.py --server-args "--moe-backend offload --moe-cache-size 1024 --max-running-requests 8"
    python bench/radix_stress.py --tiny                                                   # CPU smoke run
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import os
import random
import shlex
import statistics
import sys
import tempfile
import time

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [os.path.dirname(os.path.abspath(__file__)), os.path.join(_ROOT, "tests"), os.path.join(_ROOT, "python")]
from agent_session_bench import gpu_name, has_weights, load_tokenizer  # noqa: E402
from bounded_clients import post_json, stream  # noqa: E402
from report import write_report  # noqa: E402
from server_harness import ServerProcess  # noqa: E402

DEFAULT_ARGS = "--max-running-requests 8 --max-prefill-length 8192 --max-seq-len-override 32768"
TINY_ARGS = (
    "--device cpu --max-running-requests 4 --num-tokens 8192 --max-seq-len-override 1024 --max-prefill-length 96"
)


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model-path", default=os.path.join(_ROOT, "configs", "qwen3.6-35b-a3b"))
    ap.add_argument("--server-args", default=None, help=f"default: {DEFAULT_ARGS!r} ({TINY_ARGS!r} with --tiny)")
    ap.add_argument("--sessions", type=int, default=16)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--system-tokens", type=int, default=4000, help="the shared system prompt")
    ap.add_argument("--turn-tokens", type=int, default=600, help="new ids per turn (about)")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--hang-up-every", type=int, default=5, help="every N-th request hangs up after two chunks")
    ap.add_argument("--request-timeout", type=float, default=600)
    ap.add_argument("--tiny", action="store_true", help="a tiny random Qwen3.5-MoE on the CPU (smoke run)")
    ap.add_argument("--out", default=os.path.join(_ROOT, "bench", "out", "radix_stress.json"))
    return ap.parse_args()


def ids(rng: random.Random, n: int, vocab: int) -> list[int]:
    return [rng.randrange(10, vocab) for _ in range(n)]


def run_session(url: str, tok, i: int, a, vocab: int, system: list[int]) -> list[dict]:
    """Session ``i``'s turns one after the other (arrivals staggered by 50 ms)."""
    time.sleep(0.05 * i)
    rng = random.Random(1000 + i)
    own = system if i % 2 == 0 else ids(rng, a.system_tokens // 2 + 37 * i, vocab)
    history = own + ids(rng, a.turn_tokens, vocab)
    turns = []
    for t in range(a.turns):
        n = i * a.turns + t
        hang_up = 2 if a.hang_up_every and n % a.hang_up_every == a.hang_up_every - 1 else None
        body = {"prompt": history, "max_tokens": 10 * a.max_tokens if hang_up else a.max_tokens, "temperature": 0,
                "ignore_eos": True}  # fmt: skip
        if hang_up or (i + t) % 2 == 0:
            out = stream(url, body, a.request_timeout, path="/v1/completions", hang_up_after=hang_up)
            pieces = out.pieces
        else:
            out = post_json(url, body, deadline=a.request_timeout, path="/v1/completions")
            pieces = [out.text]
        turns.append({"session": i, "turn": t, "prompt_tokens": len(history), "hang_up": hang_up,
                      "kind": out.kind, "status": out.status, "finish_reason": out.finish_reason,
                      "elapsed_s": out.elapsed, "detail": out.detail or (out.error or {}).get("message", "")})  # fmt: skip
        if out.kind not in ("ok", "cancelled"):
            break
        answer = [x for p in pieces for x in tok.encode(p, add_special_tokens=False).ids]
        history = history + answer + ids(rng, a.turn_tokens // 2 + 13 * t, vocab)
    return turns


def accounting(stats: dict, rows: int, log: str) -> list[str]:
    """What must hold once the load has drained; each failed check as one line."""
    checks = {
        "no request in flight": stats["requests_in_flight"] == 0,
        "every KV slot free": stats["kv_used_tokens"] == 0,
        "every page-table row free": stats["free_rows"] == rows,
        "every live state slot free": stats["state_slots_used"] == 0 and stats["free_state_slots"] == rows,
        "snapshots within the pool": stats["snapshot_slots_used"] <= stats["snapshot_slots_total"],
        "every held snapshot evictable": stats["evictable_snapshots"] == stats["snapshot_slots_used"],
        "every tree token evictable": stats["evictable_tokens"] == stats["cached_tokens_in_tree"],
        "snapshot hits happened": stats["snapshot_hits"] > 0,
        "no integrity-check failure or panic": "integrity check failed" not in log and "panicked" not in log,
    }
    return [name for name, ok in checks.items() if not ok]


def main() -> int:
    a = parse_args()
    tmp = None
    model_path = a.model_path
    server_args = shlex.split(a.server_args if a.server_args is not None else TINY_ARGS if a.tiny else DEFAULT_ARGS)
    if a.tiny:
        import hf_reference as R

        tmp = tempfile.mkdtemp(prefix="ft-radix-stress-")
        R.write_released_qwen3_5_moe(tmp, seed=7)
        model_path = tmp
        a.system_tokens, a.turn_tokens, a.sessions, a.turns = min(a.system_tokens, 160), min(a.turn_tokens, 40), 6, 3
    rows = int(server_args[server_args.index("--max-running-requests") + 1])
    args = ["--model-path", model_path, "--enable-cache-report", *server_args]
    if not has_weights(model_path):
        args.append("--dummy-weight")
    tok, _ = load_tokenizer(model_path)
    vocab = 5000 if a.tiny else 100000
    system = ids(random.Random(7), a.system_tokens, vocab)
    report = {"gpu": gpu_name(), "serve_args": args}
    t0 = time.perf_counter()
    srv = ServerProcess(args, ready_timeout=1200)
    report["startup_s"] = time.perf_counter() - t0
    try:
        t0 = time.perf_counter()
        with cf.ThreadPoolExecutor(a.sessions) as pool:
            sessions = list(pool.map(lambda i: run_session(srv.url, tok, i, a, vocab, system), range(a.sessions)))
        report["load_s"] = time.perf_counter() - t0
        turns = [t for s in sessions for t in s]
        stats = srv.wait_idle(120)
        deadline = time.time() + 20  # hung-up answers are aborted at their next step: give their slots a moment
        while (stats["kv_used_tokens"] or stats["state_slots_used"]) and time.time() < deadline:
            time.sleep(0.2)
            stats = srv.get("/v1/stats").json()
        failed = [f"request {t['session']}/{t['turn']}: {t['kind']} {t['status']} {t['detail']}"[:200] for t in turns
                  if t["kind"] not in ("ok", "cancelled") or (t["kind"] == "cancelled") != bool(t["hang_up"])]  # fmt: skip
        if len(turns) != a.sessions * a.turns:
            failed.append(f"{len(turns)} of {a.sessions * a.turns} requests were sent (a session stopped early)")
        failed += accounting(stats, rows, srv.log())
        if srv.get("/health").status_code != 200:
            failed.append("/health is not 200 after the load")
        report.update(turns=turns, stats_end=stats, failed=failed, log_tail=srv.log()[-3000:])
    finally:
        report["exit_code"] = srv.stop()
        if tmp:
            import shutil

            shutil.rmtree(tmp, ignore_errors=True)
    done = [t["elapsed_s"] for t in turns if t["kind"] == "ok"]
    by_kind = {k: sum(t["kind"] == k for t in turns) for k in sorted({t["kind"] for t in turns})}
    q = statistics.quantiles(done, n=100) if len(done) >= 2 else [float("nan")] * 99
    print(f"radix stress: {a.sessions} sessions x {a.turns} turns on {report['gpu']}; {' '.join(args)}")
    print(f"start-up {report['startup_s']:.1f} s; load {report['load_s']:.1f} s; requests by outcome {by_kind}")
    print(
        f"completed request latency p50 {q[49]:.2f} s, p99 {q[98]:.2f} s; max prompt {max(t['prompt_tokens'] for t in turns)}"
    )
    keys = ("snapshot_hits", "snapshot_hit_tokens", "snapshot_slots_used", "snapshot_slots_total", "cached_tokens_in_tree",
            "kv_used_tokens", "free_rows", "state_slots_used")  # fmt: skip
    print("end stats: " + ", ".join(f"{k} {stats.get(k)}" for k in keys))
    print("PASS: every request answered, every slot and snapshot accounted for" if not failed else "FAIL:")
    for f in failed:
        print(f"  {f}")
    write_report(a.out, report)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
