"""Device time of the Gated DeltaNet prefill conv (``kernels/gdn_conv_prefill.py``) at Qwen3.6-35B-A3B's shape
(8,192 channels, kernel 4, qkv a column view of the fused 12,352-column input projection) under tile configs, as
the layer runs it (q | k | v written as three contiguous blocks into a buffer given once). A memory-bound kernel:
the table gives the bytes it must move (qkv read once, y written once) against the HBM copy bandwidth measured
beside it. Device time from CUDA-graph replays (``graph_device_ms``: timed eagerly, a call reads its host launch,
~200 us). On the H200 (2026-12-04 profile) the default 32 x 128 tiles took ~75 us a layer at 2,184 tokens, ~1 TB/s.

    python3 bench/gdn_conv_bench.py --out bench/out/gdn_conv.json
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "python"))
sys.path.insert(0, os.path.join(ROOT, "bench"))
from report import write_report  # noqa: E402

C, KC, PROJ_COLS = 8192, 4, 12352  # conv channels (q | k | v), kernel, the fused projection's columns
PARTS = (2048, 2048, 4096)


def parse_args():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", default="2184,8192")
    ap.add_argument(
        "--configs",
        default="32x128x4,64x128x4,16x128x4,32x256x4,64x256x8,128x128x8,32x64x2,64x64x4",
        help="BLOCK_TxBLOCK_Cxwarps",
    )
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--out", default=os.path.join(ROOT, "bench", "out", "gdn_conv.json"))
    return ap.parse_args()


def main() -> int:
    args = parse_args()
    if not torch.cuda.is_available():
        print("needs CUDA")
        return 1
    from hardware_bandwidth import graph_device_ms, measure_bandwidth

    from freetoken.kernels.gdn_conv_prefill import gdn_conv_prefill_torch, gdn_conv_prefill_triton

    hbm = measure_bandwidth()["hbm_copy_gb_s"]
    print(f"HBM copy bandwidth: {hbm:.0f} GB/s (read + write of a device copy); {torch.cuda.get_device_name()}")
    rows = []
    gen = torch.Generator(device="cuda").manual_seed(0)
    for T in (int(t) for t in args.tokens.split(",")):
        proj = torch.randn(T, PROJ_COLS, device="cuda", dtype=torch.bfloat16, generator=gen)
        qkv = proj[:, :C]
        weight = torch.randn(C, KC, device="cuda", dtype=torch.bfloat16, generator=gen)
        pool = torch.randn(4, C, KC - 1, device="cuda", dtype=torch.float32, generator=gen)
        cu = torch.tensor([0, T], dtype=torch.int32, device="cuda")
        slots = torch.tensor([1], dtype=torch.int64, device="cuda")
        init = torch.tensor([True], device="cuda")
        ref = gdn_conv_prefill_torch(qkv, weight, pool, cu, slots, init, T)
        moved = 2 * T * C * 2  # bf16 read once + written once
        out = torch.empty(T * C, device="cuda", dtype=torch.bfloat16)
        for cfg in args.configs.split(","):
            bt, bc, warps = (int(x) for x in cfg.split("x"))

            def run(bt=bt, bc=bc, warps=warps):
                return gdn_conv_prefill_triton(
                    qkv, weight, pool, cu, slots, init, T, block_t=bt, block_c=bc, num_warps=warps, parts=PARTS, out=out
                )

            diff = (torch.cat([p for p in run()], dim=-1).float() - ref.float()).abs().max().item()
            ms = graph_device_ms(run, args.reps)
            rows.append(
                {
                    "tokens": T,
                    "config": cfg,
                    "us": ms * 1e3,
                    "gb_s": moved / (ms * 1e-3) / 1e9,
                    "of_hbm_copy": moved / (ms * 1e-3) / 1e9 / hbm,
                    "max_diff_vs_torch": diff,
                }
            )
            r = rows[-1]
            print(
                f"{T:>6} {cfg:>12} {r['us']:>8.1f} us {r['gb_s']:>7.0f} GB/s {r['of_hbm_copy']:>6.1%} of copy"
                f"  max|diff| {diff:.3g}"
            )
    write_report(args.out, {"hbm_copy_gb_s": hbm, "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
