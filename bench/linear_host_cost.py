"""The host (launch-side) cost of one cuBLAS linear at the projections of Qwen3.6-35B-A3B's prefill, per BLAS
library torch can route it through. A cached agent turn's prefill step (issue 12: 2,184 new tokens) issues 161
``torch.nn.functional.linear`` calls, and the torch profiler put ~56 us of host time in each (``aten::mm``,
``bench/results/2026-12-03-h200-*-profile-prefill-*.txt``): ~9 ms of a host-bound step. This times, per shape and
per ``torch.backends.cuda.preferred_blas_library`` setting (the default, ``cublaslt``, ``cublas``):

- ``host us``: the Python-side time of one call, with the device held busy by a long sleep kernel queued first, so
  that no call waits for the device (what a host-bound step pays per linear);
- ``device us``: the call's elapsed device time (CUDA events over back-to-back calls),

and checks each library's output against the default's.

    python3 bench/linear_host_cost.py --tokens 2184 --out bench/out/linear_host_cost.json      # CUDA
"""

from __future__ import annotations

import argparse
import os
import time

import torch
from report import write_report

# (name, in features, out features) of a Qwen3.6-35B-A3B prefill step's cuBLAS linears
SHAPES = [
    ("GDN in_proj (qkv|z|b|a)", 2048, 12352),
    ("GDN out_proj", 4096, 2048),
    ("attention q|k|v", 2048, 9216),
    ("router|shared gate|up", 2048, 1281),
    ("shared down", 512, 2048),
]
LIBRARIES = ["default", "cublaslt", "cublas"]


def parse_args():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=2184, help="rows of x (the chunk's new tokens)")
    ap.add_argument("--calls", type=int, default=50)
    ap.add_argument("--out", default=os.path.join("bench", "out", "linear_host_cost.json"))
    return ap.parse_args()


def host_and_device_us(x: torch.Tensor, w: torch.Tensor, calls: int) -> tuple[float, float]:
    for _ in range(3):
        torch.nn.functional.linear(x, w)  # heuristics, workspace: outside the timing
    torch.cuda.synchronize()
    torch.cuda._sleep(int(2e9))  # ~1 s of device work ahead of the calls: none of them waits
    t0 = time.perf_counter()
    for _ in range(calls):
        torch.nn.functional.linear(x, w)
    host = (time.perf_counter() - t0) / calls * 1e6
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(calls):
        torch.nn.functional.linear(x, w)
    end.record()
    end.synchronize()
    return host, start.elapsed_time(end) / calls * 1e3


def main() -> int:
    a = parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("needs CUDA")
    default = torch.backends.cuda.preferred_blas_library()
    rows, reference = [], {}
    print(f"cuBLAS linears at {a.tokens} tokens (bf16), {a.calls} calls each; GPU {torch.cuda.get_device_name()}")
    print(f"{'shape':<26} {'library':<9} {'host us':>8} {'device us':>10} {'max |diff|':>10}")
    for lib in LIBRARIES:
        torch.backends.cuda.preferred_blas_library(default if lib == "default" else lib)
        for name, k, n in SHAPES:
            g = torch.Generator(device="cuda").manual_seed(k * 7 + n)
            x = torch.randn(a.tokens, k, device="cuda", dtype=torch.bfloat16, generator=g)
            w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16, generator=g) / k**0.5
            host, device = host_and_device_us(x, w, a.calls)
            y = torch.nn.functional.linear(x, w).float()
            diff = (y - reference.setdefault(name, y)).abs().max().item()
            rows.append(dict(shape=name, k=k, n=n, library=lib, host_us=host, device_us=device, max_diff=diff))
            print(f"{name:<26} {lib:<9} {host:8.1f} {device:10.1f} {diff:10.2e}")
    torch.backends.cuda.preferred_blas_library(default)
    write_report(a.out, {"tokens": a.tokens, "default_library": str(default), "rows": rows})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
