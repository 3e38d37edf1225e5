"""What programmatic dependent launch (PDL) saves between the small kernels of a decode step, inside a CUDA graph.

A batch-1 decode step of Qwen3.6-35B-A3B NVFP4 runs ~450 kernels from one CUDA graph; profiled, the step took
4.25 ms against 3.07 ms of kernel time (2026-12-02, ``...-nvfp4-profile-decode-mixed.txt``): ~2 us between
consecutive kernels. With PDL a kernel is launched while the one before it drains (``griddepcontrol``: the next
kernel's programs start and wait at ``gdc_wait`` until the previous kernel has finished and its writes are
visible), so that launch latency overlaps. This times a chain shaped like a decode step, a GEMV over a layer's own
weight (``--n`` x ``--k`` bf16, each layer a different weight, so HBM is read as in decode) then a small
elementwise kernel on its output, ``--layers`` times, captured in one graph and replayed, three ways: no PDL,
PDL with each kernel waiting first thing, and PDL with each kernel also letting its successor launch right away
(``gdc_launch_dependents`` after the wait).

    python3 bench/pdl_bench.py [--layers 200] [--n 2048] [--k 2048] [--out bench/out/pdl.json]     (CUDA, sm_90+)
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from hardware_bandwidth import median_device_ms  # noqa: E402
from report import write_report  # noqa: E402
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait  # noqa: E402


@triton.jit
def _chain_gemv_kernel(x_ptr, w_ptr, y_ptr, N, K, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr):
    if PDL >= 1:
        gdc_wait()
    if PDL == 2:
        gdc_launch_dependents()
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    for k0 in tl.range(0, K, BLOCK_K, num_stages=3):
        cols = k0 + tl.arange(0, BLOCK_K)
        w = tl.load(w_ptr + rows[:, None] * K + cols[None, :])
        acc += w.to(tl.float32) * tl.load(x_ptr + cols)[None, :].to(tl.float32)
    tl.store(y_ptr + rows, tl.sum(acc, 1).to(y_ptr.dtype.element_ty))


@triton.jit
def _chain_scale_kernel(y_ptr, x_ptr, N, BLOCK: tl.constexpr, PDL: tl.constexpr):
    if PDL >= 1:
        gdc_wait()
    if PDL == 2:
        gdc_launch_dependents()
    offs = tl.arange(0, BLOCK)
    y = tl.load(y_ptr + offs, mask=offs < N, other=0.0).to(tl.float32)
    r = tl.rsqrt(tl.sum(y * y, 0) / N + 1e-6)
    tl.store(x_ptr + offs, (y * r).to(x_ptr.dtype.element_ty), mask=offs < N)


def chain(weights, x, y, pdl: int) -> None:
    N, K = weights[0].shape
    for w in weights:
        kw = {"launch_pdl": True} if pdl else {}
        _chain_gemv_kernel[(N // 16,)](x, w, y, N, K, BLOCK_N=16, BLOCK_K=256, PDL=pdl, num_warps=4, **kw)
        _chain_scale_kernel[(1,)](y, x, N, BLOCK=triton.next_power_of_2(N), PDL=pdl, num_warps=4, **kw)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=200)
    ap.add_argument("--n", type=int, default=2048)
    ap.add_argument("--k", type=int, default=2048)
    ap.add_argument("--out", default="bench/out/pdl.json")
    a = ap.parse_args()
    if not torch.cuda.is_available():
        print("needs CUDA")
        return 1
    weights = [torch.randn(a.n, a.k, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(a.layers)]
    x = torch.randn(a.k, device="cuda", dtype=torch.bfloat16)
    y = torch.empty(a.n, device="cuda", dtype=torch.bfloat16)
    x0 = torch.randn_like(x)
    rows, results, ref = [], {}, None
    for pdl, name in ((0, "no PDL"), (1, "PDL, wait"), (2, "PDL, wait + early launch")):
        chain(weights, x, y, pdl)  # compile outside the capture
        torch.cuda.synchronize()
        graph, stream = torch.cuda.CUDAGraph(), torch.cuda.Stream()
        with torch.cuda.stream(stream):
            with torch.cuda.graph(graph, stream=stream):
                chain(weights, x, y, pdl)
        x.copy_(x0)
        graph.replay()
        torch.cuda.synchronize()
        ref = y.clone() if ref is None else ref
        same = bool(torch.equal(y, ref))
        ms = median_device_ms(graph.replay, 10)
        kernels = 2 * a.layers
        results[name] = {"ms": ms, "us_per_kernel": ms * 1e3 / kernels, "same_as_no_pdl": same}
        rows.append((name, ms, ms * 1e3 / kernels, same))
    w_bytes = a.layers * a.n * a.k * 2
    print(
        f"{a.layers} layers x (GEMV {a.n}x{a.k} bf16 + elementwise), {2 * a.layers} kernels in one CUDA graph; "
        f"weights {w_bytes / 1e9:.2f} GB"
    )
    print(f"{'launch':>28}{'ms':>9}{'us/kernel':>11}{'GB/s':>8}  same output")
    base = rows[0][1]
    for name, ms, per, same in rows:
        saved = (base - ms) * 1e3 / (2 * a.layers)
        print(f"{name:>28}{ms:9.3f}{per:11.2f}{w_bytes / ms / 1e6:8.0f}  {same}  ({saved:+.2f} us/kernel saved)")
    write_report(a.out, {"layers": a.layers, "n": a.n, "k": a.k, "results": results})
    return 0


if __name__ == "__main__":
    sys.exit(main())
