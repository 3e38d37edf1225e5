"""Device time of the Gated DeltaNet tail kernel (``kernels/gdn_recurrent_piece.py``): the < 64 tokens after a
snapshot grid point inside a cached agent turn's chunk, token by token in one launch, at Qwen3.6's GDN shape (16 key
heads, 32 value heads, 128 x 128 fp32 state), beside fla's ``fused_recurrent_gated_delta_rule`` on the same inputs
(the recurrent kernel the layer ran before). Both are sequential over the tokens, so per-token latency is what
matters; the table also gives the bytes they must move (state in and out, the tokens' q/k/v/gates) as a fraction of
the H200's HBM peak, to show how far from bandwidth-bound a latency-bound kernel is.

Device time is the mean over ``--reps`` launches captured in one CUDA graph and replayed between CUDA events (no host
time in it); the host column is a launch's host time queued eagerly (what a step's Python pays per GDN layer). On the
H200 (2026-12-03) the eager launch is host-bound: ~55-65 us of host per call, about the device time.

    python3 bench/gdn_piece_bench.py --out bench/out/gdn_piece.json
    python3 bench/gdn_piece_bench.py --module some.module   # another build of the kernel (A/B), same contract
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python"))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from hardware_bandwidth import graph_device_ms  # noqa: E402  (bench/, this script's directory)
from report import write_report  # noqa: E402

HBM_PEAK_GBS = 4800.0  # H200 datasheet


def inputs(T: int, hk: int, hv: int, d: int):
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(T, hk, d, device="cuda", dtype=torch.bfloat16, generator=g)
    k = torch.randn(T, hk, d, device="cuda", dtype=torch.bfloat16, generator=g)
    v = torch.randn(T, hv, d, device="cuda", dtype=torch.bfloat16, generator=g)
    gate = -torch.rand(T, hv, device="cuda", generator=g) * 0.1
    beta = torch.rand(T, hv, device="cuda", generator=g)
    state = torch.randn(1, hv, d, d, device="cuda", dtype=torch.float32, generator=g) * 0.01
    return q, k, v, gate, beta, state


def timed(fn, reps: int) -> tuple[float, float]:
    """(device us per call: ``reps`` calls captured in one CUDA graph and replayed, so no host time is in it; host
    us per call queued eagerly, what a step's Python pays)."""
    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    host = (time.perf_counter() - t0) / reps * 1e6
    torch.cuda.synchronize()
    try:
        return graph_device_ms(fn, reps) * 1e3, host
    except RuntimeError as e:  # not capturable (a baseline's wrapper may sync): queued eagerly, host time included
        print(f"  (not capturable, timed eagerly: {str(e).splitlines()[0][:100]})")
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps * 1e3, host


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", default="1,9,21,48,63", help="tail lengths")
    p.add_argument("--reps", type=int, default=200)
    p.add_argument("--warps", default=None, help="warps a program, comma-separated (default: the kernel's own)")
    p.add_argument("--module", default="freetoken.kernels.gdn_recurrent_piece", help="module with the kernel")
    p.add_argument("--out", default="bench/out/gdn_piece.json")
    a = p.parse_args(argv)
    assert torch.cuda.is_available(), "needs CUDA"
    piece = importlib.import_module(a.module)
    try:
        from fla.ops.gated_delta_rule import fused_recurrent_gated_delta_rule
    except Exception:  # the baseline is optional
        fused_recurrent_gated_delta_rule = None
    hk, hv, d = 16, 32, 128
    rows = []
    launches = [{}] if a.warps is None else [{"warps": int(w)} for w in a.warps.split(",")]
    for T, launch in [(int(t), w) for t in a.tokens.split(",") for w in launches]:
        q, k, v, gate, beta, state = inputs(T, hk, hv, d)
        run = lambda: piece.gdn_recurrent_piece_triton(q, k, v, gate, beta, state, **launch)  # noqa: E731
        ours, ours_host = timed(run, a.reps)
        o, final = run()
        fla_us = err = None
        if fused_recurrent_gated_delta_rule is not None:

            def fla():  # keywords only, as the layer calls it (its 5th positional parameter is gk)
                return fused_recurrent_gated_delta_rule(
                    q=q[None],
                    k=k[None],
                    v=v[None],
                    g=gate[None],
                    beta=beta[None],
                    scale=d**-0.5,
                    initial_state=state,
                    output_final_state=True,
                    use_qk_l2norm_in_kernel=True,
                )

            fla_us, _ = timed(fla, a.reps)
            o_ref, final_ref = fla()
            err = max((o.float() - o_ref[0].float()).abs().max().item(), (final - final_ref).abs().max().item())
        moved = 2 * state.numel() * 4 + T * (2 * hk * d + hv * d) * 2 + 2 * T * hv * 4 + T * hv * d * 2
        rows.append(
            {
                "tokens": T,
                "warps": launch.get("warps", getattr(piece, "PIECE_WARPS", 4)),
                "us": ours,
                "us_per_token": ours / T,
                "host_us": ours_host,
                "hbm_fraction": moved / (ours * 1e-6) / 1e9 / HBM_PEAK_GBS,
                "fla_recurrent_us": fla_us,
                "ratio_to_fla": None if fla_us is None else ours / fla_us,
                "max_abs_diff_vs_fla": err,
            }
        )
    f = lambda x, spec: "-" if x is None else format(x, spec)  # noqa: E731
    print(f"GDN tail kernel ({a.module}), Qwen3.6 GDN shape, {torch.cuda.get_device_name()}, {a.reps} reps")
    print(
        f"{'tokens':>6}{'warps':>6}{'us':>9}{'us/token':>10}{'host us':>9}{'of HBM':>8}{'fla us':>9}{'ours/fla':>9}{'max diff':>10}"
    )
    for r in rows:
        print(
            f"{r['tokens']:>6}{r['warps']:>6}{r['us']:>9.1f}{r['us_per_token']:>10.2f}{r['host_us']:>9.1f}{r['hbm_fraction']:>8.1%}"
            f"{f(r['fla_recurrent_us'], '.1f'):>9}{f(r['ratio_to_fla'], '.2f'):>9}{f(r['max_abs_diff_vs_fla'], '.1e'):>10}"
        )
    write_report(a.out, {"module": a.module, "gpu": torch.cuda.get_device_name(), "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
