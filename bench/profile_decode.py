"""Where a decode step's time goes: builds the worker in-process (no HTTP, no scheduler), prefills ``--batch``
prompts (default 1; the serve args' ``--max-running-requests`` must allow as many), then times decode steps of
that batch from the decode CUDA graph (``Worker.execute``) and eagerly (``Worker.execute_plan``) and profiles a
few eager ones with ``torch.profiler``. Prints the mean step time, the host time the GPU waited on, and the top
operators by host (self CPU) and device time; writes JSON.

    python bench/profile_decode.py --out bench/out/profile.json -- --dummy-weight --model-path configs/qwen3.6-35b-a3b
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python"))
from report import write_report  # noqa: E402

from freetoken.engine.device_timeline import device_intervals, timeline  # noqa: E402
from freetoken.engine.step_plan import StepPlan  # noqa: E402
from freetoken.engine.step_profiler import top_ops  # noqa: E402
from freetoken.worker import Worker  # noqa: E402


def worker_args(serve_args: list[str]) -> dict:
    """``--flag value`` / ``--switch`` pairs -> the worker's snake_case dict."""
    out, i = {"load_progress": False}, 0
    while i < len(serve_args):
        key = serve_args[i].lstrip("-").replace("-", "_")
        if i + 1 < len(serve_args) and not serve_args[i + 1].startswith("--"):
            val = serve_args[i + 1]
            out[key] = int(val) if val.isdigit() else val
            i += 2
        else:
            out[key] = True
            i += 1
    return out


def batch_plan(tokens: list[list[int]], prefix: int, state_slots: list[int], kv_stride: int) -> StepPlan:
    """One step over ``len(tokens)`` sequences of equal length: sequence i in row i, its KV slots from
    ``i * kv_stride``, its recurrent state in ``state_slots[i]``."""
    return StepPlan.build(
        [
            {
                "tokens": toks,
                "prefix_len": prefix,
                "row": i,
                "table_from": prefix,
                "table_slots": list(range(i * kv_stride + prefix, i * kv_stride + prefix + len(toks))),
                "state_slot": state_slots[i],
                "sample": {"temperature": 0.0},
            }
            for i, toks in enumerate(tokens)
        ]
    )


