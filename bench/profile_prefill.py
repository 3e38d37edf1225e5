"""Where a prefill chunk over a long cached prefix spends its time (issue 12's agent turn: ~2,200 new tokens after
~28,000 cached ones): builds the worker in-process (no HTTP, no scheduler, no radix tree), prefills ``--context``
tokens in ``--max-prefill-length`` chunks, then times a ``--new``-token chunk at that position eagerly (the same
chunk re-run over the same KV slots) and profiles it. The gap between this worker time and the HTTP TTFT of
``bench/agent_session_bench.py`` is what the server, the tokenizer path and the cache bookkeeping add.
``--routing off,uniform`` times the chunk under each ``FREETOKEN_BENCH_ROUTING`` mode (the dummy router
concentrates tokens on few experts; uniform routing gives every expert its share, as a trained router does).
``--snapshots none,end,grid`` times the chunk with the recurrent-state snapshots the hybrid radix scheduler asks of
a prompt's last chunk: none, one at the chunk's end, or also one at the last 64-token grid point inside it (the
tokens after it are a second delta-rule pass per GDN layer, token by token: ``kernels/gdn_recurrent_piece.py``).
On CUDA each timed chunk is also run once under ``torch.cuda.set_sync_debug_mode("warn")``: the host syncs of one
step, counted by the innermost call site in our code or fla's (a sync mid-step lets the GPU drain while the host
launches the rest, so a host-bound step pays CPU and GPU time in series). ``--host-profile N`` then runs one step
under cProfile and lists the N functions with the most host time of their own (a step whose device is idle part of
the time is bound by these).

    python bench/profile_prefill.py --context 27816 --new 2184 --out bench/out/profile_prefill.json -- \\
        --dummy-weight --model-path configs/qwen3.6-35b-a3b --max-seq-len-override 32768 --moe-backend fused
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python"))
from gpu_clocks import ClockSampler  # noqa: E402
from profile_decode import batch_plan, print_profile, profile_steps, worker_args  # noqa: E402
from report import write_report  # noqa: E402

from freetoken.engine.device_timeline import format_timeline  # noqa: E402
from freetoken.engine.step_profiler import host_profile  # noqa: E402
from freetoken.moe import bench_routing  # noqa: E402
from freetoken.worker import Worker  # noqa: E402


def parse_args() -> argparse.Namespace:
    """The command line."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--context", type=int, default=27816, help="cached tokens before the chunk")
    ap.add_argument("--new", type=int, default=2184, help="tokens of the timed chunk")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--routing", default="off", help="comma-separated FREETOKEN_BENCH_ROUTING modes, each timed")
    ap.add_argument("--snapshots", default="none", help="comma-separated: none, end, grid (grid point + end)")
    ap.add_argument("--rounds", type=int, default=2, help="timing rounds over the modes, alternating their order")
    ap.add_argument(
        "--env-ab",
        default="",
        help="VAR=VALUE: every mode is also timed with this environment variable set (an A/B switch such as "
        "FREETOKEN_GDN_STAGE_INPUTS=0), interleaved with the default; only the default is profiled",
    )
    ap.add_argument("--profile-steps", type=int, default=2, help="eager steps under the torch profiler (0: none)")
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument(
        "--host-profile", type=int, default=30, help="functions listed from one step under cProfile (0: skip)"
    )
    ap.add_argument("--out", default="bench/out/profile_prefill.json")
    ap.add_argument("serve_args", nargs=argparse.REMAINDER)
    return ap.parse_args()


