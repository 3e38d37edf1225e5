"""Programmatic dependent launch (PDL, sm_90+) for our kernels of the decode and prefill steps.

A decode step is a chain of a few hundred short kernels, each reading what the one before it wrote. Between two of
them the GPU drains the first (its last programs finish one by one) and only then launches the second: its programs
are placed, set up and start their loads with the SMs partly idle, ~1-2 us a boundary that a step of ~500 kernels
pays ~500 times (a cached agent turn's prefill step on the H200: 5.0 ms idle in 1,262 gaps of a 74.9 ms span). A kernel launched with PDL (``launch_pdl``, Hopper's programmatic stream serialization, kept as a
programmatic edge when a CUDA graph captures it) may launch as soon as every program of the kernel before it has
called ``griddepcontrol.launch_dependents``; its programs then wait in ``griddepcontrol.wait`` until that kernel has
finished and its writes are visible. So each kernel here waits first, before it touches memory (what it reads may be
the previous kernel's output, what it writes that kernel's input), then lets the next kernel launch: correct for any
neighbour, PDL-aware or not (a kernel that never calls ``launch_dependents`` releases its dependent when it ends, as
without PDL), and at most one kernel's programs wait ahead of the running one.

``FREETOKEN_PDL=1`` turns it on (CUDA, sm_90+); off by default until the H200 has measured it. Under the CPU
interpreter, and where it is off, kernels take ``PDL=False`` and compile as before.
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


def pdl_requested() -> bool:
    """``FREETOKEN_PDL`` (0, the default, or 1); any other value is refused."""
    return choice_from_env("FREETOKEN_PDL", "0", ("0", "1")) == "1"


@functools.lru_cache(maxsize=None)
def _device_takes_pdl(index: int) -> bool:
    return torch.cuda.get_device_capability(index) >= (9, 0)


_OFF: dict = {}
_ON = {"PDL": True, "launch_pdl": True}


def pdl_launch(t: torch.Tensor) -> dict:
    """Launch keywords for one of our kernels over tensors on ``t``'s device: ``PDL`` (the kernel's constexpr) and
    Triton's ``launch_pdl`` where PDL is on and the device takes it, else nothing (the kernels default to off).
    Called at every launch of an eager step (~500 a prefill step), so the usual answer costs one environment lookup
    (read at each call: an in-process A/B may switch it); the dicts returned are shared, never to be changed."""
    if not t.is_cuda:
        return _OFF
    raw = os.environ.get("FREETOKEN_PDL")
    if raw is None or raw == "0" or not pdl_requested():  # (pdl_requested refuses any value but 0 and 1)
        return _OFF
    index = t.device.index if t.device.index is not None else torch.cuda.current_device()
    return _ON if _device_takes_pdl(index) else _OFF