def parse_args() -> argparse.Namespace:
    """The command line."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompt-tokens", type=int, default=512)
    ap.add_argument("--batch", type=int, default=1, help="sequences decoded together")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--profile-steps", type=int, default=5)
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument(
        "--hbm-gbs", type=float, default=4190.0, help="the measured device copy bandwidth, for the expert roofline"
    )
    ap.add_argument("--out", default="bench/out/profile_decode.json")
    ap.add_argument("serve_args", nargs=argparse.REMAINDER)
    return ap.parse_args()


def main() -> int:
    a = parse_args()
    w = Worker(worker_args([x for x in a.serve_args if x != "--"]))
    slots = list(range(a.batch)) if w.state is not None else [-1] * a.batch
    sync = torch.cuda.synchronize if w.device.type == "cuda" else (lambda: None)
    stride = a.prompt_tokens + a.steps * 2 + a.profile_steps + 16  # KV slots per sequence, every step included
    prompts = [[(i * 37 + 101 * b) % 1000 + 10 for i in range(a.prompt_tokens)] for b in range(a.batch)]
    toks = list(w.execute_plan(batch_plan(prompts, 0, slots, stride)).tokens)
    pos = a.prompt_tokens

    eager = True

    def step():
        nonlocal toks, pos
        plan = batch_plan([[t] for t in toks], pos, slots, stride)
        toks = list(w.execute_plan(plan).tokens if eager else w.execute(plan.to_flat())[0])
        pos += 1

    def timed() -> float:
        for _ in range(3):  # warm-up: JIT, allocator
            step()
        sync()
        t0 = time.perf_counter()
        for _ in range(a.steps):
            step()
        sync()
        return (time.perf_counter() - t0) / a.steps * 1e3

    graph_ms = None
    if w.graphs is not None:  # the decode CUDA graph first, then the same step eagerly
        eager = False
        graph_ms = timed()
        eager = True
    step_ms = timed()

    touched = experts_touched(w.model, step)
    by_cpu, by_dev, device_ms = profile_steps(step, sync, w.device, a.profile_steps, a.top)
    result = {
        "serve_args": a.serve_args,
        "batch": a.batch,
        "graph_step_ms": graph_ms,
        "step_ms": step_ms,
        "tok_s": a.batch * 1e3 / step_ms,
        "device_busy_ms_per_step": device_ms,
        "experts_touched": touched,
        "expert_roofline_ms": touched["expert_bytes_per_step"] / (a.hbm_gbs * 1e6) if touched else None,
        "by_self_cpu": by_cpu,
        "by_device": by_dev,
    }
    write_report(a.out, result)
    print_profile(result)
    return 0


def experts_touched(model: torch.nn.Module, step) -> dict | None:
    """One eager step with every MoE layer's routing recorded: the distinct experts each layer touched (the bytes
    a step must read for its routed experts: once per distinct expert, whatever the batch) and their weight bytes.
    None for a model without routed experts."""
    from freetoken.layers.moe import ExpertsBackend

    layers = [m for m in model.modules() if isinstance(m, ExpertsBackend)]
    if not layers:
        return None
    distinct: list[int] = []
    hooks = [
        m.register_forward_pre_hook(lambda _m, args: distinct.append(int(torch.unique(args[1]).numel())))
        for m in layers
    ]
    try:
        step()
    finally:
        for h in hooks:
            h.remove()
    per_expert = [
        sum(t.numel() * t.element_size() for t in m.parameters()) / m.num_experts for m in layers
    ]  # the resident banks (an offloaded layer keeps its experts outside its parameters: 0)
    return {
        "layers": len(layers),
        "distinct_per_layer_mean": sum(distinct) / max(1, len(distinct)),
        "distinct_per_layer_min_max": [min(distinct, default=0), max(distinct, default=0)],
        "bytes_per_expert": per_expert[0],
        "expert_bytes_per_step": sum(d * b for d, b in zip(distinct, per_expert)),
    }


def profile_steps(step, sync, device, n: int, top: int, timeline_out: dict | None = None):
    """Runs ``n`` eager steps under the torch profiler: the ``top`` ops by self CPU time and by device time (per
    step), and the device's busy time per step. ``timeline_out`` (a dict) receives the device's timeline over the
    profiled steps (``device_timeline.timeline``: span, busy, idle, longest gaps; meant for ``n`` = 1)."""
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=acts) as prof:
        for _ in range(n):
            step()
        sync()
    if timeline_out is not None:
        timeline_out.update(timeline(device_intervals(prof.events())) or {})
    return top_ops(prof.key_averages(), n, top)


def print_profile(result: dict) -> None:
    graph_ms, step_ms, device_ms = result["graph_step_ms"], result["step_ms"], result["device_busy_ms_per_step"]
    b, kind = result["batch"], result.get("kind", "decode")
    if graph_ms is not None:
        print(f"batch {b}: {kind} step from the CUDA graph {graph_ms:.2f} ms ({b * 1e3 / graph_ms:.1f} tok/s)")
    print(
        f"batch {b}: {kind} step eager {step_ms:.2f} ms ({result['tok_s']:.1f} tok/s); "
        f"device busy {device_ms:.2f} ms/step "
        f"(profiled eagerly: the same kernels the graph replays, plus the launches)"
    )
    t = result.get("experts_touched")
    if t:
        print(
            f"batch {b}: routed experts touched per layer {t['distinct_per_layer_mean']:.1f} "
            f"(min {t['distinct_per_layer_min_max'][0]}, max {t['distinct_per_layer_min_max'][1]}) of "
            f"{t['layers']} layers, {t['expert_bytes_per_step'] / 1e9:.2f} GB of expert weights a step: "
            f"{result['expert_roofline_ms']:.2f} ms at the copy bandwidth"
        )
    for title, table in (("self CPU", result["by_self_cpu"]), ("device", result["by_device"])):
        print(f"\ntop by {title} time (ms per step):")
        print(f"{'op':<60}{'calls':>8}{'cpu ms':>10}{'dev ms':>10}")
        for r in table:
            print(
                f"{r['op'][:59]:<60}{r['calls_per_step']:>8.0f}{r['self_cpu_ms_per_step']:>10.3f}"
                f"{r['self_device_ms_per_step']:>10.3f}"
            )


if __name__ == "__main__":
    sys.exit(main())
