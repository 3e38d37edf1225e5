"""How fast the expert cache's fetch reads missed experts from pinned host memory: ``gather_experts_triton`` (the
kernel inside the decode CUDA graph, reading the bank through its device address) against ``cudaMemcpy`` of the
same experts (one ``copy_`` per expert, what a host-driven fetch would do) and against the measured pinned
host-to-device bandwidth (``hardware_bandwidth``), for 1-8 misses of one layer (a batch-1 decode step misses
~4 experts a layer under Zipf routing) and at the launch settings the kernel can take (``--chunks``, ``--blocks``:
elements one load instruction covers, ``--warps``).

Each method is timed as the decode step runs it: captured ``--calls`` times in a CUDA graph and replayed, so the
host's launch time is not counted (timed eagerly with events, one Triton launch's ~30 us of host time lands inside
the measured span, which made a one-expert gather look half as fast as it is; the 2026-12-02 evening run did that).

    python3 bench/expert_gather_bench.py [--format nvfp4|bf16] [--out bench/out/expert_gather.json]

Qwen3.6-35B-A3B's experts: NVFP4 rows of 1.70 MiB (``Nvfp4Rows(2048, 512)``), BF16 6 MiB. Needs CUDA."""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python"))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
from hardware_bandwidth import measure_bandwidth, median_device_ms  # noqa: E402
from report import write_report  # noqa: E402

from freetoken.kernels.expert_gather import gather_experts_triton  # noqa: E402
from freetoken.moe.nvfp4_rows import Nvfp4Rows  # noqa: E402

EXPERTS, SLOTS, H, I = 256, 64, 2048, 512


def banks(fmt: str):
    """(host gate_up, host down, pool gate_up, pool down): pinned host banks of EXPERTS experts, a SLOTS-slot pool."""
    if fmt == "nvfp4":
        rows = Nvfp4Rows(H, I)
        host = rows.allocate(EXPERTS, "cpu")
        pool = rows.allocate(SLOTS, "cuda")
    else:
        host = (torch.empty(EXPERTS, 2 * I, H, dtype=torch.bfloat16), torch.empty(EXPERTS, H, I, dtype=torch.bfloat16))
        pool = tuple(torch.empty(SLOTS, *t.shape[1:], dtype=t.dtype, device="cuda") for t in host)
    host = tuple(t.pin_memory() for t in host)
    return (*host, *pool)


def graph_us(fn, calls: int) -> float:
    """Microseconds per call of ``fn`` replayed from a CUDA graph holding ``calls`` of them (median of 10
    replays)."""
    fn()  # compile / warm up outside the capture
    torch.cuda.synchronize()
    graph, stream = torch.cuda.CUDAGraph(), torch.cuda.Stream()
    with torch.cuda.stream(stream):
        with torch.cuda.graph(graph, stream=stream):
            for _ in range(calls):
                fn()
    torch.cuda.synchronize()
    return median_device_ms(graph.replay, 10) * 1e3 / calls


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--format", choices=("nvfp4", "bf16"), default="nvfp4")
    ap.add_argument("--misses", default="1,2,4,5,8")
    ap.add_argument("--chunks", default="16384")
    ap.add_argument("--blocks", default="2048,8192")
    ap.add_argument("--warps", default="4,8")
    ap.add_argument("--calls", type=int, default=10, help="calls captured in one graph")
    ap.add_argument("--out", default="bench/out/expert_gather.json")
    a = ap.parse_args()
    if not torch.cuda.is_available():
        print("needs CUDA")
        return 1
    hw = measure_bandwidth()
    gu_host, d_host, gu_pool, d_pool = banks(a.format)
    per_expert = gu_host[0].numel() * gu_host.element_size() + d_host[0].numel() * d_host.element_size()
    print(f"{a.format} expert {per_expert / 2**20:.2f} MiB; pinned H2D copy {hw['pcie_h2d_gb_s']:.1f} GB/s")
    print(f"{'misses':>6}{'method':>26}{'us':>10}{'GB/s':>8}{'of H2D':>8}")
    rows = []
    gen = torch.Generator().manual_seed(0)
    for n in (int(x) for x in a.misses.split(",")):
        src = torch.randperm(EXPERTS, generator=gen)[:8].cuda()
        dst = torch.randperm(SLOTS, generator=gen)[:8].cuda()
        jobs = torch.tensor(n, device="cuda")
        methods = {}
        for chunk in (int(x) for x in a.chunks.split(",")):
            for block in (int(x) for x in a.blocks.split(",")):
                for warps in (int(x) for x in a.warps.split(",")):
                    methods[f"gather c{chunk} b{block} w{warps}"] = lambda chunk=chunk, block=block, warps=warps: (
                        gather_experts_triton(
                            gu_host, d_host, gu_pool, d_pool, src, dst, jobs, chunk=chunk, block=block, num_warps=warps
                        )
                    )
        src_h, dst_h = src.tolist()[:n], dst.tolist()[:n]

        def memcpy():
            for e, s in zip(src_h, dst_h):
                gu_pool[s].copy_(gu_host[e], non_blocking=True)
                d_pool[s].copy_(d_host[e], non_blocking=True)

        methods["cudaMemcpy per expert"] = memcpy
        for name, fn in methods.items():
            us = graph_us(fn, a.calls)
            gbs = n * per_expert / us / 1e3
            rows.append({"misses": n, "method": name, "us": us, "gb_s": gbs})
            print(f"{n:>6}{name:>26}{us:>10.1f}{gbs:>8.1f}{gbs / hw['pcie_h2d_gb_s']:>8.2f}")
    write_report(a.out, {"hardware": hw, "format": a.format, "expert_bytes": per_expert, "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
