"""cuBLAS's first call at each GEMM shape, paid at start-up instead of inside a served step.

Every cached turn of a conversation brings a token count the process has not seen, so each eager dense projection
of its prefill step (the GDN input and output projections, attention's q|k|v and o_proj; the MoE router | shared
expert in steps too long for the MoE prefill graphs) is a GEMM at a new M. Profiled inside the server on an H100
(``bench/results/2026-12-05-h100-qwen3.6-35b-a3b-served-steps-profile-20k.txt``), every cached turn's step had one
to three idle gaps of 3.3-4.8 ms on the device, each right before the first GEMM of a new shape. Measured since
(``bench/gemm_first_call.py``, ``bench/results/2026-12-05-h100-gemm-first-call.txt``): cuBLAS's first call at a new
shape waits for the device to drain, per shape (eager module loading does not help). So start-up calls each GEMM at
every multiple of 64 rows, and ``layers/gemm_rows.py`` (``FREETOKEN_GEMM_PAD_ROWS``, default 64) pads a step's
GEMM rows to those multiples: together, a served step only meets warmed shapes (the 20k agent session's turn 10
64.0-64.6 ms against 66.4-69.0 with this warm-up alone and 74.7 with neither, H100).

``GemmRecorder`` notes the GEMMs a stretch of real steps makes (the prefill warm-up's chunks): a dispatch mode that
sees each aten ``linear``, ``mm``, ``addmm`` and tensor-wise ``_scaled_mm`` with its weight, whichever the build
dispatches; calls of fewer than ``MIN_ROWS`` rows (decode-sized) are left out, and each shape, layout, dtype and
alignment is kept once (the 40 layers' projections of one shape once). ``warm_gemms`` then calls each at every
multiple of ``FREETOKEN_GEMM_WARMUP_ROWS`` (default 64; 0: off) up to the longest prefill chunk, on uninitialized
activations (outputs discarded). Nothing is kept but references to one weight of each shape.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from ..layers.gemm_rows import MIN_ROWS, rows_from_env

# operator -> index of the activation [M, K] among its arguments (the rest are the weight, bias, scales). A mode sees
# ``linear`` itself or the ``mm`` / ``addmm`` it becomes, depending on the build; never both for one call (the mode is
# off while the operator it intercepted runs)
_ACTIVATION_ARG = {"linear": 0, "mm": 0, "addmm": 1, "_scaled_mm": 0}


def warmup_rows_step(env_value: int | None = None) -> int:
    """``FREETOKEN_GEMM_WARMUP_ROWS``: the row step of the warm-up (0: none)."""
    return rows_from_env("FREETOKEN_GEMM_WARMUP_ROWS", 64, env_value)


def warmup_rows(max_rows: int, step: int) -> list[int]:
    """Every multiple of ``step`` from the first at or above ``MIN_ROWS`` up to ``max_rows`` (empty when off)."""
    if step <= 0:
        return []
    first = -(-MIN_ROWS // step) * step
    return list(range(first, max_rows + 1, step))


@dataclass
class GemmCall:
    """One recorded GEMM: its operator and arguments with the activation taken out (``act_index``)."""

    func: Callable
    args: tuple
    kwargs: dict
    act_index: int
    k: int
    act_dtype: torch.dtype
    device: torch.device

    def run(self, rows: int) -> None:
        x = torch.empty(rows, self.k, dtype=self.act_dtype, device=self.device)
        args = list(self.args)
        args[self.act_index] = x
        self.func(*args, **self.kwargs)


def _tensor_key(t) -> tuple:
    """What cuBLAS picks a kernel by: shape, layout, dtype and the pointer's alignment, not which layer's weight
    it is (40 layers' projections of one shape warm up once)."""
    if isinstance(t, torch.Tensor):
        ptr = t.data_ptr()
        return (tuple(t.shape), t.stride(), t.dtype, min(256, ptr & -ptr) if ptr else 256)
    return (t,)


class GemmRecorder(TorchDispatchMode):
    """``with GemmRecorder() as r: <steps>``; then ``r.calls``: the distinct prefill-sized GEMMs they made, by key."""

    def __init__(self):
        super().__init__()
        self.calls: dict[tuple, GemmCall] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func.overloadpacket.__name__
        i = _ACTIVATION_ARG.get(name)
        if i is not None and len(args) > i:
            self._note(func, name, args, kwargs, i)
        return func(*args, **kwargs)

    def _note(self, func, name: str, args: tuple, kwargs: dict, i: int) -> None:
        x = args[i]
        if not isinstance(x, torch.Tensor) or x.dim() != 2 or x.shape[0] < MIN_ROWS or not x.is_contiguous():
            return
        if name == "_scaled_mm":
            scales = [a for a in args[2:4] if isinstance(a, torch.Tensor)]
            if any(s.numel() > 1 for s in scales):  # row-wise scales are shaped by M: not replayable as recorded
                return
        rest = tuple(a for j, a in enumerate(args) if j != i)
        key = (name, x.shape[1], x.dtype, tuple(_tensor_key(a) for a in rest), tuple(sorted(kwargs.items(), key=str)))
        if key not in self.calls:
            self.calls[key] = GemmCall(func, tuple(None if j == i else a for j, a in enumerate(args)), dict(kwargs),
                                       i, int(x.shape[1]), x.dtype, x.device)  # fmt: skip


def warm_gemms(calls: Iterable[GemmCall], rows: list[int]) -> int:
    """Each call once at each row count, finished on the device when it returns; the number of calls made."""
    calls = list(calls)
    with torch.inference_mode():
        for m in rows:
            for c in calls:
                c.run(m)
    if calls and rows and torch.cuda.is_available():
        torch.cuda.synchronize()
    return len(calls) * len(rows)
