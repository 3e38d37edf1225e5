"""A prompt step of many sequences, in process: what 32 prompts arriving together, or one prompt beside 31 decoding
streams, cost a step (each such step delays every stream in it: the first tokens of the prompts, the next token of
the decode streams).

Builds the worker in-process (no HTTP, no scheduler; the serve args after ``--``, whose ``--max-running-requests``
must allow 32), then times, with the device synchronized around each step:

- ``32 prompts``: 32 fresh prompts of ``--prompt-tokens`` (7) tokens in one step;
- ``1 prompt + 31 decode``: a fresh ``--mixed-prompt-tokens`` (200) token prompt after 31 sequences' decode tokens
  (the scheduler's order; before 2026-12-06 evening the prompt came first);
- ``+ snapshots``: the second shape with the prompt's state captured at its last grid point and its end, as the
  hybrid radix cache serves it (its GDN layers run in rounds; hybrid models only);
- ``1 prompt``: one fresh prompt of as many tokens as the first shape has (the same work in one sequence; the
  32 prompts' tokens, one after another).

Every prompt's tokens differ; ``FREETOKEN_BENCH_ROUTING=uniform|zipf`` drives the routing (the MoE is resident with
``--moe-backend fused``: no expert cache, no hit rate).

For a hybrid model each shape runs three ways, taking turns step by step, ``--rounds`` times: the default (a step
of several sequences replays the GDN batch graphs, ``layers/gdn_batch_graphs.py``), ``eager varlen`` (as before
2026-12-06 noon: ``FREETOKEN_GDN_BATCH_GRAPHS=0``, fla's chunked forward called eagerly below its entry point with
the step's varlen index, ``fla_direct_prefill``) and ``fla public`` (several sequences through fla's public entry
point, as before 2026-12-06 morning). Prints ms per step (median of ``--reps``), the default's paired ratio to ``eager varlen``, and
writes JSON.

    python bench/batch_prefill_step.py -- --dummy-weight --model-path configs/qwen3.6-35b-a3b-nvfp4 \\
        --max-running-requests 32 --moe-backend fused
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import time
from unittest import mock

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python"))
from profile_decode import profile_steps, worker_args  # noqa: E402
from report import write_report  # noqa: E402

from freetoken.engine.step_plan import StepPlan  # noqa: E402
from freetoken.layers import gated_deltanet  # noqa: E402
from freetoken.worker import Worker  # noqa: E402

KV_STRIDE = 1024  # KV slots per sequence's region


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompt-tokens", type=int, default=7)
    ap.add_argument("--mixed-prompt-tokens", type=int, default=200)
    ap.add_argument("--streams", type=int, default=32)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--host-profile", type=int, default=0, help="cProfile one step, print this many functions")
    ap.add_argument(
        "--host-profile-shapes",
        default="",
        help="'|'-separated texts: profile the step of every shape whose name holds one (default: the first shape)",
    )
    ap.add_argument(
        "--device-profile", type=int, default=0, help="each shape's step under the torch profiler: top N by device time"
    )
    ap.add_argument("--out", default="bench/out/batch_prefill_step.json")
    ap.add_argument("serve_args", nargs=argparse.REMAINDER)
    return ap.parse_args()


def seq(row: int, tokens: list[int], prefix: int, state: bool) -> dict:
    """Sequence ``row`` of a step: its KV slots in its own region, its state in slot ``row``, sampled greedily."""
    base = row * KV_STRIDE + prefix
    return {
        "tokens": tokens,
        "prefix_len": prefix,
        "row": row,
        "table_from": prefix,
        "table_slots": list(range(base, base + len(tokens))),
        "state_slot": row if state else -1,
        "sample": {"temperature": 0.0},
    }


def shapes(a: argparse.Namespace, state: bool, vocab: int, snap_slot: int) -> dict[str, StepPlan]:
    n, p = a.streams, a.prompt_tokens

    def distinct(count: int, start: int) -> list[int]:
        # distinct tokens: under the dummy router a repeated token sends every row to the same 8 experts (the
        # control's MoE ran 9.7 ms against 16.1 for the 32 prompts on 2026-12-06, all of it that artefact)
        return [(start + 7 * i) % vocab for i in range(count)]

    m = a.mixed_prompt_tokens
    # the decode tokens first, the prompt last: the scheduler's order (decoders, then prefills), which decides how the
    # snapshot rounds take the prompt (``gated_delta_rule_in_rounds``: views when the only cut sequence is last)
    mixed = [seq(r, [(12 + r) % vocab], p, state) for r in range(1, n)] + [seq(0, distinct(m, 11), 0, state)]
    grid = (m - 1) // 64 * 64

    def joined_with_snapshots(seqs: list[dict], grid: int, end: int) -> StepPlan:
        # the served form of the joining prompt's step under the hybrid radix cache: its state captured at its
        # last grid point and at its end (into the last snapshot slot), so its GDN layers run in rounds
        plan = StepPlan.build(seqs)
        plan.snap_seq = torch.full((2,), len(seqs) - 1, dtype=torch.int64)
        plan.snap_upto = torch.tensor([grid, end], dtype=torch.int64)
        plan.snap_slot = torch.full((2,), snap_slot, dtype=torch.int64)
        return plan

    return {
        f"{n} prompts x {p}": StepPlan.build([seq(r, distinct(p, 10 + 7 * p * r), 0, state) for r in range(n)]),
        f"1 prompt x {m} + {n - 1} decode": StepPlan.build(mixed),
        f"1 prompt x {n * p}": StepPlan.build([seq(0, distinct(n * p, 10), 0, state)]),
        **({f"+ snapshots at {grid}, {m}": joined_with_snapshots(mixed, grid, m)} if state else {}),
    }


def step_ms(w: Worker, plan: StepPlan, sync) -> float:
    sync()
    t0 = time.perf_counter()
    w.execute_plan(plan)
    sync()
    return (time.perf_counter() - t0) * 1e3


def path_patch(path: str):
    """The environment of one compared path (``default``: as served)."""
    return {
        "eager varlen": mock.patch.dict(os.environ, {"FREETOKEN_GDN_BATCH_GRAPHS": "0"}),
        "fla public": mock.patch.object(gated_deltanet, "_fla_direct_varlen", lambda: False),
    }.get(path, contextlib.nullcontext())


def main() -> int:
    a = parse_args()
    w = Worker(worker_args([x for x in a.serve_args if x != "--"]))
    if w.max_running_requests < a.streams:
        raise SystemExit(f"--max-running-requests {w.max_running_requests} < --streams {a.streams}")
    hybrid = w.state is not None
    sync = torch.cuda.synchronize if w.device.type == "cuda" else (lambda: None)
    plans = shapes(a, hybrid, w.vocab_size, w.num_state_slots - 1 if hybrid else -1)
    # the decode sequences' prompts, so that their tokens continue something
    w.execute_plan(
        StepPlan.build([seq(r, [(5 * r + 10) % w.vocab_size] * a.prompt_tokens, 0, hybrid) for r in range(a.streams)])
    )
    paths = ["default", "eager varlen", "fla public"] if hybrid else ["-"]
    rows = []
    # the paths take turns step by step (the order rotating), so that the host's drifts (these steps are host-bound
    # in part, and the machine is shared) fall on every path alike; each round reports medians
    for rnd in range(1, a.rounds + 1):
        for name, plan in plans.items():
            for path in paths:  # its kernels compiled, its allocations made
                with path_patch(path):
                    w.execute_plan(plan)
            samples: dict[str, list[float]] = {p: [] for p in paths}
            for rep in range(a.reps):
                for path in paths[rep % len(paths) :] + paths[: rep % len(paths)]:
                    with path_patch(path):
                        samples[path].append(step_ms(w, plan, sync))
            for path in paths:
                ms = statistics.median(samples[path])
                rows.append({"round": rnd, "path": path, "shape": name, "ms": ms, "samples_ms": samples[path],
                             "tokens": plan.num_tokens})  # fmt: skip
                print(f"[round {rnd}] {path:<12} {name:<26} {ms:8.2f} ms ({plan.num_tokens} tokens)", flush=True)
    print(f"\n{'shape':<26} " + " ".join(f"{p:>14}" for p in paths) + "   (ms per step, best round)")
    for name in plans:
        best = [min(r["ms"] for r in rows if r["shape"] == name and r["path"] == p) for p in paths]
        print(f"{name:<26} " + " ".join(f"{b:14.2f}" for b in best))
    if len(paths) > 1:  # each step beside the one the next path took right after or before it
        print(f"\npaired ratio to '{paths[1]}' (median over every round's steps, taken in turns):")
        for name in plans:
            ratios = []
            for rnd in range(1, a.rounds + 1):
                per = {r["path"]: r["samples_ms"] for r in rows if r["shape"] == name and r["round"] == rnd}
                ratios += [x / y for x, y in zip(per[paths[0]], per[paths[1]])]
            print(f"  {name:<26} {paths[0]} / {paths[1]} = {statistics.median(ratios):.3f}")
    if a.host_profile:  # where the host time of a shape's step goes (the default path)
        import cProfile
        import pstats

        texts = [t for t in a.host_profile_shapes.split("|") if t]
        chosen = [n for n in plans if any(t in n for t in texts)] if texts else [next(iter(plans))]
        for name in chosen:
            sync()
            prof = cProfile.Profile()
            prof.runcall(w.execute_plan, plans[name])
            print(f"\nhost profile of one '{name}' step (default), top {a.host_profile} by own time:")
            stats = pstats.Stats(prof)
            stats.sort_stats("tottime").print_stats(a.host_profile)
            print("the GDN functions of that step by cumulative time:")
            stats.sort_stats("cumulative").print_stats("gated_deltanet|gdn_", a.host_profile)
    profiles = {}
    for name, plan in plans.items() if a.device_profile else ():  # the default path: where each step's device time goes
        timeline: dict = {}
        _, by_dev, busy = profile_steps(lambda: w.execute_plan(plan), sync, w.device, 1, a.device_profile, timeline)
        profiles[name] = {"device_busy_ms": busy, "timeline": timeline, "by_device": by_dev}
        span = timeline.get("span_ms")
        print(f"\n'{name}' (default): device busy {busy:.2f} ms" + (f" of a {span:.2f} ms span" if span else ""))
        for r in by_dev:
            print(f"  {r['op'][:70]:<72}{r['calls_per_step']:>6.0f}{r['self_device_ms_per_step']:>9.3f} ms")
    device = torch.cuda.get_device_name() if w.device.type == "cuda" else "cpu"
    routing = os.environ.get("FREETOKEN_BENCH_ROUTING") or "the router's own"
    report = {
        "device": device,
        "routing": routing,
        "serve_args": a.serve_args,
        "rows": rows,
        "device_profiles": profiles,
    }
    write_report(a.out, report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
