"""The host (launch-side) cost of one Gated DeltaNet prefill call through fla, beside its elapsed time, at Qwen3.6's
GDN shape (16 key heads, 32 value heads, 128 x 128 state). Issue 12's cached agent turn (2,184 new tokens) is
host-bound: the torch profiler put ~1.75 ms of host time in each of the step's 30 ``ChunkGatedDeltaRuleFunction``
calls against ~0.16 ms of device time. This times, per call and with no sync inside the loop (what a step pays):

- ``public``: ``fla.ops.gated_delta_rule.chunk_gated_delta_rule`` (backend dispatch, ``torch.compiler.disable``,
  ``input_guard``, the autograd Function, l2norm in the wrapper), as the layer calls it for several sequences;
- ``direct``: ``layers/gated_deltanet.fla_direct_prefill`` (fla's forward pieces called directly), as the layer
  calls it for one;

then lists the top functions of one ``public`` call under cProfile (``engine/step_profiler.host_profile``), and checks
that both give the same output.

    python3 bench/fla_host_cost.py --tokens 2184 --out bench/out/fla_host_cost.json      # CUDA + fla
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python"))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from report import write_report  # noqa: E402

from freetoken.engine.step_profiler import host_profile  # noqa: E402
from freetoken.layers import gated_deltanet as gdn  # noqa: E402


def inputs(T: int, hk: int, hv: int, d: int, device: str):
    """Conv outputs and gates shaped as the layer hands them to ``gated_delta_rule`` (bf16 q/k/v, fp32 g/beta)."""
    g = torch.Generator(device=device).manual_seed(0)
    q = torch.randn(T, hk, d, device=device, dtype=torch.bfloat16, generator=g)
    k = torch.randn(T, hk, d, device=device, dtype=torch.bfloat16, generator=g)
    v = torch.randn(T, hv, d, device=device, dtype=torch.bfloat16, generator=g)
    gate = -torch.rand(T, hv, device=device, generator=g) * 0.1
    beta = torch.rand(T, hv, device=device, generator=g)
    state = torch.randn(1, hv, d, d, device=device, dtype=torch.float32, generator=g) * 0.01
    return q, k, v, gate, beta, state


def host_and_elapsed_ms(fn, reps: int) -> tuple[float, float]:
    """(host ms per call with no sync in the loop, ms per call between CUDA events around the same loop: the
    device's timeline, idle gaps included, so the larger of the call's host and device time)."""
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    host = (time.perf_counter() - t0) / reps * 1e3
    end.record()
    torch.cuda.synchronize()
    return host, start.elapsed_time(end) / reps


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=2184)
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--out", default="bench/out/fla_host_cost.json")
    a = ap.parse_args()
    if not torch.cuda.is_available() or gdn._fla_ops() is None:
        raise SystemExit("needs CUDA and fla")
    q, k, v, gate, beta, state = inputs(a.tokens, 16, 32, 128, "cuda")
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    chunk, _, takes_cpu_cu = gdn._fla_ops()
    cu = [0, a.tokens]
    variants = {
        "public": lambda: gdn._fla_public_chunk(chunk, takes_cpu_cu, q, k, v, gate, beta, state, cu),
        "direct": lambda: gdn.fla_direct_prefill(q, k, v, gate, beta, state),
    }
    outs = {name: fn() for name, fn in variants.items()}
    o_ref, s_ref = outs["public"]
    rows = []
    print(f"fla {a.tokens}-token GDN prefill call (Hk 16, Hv 32, 128 x 128 state), {a.reps} calls, no sync between")
    print(f"{'variant':<10} {'host ms':>8} {'elapsed ms':>10} {'max |do|':>10} {'max |dS|':>10}")
    for name, fn in variants.items():
        host, elapsed = host_and_elapsed_ms(fn, a.reps)
        o, s = outs[name]
        do = (o.float() - o_ref.float()).abs().max().item()
        ds = (s.float() - s_ref.float()).abs().max().item()
        rows.append(
            {"variant": name, "host_ms": host, "elapsed_ms": elapsed, "max_abs_diff_o": do, "max_abs_diff_state": ds}
        )
        print(f"{name:<10} {host:8.3f} {elapsed:10.3f} {do:10.2e} {ds:10.2e}")
    top = host_profile(variants["public"], torch.cuda.synchronize, a.top, repeats=10)
    print(f"\none public call under cProfile (own ms, cumulative ms, calls per call; top {a.top}):")
    for r in top:
        print(f"  {r['own_ms']:7.3f} {r['cum_ms']:8.3f} {r['calls']:6.1f}  {r['function']}")
    write_report(a.out, {"tokens": a.tokens, "variants": rows, "public_cprofile": top})
    return 0


if __name__ == "__main__":
    sys.exit(main())
