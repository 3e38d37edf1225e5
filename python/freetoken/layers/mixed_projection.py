"""The decode-sized path of a fused projection whose parts are BF16, FP8 and NVFP4 Linears: one launch of
``kernels/mixed_gemv.py`` instead of a kernel per part and a concatenation.

``mixed_rows(parts)`` is called when the projection is fused, after the weights are loaded: the parts of each
format are concatenated into one tensor (each part's parameters become views into it, as ``fuse_linears`` does for
plain Linears, so names, ``state_dict()`` and bytes stay as loaded) and their scales spread to one per output row.
It returns ``None`` where the kernel does not apply: a bias, a part pinned to an implementation (tests), a format
whose parts are not contiguous in the output, an input size off the 16 grid.

``mixed_kernel(x, rows)`` (``kernels/mixed_dot.py``): CUDA activations with at most ``rows.max_m`` rows (4; 2 when
a part is FP8) take the GEMV (``use_mixed_gemv``, the lone quantized Linears' rule too), then up to 32 rows of 16-bit
x its tensor-core twin; larger batches (prefill) keep the per-part GEMMs.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from ..kernels.mixed_gemv import MixedRows, supports, use_mixed_gemv
from .quantized_linear import Fp8Linear, Nvfp4Linear

__all__ = ["mixed_rows", "use_mixed_gemv"]


def _format(p: nn.Module) -> Optional[str]:
    if isinstance(p, Fp8Linear):
        return "fp8"
    if isinstance(p, Nvfp4Linear):
        return "nvfp4"
    if isinstance(p, nn.Linear):
        return "dense"
    return None


def _param(t: torch.Tensor) -> nn.Parameter:
    return nn.Parameter(t, requires_grad=False)


@torch.no_grad()
def mixed_rows(parts: list[nn.Module]) -> Optional[MixedRows]:
    """One ``MixedRows`` over ``parts`` (their weights re-pointed into it), or ``None`` where it does not apply."""
    formats = [_format(p) for p in parts]
    if None in formats or any(p.bias is not None for p in parts):
        return None
    if any(getattr(p, "impl", "auto") != "auto" for p in parts):
        return None
    runs = [f for i, f in enumerate(formats) if i == 0 or formats[i - 1] != f]
    if len(runs) != len(set(runs)):  # a format split by another: not one block of columns
        return None
    rows = MixedRows(K=parts[0].in_features)
    if not supports(rows):
        return None
    col = 0
    for fmt in runs:
        group = [p for p, f in zip(parts, formats) if f == fmt]
        n = sum(p.out_features for p in group)
        if fmt == "dense":
            rows.dense, rows.dense_col = _concat(group, "weight"), col
        elif fmt == "fp8":
            rows.fp8_weight, rows.fp8_col = _concat(group, "weight"), col
            rows.fp8_scale = _per_row(group, "weight_scale")
        else:
            rows.nvfp4_weight, rows.nvfp4_col = _concat(group, "weight"), col
            rows.nvfp4_scale = _concat(group, "weight_scale")
            rows.nvfp4_global = _per_row(group, "weight_scale_2")
        col += n
    return rows


def _concat(group: list[nn.Module], name: str) -> torch.Tensor:
    """The parts' ``name`` tensors stacked along rows; each part's parameter becomes its block (a view)."""
    whole = torch.cat([getattr(p, name) for p in group], dim=0)
    start = 0
    for p in group:
        n = getattr(p, name).shape[0]
        setattr(p, name, _param(whole[start : start + n]))
        start += n
    return whole


def _per_row(group: list[nn.Module], name: str) -> torch.Tensor:
    """Each part's 0-d scale repeated over its output rows (fp32)."""
    return torch.cat([getattr(p, name).float().reshape(1).expand(p.out_features) for p in group]).contiguous()
