"""Host time of one kernel launch, by path: what the ~650 launches of a Qwen3.6 prefill step cost the host, and how
much a cached fast path around Triton's JIT could save (issue 12: the cached agent turns are host-bound on slow
hosts; 2026-12-04 served runs put the host's time to enqueue a turn's step at 46-107 ms).

Rows: a 16-argument Triton kernel launched through the JIT (``kernel[grid](...)``: device and stream lookup, the
binder's specialization, the cache key, the globals check, launch metadata, then the C launcher); the same compiled
kernel through its launcher directly (``CompiledKernel.run``: the floor a fast path could reach, valid only while
the specialization holds); our ``add_rms_norm`` wrapper (its output allocation and checks too); an ATen add; a
cuBLAS matmul; ``torch.empty``; a CUDA graph replay of one kernel. Each: host microseconds per call over a burst
short enough that the launch queue never fills (tiny tensors: the device runs each call faster than the host issues
it), median of the bursts. Prints a table, writes JSON.

    python3 bench/launch_overhead.py --out bench/out/launch_overhead.json

First run on the H200, 2026-12-04 (``bench/results/2026-12-04-h200-launch-overhead.txt``): 15.7 us through the JIT
against 5.75 through the launcher, 9.6 for an ATen add, 2.6 for a graph replay. The direct launcher call follows
Triton >= 3.3's ``JITFunction.run`` (every bound argument, constexprs included); a Triton that wants another form
shows as a failed row, not a wrong figure.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

try:
    import triton
    import triton.language as tl
except Exception:  # pragma: no cover
    triton = tl = None

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "python"))
from report import write_report  # noqa: E402

if triton is not None:

    @triton.jit
    def _sixteen_args(x, y, o, n, s1, s2, s3, s4, s5, s6, s7, s8, s9, s10, BLOCK: tl.constexpr, FLAG: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        v = tl.load(x + offs, mask=offs < n) + tl.load(y + offs, mask=offs < n)
        if FLAG:
            v += s1 + s2 + s3 + s4 + s5 + s6 + s7 + s8 + s9 + s10
        tl.store(o + offs, v, mask=offs < n)


def parse_args():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--burst", type=int, default=400, help="calls timed back to back (below the launch queue's depth)")
    ap.add_argument("--bursts", type=int, default=9)
    ap.add_argument("--out", default=os.path.join(ROOT, "bench", "out", "launch_overhead.json"))
    return ap.parse_args()


def host_us(fn, burst: int, bursts: int) -> float:
    """Median host microseconds per ``fn()`` over ``bursts`` bursts of ``burst`` calls, the device drained between."""
    fn()
    torch.cuda.synchronize()
    per_call = []
    for _ in range(bursts):
        t0 = time.perf_counter()
        for _ in range(burst):
            fn()
        per_call.append((time.perf_counter() - t0) / burst * 1e6)
        torch.cuda.synchronize()
    return statistics.median(per_call)


def main() -> int:
    a = parse_args()
    if not torch.cuda.is_available() or triton is None:
        print("needs CUDA and triton")
        return 1
    from freetoken.kernels.rms_norm import add_rms_norm

    dev = torch.device("cuda")
    x, y, o = (torch.randn(256, device=dev) for _ in range(3))
    args = (x, y, o, 256, *range(1, 11))
    consts = {"BLOCK": 256, "FLAG": True}
    grid = (1, 1, 1)
    rows = []

    def row(name, fn):
        try:
            us = host_us(fn, a.burst, a.bursts)
            rows.append({"path": name, "host_us_per_call": us})
        except Exception as exc:  # a path this triton/torch cannot take
            rows.append({"path": name, "error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:100]}"})

    row("triton JIT launch, 16 args", lambda: _sixteen_args[grid](*args, **consts))
    compiled = _sixteen_args[grid](*args, **consts)
    stream = torch.cuda.current_stream().cuda_stream
    bound = (*args, consts["BLOCK"], consts["FLAG"])  # the launcher takes every argument, constexprs included
    row(
        "compiled kernel, launcher directly",
        lambda: compiled.run(*grid, stream, compiled.function, compiled.packed_metadata, None, None, None, *bound),
    )
    h = torch.randn(64, 2048, device=dev, dtype=torch.bfloat16)
    r = torch.randn_like(h)
    w = torch.randn(2048, device=dev, dtype=torch.bfloat16)
    row("add_rms_norm wrapper (64 x 2048)", lambda: add_rms_norm(h, r, w, 1e-6, True))
    row("torch add (ATen)", lambda: torch.add(x, y))
    m = torch.randn(64, 64, device=dev, dtype=torch.bfloat16)
    row("torch mm 64x64 (cuBLAS)", lambda: torch.mm(m, m))
    row("torch.empty 1 MiB", lambda: torch.empty(1 << 19, device=dev, dtype=torch.bfloat16))
    graph = torch.cuda.CUDAGraph()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        torch.add(x, y, out=o)
    torch.cuda.current_stream().wait_stream(side)
    with torch.cuda.graph(graph):
        torch.add(x, y, out=o)
    row("CUDA graph replay (1 kernel)", graph.replay)

    print(
        f"host time per launch, {torch.cuda.get_device_name()}, triton {triton.__version__}, torch {torch.__version__}"
    )
    for r_ in rows:
        figure = f"{r_['host_us_per_call']:8.2f} us" if "host_us_per_call" in r_ else f"failed: {r_['error']}"
        print(f"  {r_['path']:<40} {figure}")
    write_report(a.out, {"triton": triton.__version__, "torch": torch.__version__, "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