def host_sync_sites(step) -> dict[str, int]:
    """One ``step()`` under torch's sync debug mode: ``{call site: syncs}``, a site being the innermost frame of
    freetoken or fla (else torch's own) on the Python stack when the synchronizing call warned."""
    import collections
    import traceback
    import warnings

    sites: collections.Counter = collections.Counter()

    def record(message, category, filename, lineno, file=None, line=None):
        if "synchronizing" not in str(message):
            return
        frames = [f for f in traceback.extract_stack()[:-1] if "freetoken" in f.filename or "/fla/" in f.filename]
        f = frames[-1] if frames else None
        sites[f"{os.path.basename(f.filename)}:{f.lineno} {f.name}" if f else f"{filename}:{lineno}"] += 1

    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = record
        torch.cuda.set_sync_debug_mode("warn")
        try:
            step()
            torch.cuda.synchronize()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return dict(sites)


def main() -> int:
    a = parse_args()
    w = Worker(worker_args([x for x in a.serve_args if x != "--"]))
    slots = [0 if w.state is not None else -1]
    sync = torch.cuda.synchronize if w.device.type == "cuda" else (lambda: None)
    ids = [(i * 37) % 1000 + 10 for i in range(a.context + a.new)]
    stride = a.context + a.new
    t0 = time.perf_counter()
    for start in range(0, a.context, w.max_prefill_length):
        chunk = ids[start : min(a.context, start + w.max_prefill_length)]
        w.execute_plan(batch_plan([chunk], start, slots, stride))
    sync()
    context_s = time.perf_counter() - t0

    def plan_with(snapshots: str):
        plan = batch_plan([ids[a.context :]], a.context, slots, stride)
        end, grid = a.context + a.new, (a.context + a.new - 1) // 64 * 64
        points = {"none": [], "end": [end], "grid": [p for p in (grid, end) if p > a.context]}[snapshots]
        if points and w.state is None:
            raise SystemExit("--snapshots needs a model with recurrent state")
        plan.snap_seq = torch.zeros(len(points), dtype=torch.int64)
        plan.snap_upto = torch.tensor(points, dtype=torch.int64)
        plan.snap_slot = torch.arange(w.num_state_slots - len(points), w.num_state_slots, dtype=torch.int64)
        plan.validate()
        return plan

    modes = [(m, s) for m in a.routing.split(",") for s in a.snapshots.split(",")]
    # timed variants: the modes as they are, and with --env-ab's variable set (a third element)
    variants = modes + [(m, s, a.env_ab) for m, s in modes if a.env_ab]

    launch_device: dict[tuple, list[tuple[float, float]]] = {}

    def timed(variant: tuple) -> float:
        """ms a step of ``variant`` (routing, snapshots[, VAR=VALUE set for these steps only]), over ``--reps``
        steps after a warm-up one (JIT for this chunk's shapes); each step's host time to enqueue its forward and
        its span on the device are kept (``launch_device``)."""
        mode, snapshots = variant[:2]
        var, _, value = (variant[2] if len(variant) > 2 else "").partition("=")
        before = os.environ.get(var) if var else None
        if var:
            os.environ[var] = value
        try:
            bench_routing.set_mode(mode)
            plan = plan_with(snapshots)
            w.execute_plan(plan)
            sync()
            t0 = time.perf_counter()
            stats = [w.execute_plan(plan).stats for _ in range(a.reps)]
            sync()
        finally:
            if var and before is None:
                os.environ.pop(var)
            elif var:
                os.environ[var] = before
        ms = (time.perf_counter() - t0) / a.reps * 1e3
        launch_device.setdefault(variant, []).append(
            (sum(s["launch_ms"] for s in stats) / a.reps, sum(s.get("device_ms", 0.0) for s in stats) / a.reps)
        )
        return ms

    # every mode is timed before any is profiled (a profiler session can leave launches slower after it), in
    # rounds of alternating order: the spread says how far one figure can be trusted, and the SM clock sampled
    # during each timing (bench/gpu_clocks.py) whether the card, not the code, moved it
    times: dict[tuple[str, str], list[float]] = {}
    clocks_during: dict[tuple[str, str], list[dict]] = {}
    with ClockSampler() as clocks:
        for r in range(a.rounds):
            for m in variants if r % 2 == 0 else variants[::-1]:
                wall0 = time.time()
                times.setdefault(m, []).append(timed(m))
                clocks_during.setdefault(m, []).append(clocks.window(wall0, time.time()))
    print(
        f"step ms by mode ({a.rounds} rounds, alternating order, before any profiling; "
        "[host launch ms / device span ms, min/mean SM MHz]):"
    )
    for m, ts in times.items():
        notes = [
            f"[{lm:.1f}/{dm:.1f}, {c.get('sm_mhz_min', '-')}/{c.get('sm_mhz_mean', '-')}]"
            for (lm, dm), c in zip(launch_device[m], clocks_during[m])
        ]
        env = f", {m[2]}" if len(m) > 2 else ""
        print(f"  routing {m[0]}, snapshots {m[1]}{env}: " + ", ".join(f"{t:.1f} {n}" for t, n in zip(ts, notes)))

    results = []
    for mode, snapshots in modes:
        bench_routing.set_mode(mode)
        plan = plan_with(snapshots)

        def step():
            w.execute_plan(plan)

        step_ms = min(times[(mode, snapshots)])
        device_line: dict = {}  # the profiled steps' device timeline (span, busy, idle, longest gaps)
        by_cpu, by_dev, device_ms = [], [], None  # --profile-steps 0: the timings above only
        if a.profile_steps > 0:
            by_cpu, by_dev, device_ms = profile_steps(step, sync, w.device, a.profile_steps, a.top, device_line)
        syncs = host_sync_sites(step) if w.device.type == "cuda" else {}
        host = host_profile(step, sync, a.host_profile) if a.host_profile else []
        result = {
            "serve_args": a.serve_args,
            "routing": mode,
            "snapshots": snapshots,
            "batch": 1,
            "kind": f"prefill ({a.new} tokens after {a.context}, routing {mode}, snapshots {snapshots})",
            "context": a.context,
            "new": a.new,
            "context_prefill_s": context_s,
            "graph_step_ms": None,
            "step_ms": step_ms,
            "step_ms_runs": times[(mode, snapshots)],
            "env_ab": a.env_ab or None,
            "env_ab_step_ms_runs": times.get((mode, snapshots, a.env_ab)),
            "env_ab_launch_device_ms_runs": launch_device.get((mode, snapshots, a.env_ab)),
            "clocks_during_runs": clocks_during[(mode, snapshots)],
            "launch_device_ms_runs": launch_device[(mode, snapshots)],
            "tok_s": a.new * 1e3 / step_ms,
            "device_busy_ms_per_step": device_ms,
            "device_timeline_profiled": device_line or None,
            "by_self_cpu": by_cpu,
            "by_device": by_dev,
            "host_sync_sites": syncs,
            "host_profile": host,
        }
        results.append(result)
        busy = f", device busy {device_ms:.1f} ms" if device_ms is not None else ""
        print(
            f"\ncontext {a.context} tokens prefilled in {context_s:.2f} s; chunk of {a.new} new tokens after it, "
            f"routing {mode}, snapshots {snapshots}: {step_ms:.1f} ms ({a.new * 1e3 / step_ms:.0f} tok/s){busy}"
        )
        if device_ms is not None:
            print_profile(result)
        if device_line:
            print(format_timeline(device_line).strip())
        print(f"host syncs in one step: {sum(syncs.values())}")
        for site, n in sorted(syncs.items(), key=lambda kv: -kv[1]):
            print(f"  {n:>4} x {site}")
        if host:
            print(f"host time by function, one step under cProfile (own ms, cumulative ms, calls; top {len(host)}):")
            for r in host:
                print(f"  {r['own_ms']:8.2f} {r['cum_ms']:9.2f} {r['calls']:6.0f}  {r['function']}")
                for c in r["callers"]:
                    print(f"{'':30}from {c}")
    write_report(a.out, {"rows": results})  # one row a (routing, snapshots) mode; older result files hold the bare list
    return 0


if __name__ == "__main__":
    sys.exit(main())
