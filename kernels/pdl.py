"""Programmatic dependent launch (PDL, sm_90+) for our kernels of the decode and prefill steps.

A decode step is a chain of a few hundred short kernels, each reading what the one before it wrote. Between two of
them the GPU drains the first (its last programs finish one by one) and only then launches the second: its programs
are placed, set up and start their loads with the SMs partly idle, ~1-2 us a boundary that a step of ~500 kernels
pays ~500 times (a cached agent turn's prefill step on the H200: 5.0 ms idle in 1,262 gaps of a 74.9 ms span).

A kernel launched with PDL (``launch_pdl``, Hopper's programmatic stream serialization, kept as a programmatic edge
when a CUDA graph captures it) may launch as soon as every program of the kernel before it has called
``griddepcontrol.launch_dependents``; its programs then wait in ``griddepcontrol.wait`` until that kernel has
finished and its writes are visible. So each kernel here waits first, before it touches memory (what it reads may be
the previous kernel's output, what it writes that kernel's input), then lets the next kernel launch: correct for any
neighbour, PDL-aware or not (a kernel that never calls ``launch_dependents`` releases its dependent when it ends, as
without PDL), and at most one kernel's programs wait ahead of the running one.

On by default as ``prefetch`` (CUDA, sm_90+): two alternating rounds on an H100 (2026-12-06) gave the NVFP4 model's
1-stream decode 396.3 / 397.3 tok/s off and 439.3 / 437.8 with ``prefetch`` (+10.5 %), 32 streams +3.4 %, and its GPU
tests pass; ``FREETOKEN_PDL=0`` turns it off, ``1`` keeps PDL without the prefetch. ``prefetch`` also has
the decode GEMVs (the NVFP4 linear's GEMV and fp16-tile paths, the mixed projections) prefetch the first lines of
their weight rows into L2 before they wait (``pdl_prefetch_rows``), so a GEMV's weight stream is under way when the
kernel before it ends. Under the CPU interpreter, and where it is off, kernels take ``PDL=False`` and compile as
before.
"""

from __future__ import annotations

import functools
import os

import torch

from freetoken.tuning_env import choice_from_env

try:
    import triton
    import triton.language as tl
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except Exception:  # pragma: no cover
    triton = None
    tl = None

if triton is not None:

    @triton.jit
    def pdl_wait_then_release(PDL: tl.constexpr):
        """A kernel's first statement: wait for the kernel before it (its writes visible), then let the next one
        launch (its programs wait the same way). Nothing under ``PDL=False``."""
        if PDL:
            gdc_wait()
            gdc_launch_dependents()

    @triton.jit
    def pdl_prefetch_rows(ptr, rows, stride, num_rows, start, row_len, LINES: tl.constexpr, PDL: tl.constexpr):
        """``PDL == 2`` (``FREETOKEN_PDL=prefetch``), before the wait: an L2 prefetch of the first ``LINES`` 128-byte
        lines of each of ``rows`` from element ``start`` (``ptr``'s elements, rows ``stride`` apart, ``row_len``
        long, ``num_rows`` of them; past either end the last is taken again). For weights, which no kernel of the
        step writes: their stream starts while the kernel before finishes. L2 is where the GPU keeps memory
        coherent, so a line fetched early is still current when the program reads it."""
        if PDL == 2:
            per_line: tl.constexpr = 1024 // ptr.dtype.element_ty.primitive_bitwidth
            cols = tl.minimum(start + tl.arange(0, LINES) * per_line, row_len - 1)
            r = tl.minimum(rows, num_rows - 1).to(tl.int64)
            tl.inline_asm_elementwise(
                "prefetch.global.L2 [$1]; mov.u32 $0, 0;", "=r,l", [ptr + r[:, None] * stride + cols[None, :]],
                dtype=tl.int32, is_pure=False, pack=1,
            )  # fmt: skip


def pdl_mode() -> str:
    """``FREETOKEN_PDL``: ``prefetch`` (the default: PDL, and the decode GEMVs prefetch their first weight lines into
    L2 before their wait), ``1`` (PDL alone), ``0`` (off); any other value is refused."""
    return choice_from_env("FREETOKEN_PDL", "prefetch", ("0", "1", "prefetch"))


def pdl_requested() -> bool:
    """Whether ``FREETOKEN_PDL`` turns PDL on (``1`` or ``prefetch``)."""
    return pdl_mode() != "0"


@functools.lru_cache(maxsize=None)
def _device_takes_pdl(index: int) -> bool:
    return torch.cuda.get_device_capability(index) >= (9, 0)


_OFF: dict = {}
_ON = {"PDL": 1, "launch_pdl": True}
_PREFETCH = {"PDL": 2, "launch_pdl": True}


def pdl_launch(t: torch.Tensor) -> dict:
    """Launch keywords for one of our kernels over tensors on ``t``'s device: ``PDL`` (the kernel's constexpr) and
    Triton's ``launch_pdl`` where PDL is on and the device takes it, else nothing (the kernels default to off).
    Called at every launch of an eager step (~500 a prefill step), so the usual answer costs one environment lookup
    (read at each call: an in-process A/B may switch it); the dicts returned are shared, never to be changed."""
    if not t.is_cuda:
        return _OFF
    raw = os.environ.get("FREETOKEN_PDL") or "prefetch"  # unset or empty: the default, as pdl_mode reads it
    if raw not in ("1", "prefetch"):
        pdl_mode()  # refuses any value but 0 here too
        return _OFF
    index = t.device.index if t.device.index is not None else torch.cuda.current_device()
    if not _device_takes_pdl(index):
        return _OFF
    return _PREFETCH if raw == "prefetch" else _ON
