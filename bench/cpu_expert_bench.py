"""Could the host compute missed experts faster than PCIe brings them over? Times one decode token through BF16
experts of Qwen3.6-35B-A3B's shape (gate|up 1024 x 2048, down 2048 x 512, 6 MiB each) on the CPU with torch, for
1-8 experts of a layer, and prints the weight bytes read per second beside the pinned host-to-device copy bandwidth
(what the GPU's expert cache fetches at) and the host's plain read bandwidth (a sum over 1 GiB). A ``hybrid``
expert backend (misses computed where they live) only pays where the first beats the second.

    python3 bench/cpu_expert_bench.py [--threads N] [--out bench/out/cpu_expert.json]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from hardware_bandwidth import measure_bandwidth  # noqa: E402
from report import write_report  # noqa: E402

H, I, EXPERTS = 2048, 512, 64


def median_s(fn, reps: int = 20) -> float:
    fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--experts", default="1,2,4,8")
    ap.add_argument("--out", default="bench/out/cpu_expert.json")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    hw = measure_bandwidth() if torch.cuda.is_available() else {}
    big = torch.ones(2**30 // 4, dtype=torch.float32)
    read_gbs = big.numel() * 4 / median_s(big.sum, 5) / 1e9
    big = None
    # distinct experts, so that each one is read from memory, not from the caches
    w13 = torch.randn(EXPERTS, 2 * I, H, dtype=torch.bfloat16) * 0.02
    w2 = torch.randn(EXPERTS, H, I, dtype=torch.bfloat16) * 0.02
    x = torch.randn(1, H, dtype=torch.bfloat16)
    per_expert = (w13[0].numel() + w2[0].numel()) * 2
    pcie = hw.get("pcie_h2d_gb_s")
    print(f"{a.threads} threads; host read {read_gbs:.1f} GB/s; pinned H2D {pcie or float('nan'):.1f} GB/s")
    print(f"{'experts':>8}{'ms':>10}{'GB/s':>8}{'vs H2D':>8}")
    rows, turn = [], [0]
    for n in (int(v) for v in a.experts.split(",")):

        def token(n=n):
            base = turn[0] % (EXPERTS // n) * n
            turn[0] += 1
            out = torch.zeros(1, H, dtype=torch.bfloat16)
            for e in range(base, base + n):
                gu = F.linear(x, w13[e])
                out += F.linear(F.silu(gu[:, :I]) * gu[:, I:], w2[e])
            return out

        s = median_s(token)
        gbs = n * per_expert / s / 1e9
        rows.append({"experts": n, "ms": s * 1e3, "gb_s": gbs})
        print(f"{n:>8}{s * 1e3:>10.3f}{gbs:>8.1f}{(gbs / pcie if pcie else float('nan')):>8.2f}")
    write_report(a.out, {"threads": a.threads, "host_read_gb_s": read_gbs, "hardware": hw, "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
