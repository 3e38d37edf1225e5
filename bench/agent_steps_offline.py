"""The agent session of ``bench/agent_session_bench.py`` through the offline engine (``freetoken.LLM``: the Rust
scheduler and the Python worker of ``ft serve``, no HTTP), timing each turn's prefill step by itself. It splits
issue 12's open question in two: on the H200 a served cached turn's prefill step took ~190-228 ms where
``bench/profile_prefill.py`` runs the same chunk over a contiguous prefix in 103.6 ms. If the steps here are near
the in-process figure, the gap is in the server (HTTP, its engine loop); if they are near the served figure, it is
in what the scheduler plans (a restore, snapshot captures, the prefix's KV slots, the chunking) and
``FREETOKEN_PROFILE_STEPS`` (``engine/step_profiler.py``) shows where.

Per turn: prompt tokens, the scheduler's cached tokens, the garbage collector's milliseconds inside the turn's
prefill steps (``engine/gc_control.py``; ``FREETOKEN_GC_FREEZE=0`` shows them without the start-up freeze), the
steps the turn's prefill took and the time of each
(the engine's ``step()`` runs a prefill step to the end: it samples the turn's first token), then the rest of the
answer stepped to completion (greedy, ``ignore_eos``), whose ids go into the history. Prints a table, writes JSON.

    python3 bench/agent_steps_offline.py --out bench/out/agent_steps_offline.json -- \\
        --moe-backend fused --max-prefill-length 8192                     # H200, Qwen3.6-35B-A3B dummy
    python bench/agent_steps_offline.py --tiny --final-context 2000 --turns 4   # CPU smoke run
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import random
import shutil
import sys
import tempfile
import time

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [_HERE, os.path.join(os.path.dirname(_HERE), "tests"), os.path.join(os.path.dirname(_HERE), "python")]
from agent_session_bench import Session, gpu_name, has_weights, load_tokenizer, write_tiny  # noqa: E402
from profile_decode import worker_args  # noqa: E402
from report import write_report  # noqa: E402

from freetoken.engine.gc_control import GcClock  # noqa: E402


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model-path", default=os.path.join(os.path.dirname(_HERE), "configs", "qwen3.6-35b-a3b"))
    ap.add_argument("--tiny", action="store_true", help="a tiny random Qwen3.5-MoE on the CPU (smoke run)")
    ap.add_argument("--turns", type=int, default=10)
    ap.add_argument("--final-context", type=int, default=30000)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--cache-type", default="radix")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(_HERE), "bench", "out", "agent_steps_offline.json"))
    ap.add_argument("serve_args", nargs=argparse.REMAINDER, help="after --: ft serve flags (--name value pairs)")
    return ap.parse_args()


def run_turn(llm, prompt: list[int], max_tokens: int) -> dict:
    """One request: its prefill steps timed one by one (until its first token), then the answer to the end (the
    events as ``LLM.generate`` reads them)."""
    from freetoken import SamplingParams

    rid = next(llm._ids)
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    llm.engine.add_request(rid, prompt, dataclasses.asdict(params))
    prefill_steps, gc_ms, cached, tokens, first = [], [], 0, [], None
    while not llm.engine.is_idle():
        clock = GcClock().start()
        t0 = time.perf_counter()
        events = llm.engine.step()
        dt = time.perf_counter() - t0
        clock.stop()
        if first is None:
            prefill_steps.append(dt)
            gc_ms.append(clock.total_ms())
        for kind, r, a, b in events:
            if r != rid:
                continue
            if kind == "started":
                cached = int(b)
            elif kind == "token":
                tokens.append(int(a))
                first = first if first is not None else len(prefill_steps)
            elif kind == "failed":
                raise RuntimeError(f"request failed: {a}")
    return {"prompt_tokens": len(prompt), "cached_tokens": cached, "prefill_steps_ms": [s * 1e3 for s in prefill_steps],
            "prefill_gc_ms": gc_ms, "answer": tokens}  # fmt: skip


def main() -> int:
    a = parse_args()
    from freetoken import LLM

    max_seq = math.ceil((a.final_context + a.max_tokens + 64) / 1024) * 1024
    tmp = None
    kwargs = worker_args([x for x in a.serve_args if x != "--"])
    model_path = a.model_path
    if a.tiny:
        tmp = tempfile.mkdtemp(prefix="ft-agent-steps-")
        model_path = write_tiny(tmp, max_seq)
        kwargs.setdefault("device", "cpu")
        kwargs.setdefault("num_tokens", max(8192, math.ceil(3 * max_seq / 1024) * 1024))
    kwargs.setdefault("dummy_weight", not has_weights(model_path))
    kwargs.setdefault("max_seq_len_override", max_seq)
    kwargs["cache_type"] = a.cache_type
    try:
        tok, _ = load_tokenizer(model_path)
        session = Session(tok, a.final_context, a.turns, a.max_tokens, 0)
        t0 = time.perf_counter()
        llm = LLM(model_path, **kwargs)
        startup = time.perf_counter() - t0
        # warm-up on ids sharing no prefix with the session (JIT, allocator), as the HTTP bench does: not measured
        warm = random.Random(12345)
        run_turn(llm, [warm.randrange(1000, 100000) for _ in range(min(2048, max(a.final_context // 4, 16)))], 2)
        history, rows = [], []
        for k in range(a.turns):
            prompt = history + session.message(k, len(history))
            r = run_turn(llm, prompt, a.max_tokens)
            r.update(turn=k + 1, new_tokens=len(prompt) - len(history))
            rows.append(r)
            history = prompt + r["answer"]
    finally:
        if tmp:
            shutil.rmtree(tmp, ignore_errors=True)
    print(f"offline engine, cache {a.cache_type}, {kwargs}; start-up {startup:.1f} s; GPU: {gpu_name()}")
    print(
        f"{'turn':>4}{'prompt':>8}{'new':>7}{'cached':>8}{'computed':>9}{'gc ms':>8}  prefill steps ms (the turn's first token)"
    )
    for r in rows:
        steps = " + ".join(f"{s:.1f}" for s in r["prefill_steps_ms"])
        computed = r["prompt_tokens"] - r["cached_tokens"]
        gc_ms = sum(r["prefill_gc_ms"])
        print(
            f"{r['turn']:>4}{r['prompt_tokens']:>8}{r['new_tokens']:>7}{r['cached_tokens']:>8}{computed:>9}{gc_ms:>8.1f}  {steps}"
        )
    report = {
        "gpu": gpu_name(),
        "worker_args": kwargs,
        "startup_s": startup,
        "turns": [{k: v for k, v in r.items() if k != "answer"} for r in rows],
    }
    write_report(a.out, report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
