"""Eager prefill GEMMs on a row count rounded up to a multiple of ``FREETOKEN_GEMM_PAD_ROWS`` (default 64; 0: off).

cuBLAS's first call at a new GEMM shape waits for the device to drain: on an H100 (``bench/gemm_first_call.py``,
``bench/results/2026-12-05-h100-gemm-first-call.txt``) the first call at an unseen row count blocked until the work
queued ahead of it had finished, per shape, with eager module loading too (so not a kernel module loaded on first
use). Inside a served step that empties the device's queue: the 3.3-4.8 ms device gaps before new-shape GEMMs that
each cached turn showed (every turn brings a new token count). The start-up warm-up (``engine/gemm_warmup.py``)
calls every projection at each multiple of 64 rows, and here the dense projections of a prefill-sized step (the
fused q|k|v, GDN and router | shared projections, o_proj, the GDN out_proj, the dense and shared down projections)
run on the activation copied into ``ceil(T / 64) * 64`` rows, the output's first T rows kept (a contiguous view), so
a step only ever asks for warmed shapes: first calls 0.14-0.21 ms there, and the 20k agent session's turn 10 64.0-64.6
ms against 66.4-69.0 with the warm-up alone (74.7 with neither). The padding rows hold whatever the buffer held; a
GEMM's rows are independent, so they touch only the discarded rows. The cost: one copy of the activation per GEMM
and up to 63 rows of compute. CPU steps pad too (the same path everywhere; negligible there).
"""

from __future__ import annotations

from typing import Callable

import torch

from ..tuning_env import int_from_env

# prefill-sized GEMMs start here: decode-sized steps (GEMVs, the decode graphs) are never padded, nor warmed up
# (engine/gemm_warmup.py)
MIN_ROWS = 64


def rows_from_env(name: str, default: int, env_value: int | None = None) -> int:
    """``$name`` (or ``env_value``) as a number of rows, 0 meaning off; a negative one is refused in one line."""
    rows = int_from_env(name, default, "rows") if env_value is None else env_value
    if rows < 0:
        raise ValueError(f"{name}={rows}: expected 0 (off) or a positive number of rows")
    return rows


def pad_rows_setting(env_value: int | None = None) -> int:
    """``FREETOKEN_GEMM_PAD_ROWS``: the row multiple (default 64, the warm-up's step; 0: off)."""
    return rows_from_env("FREETOKEN_GEMM_PAD_ROWS", 64, env_value)


PAD_ROWS = pad_rows_setting()


def padded_rows_linear(x: torch.Tensor, linear: Callable[[torch.Tensor], torch.Tensor], pad: int | None = None):
    """``linear(x)`` for ``x [T, K]``, computed on ``x`` copied into a multiple of ``pad`` rows (``PAD_ROWS`` when
    not given) where that applies: a 2-D prefill-sized x whose rows are not already a multiple, outside a CUDA
    graph capture."""
    pad = PAD_ROWS if pad is None else pad
    T = x.shape[0]
    if pad <= 0 or x.dim() != 2 or T < MIN_ROWS or T % pad == 0:
        return linear(x)
    if x.is_cuda and torch.cuda.is_current_stream_capturing():
        return linear(x)
    padded = x.new_empty(-(-T // pad) * pad, x.shape[1])
    padded[:T].copy_(x)
    return linear(padded)[:T]
