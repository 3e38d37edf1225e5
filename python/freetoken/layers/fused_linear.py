"""Projections that read the same input, run as one GEMM (q|k|v, gate|up, the GDN input projections, router|shared
expert): one launch and one pass over the activations instead of several, which matters most in decode, where
each projection is a small GEMV.

``fuse_linears`` is applied after the weights are loaded: the parts' weights are concatenated along the output
dimension into one tensor, and each part's ``weight`` (and ``bias``) becomes a view into it, so parameter names,
``state_dict()`` and the bytes counted stay exactly as loaded. The layer then calls the ``FusedLinear`` and splits
the output.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn


class FusedLinear(nn.Module):
    """One weight ``[sum(sizes), in]`` whose row blocks are the parts' weights. The parts own the parameters; the
    fused tensors are non-persistent buffers (out of ``state_dict()`` and the parameter count, moved by ``.to()``;
    after a move the two are separate copies of the same values)."""

    def __init__(self, weight: torch.Tensor, bias: Optional[torch.Tensor], sizes: list[int]):
        super().__init__()
        self.register_buffer("weight", weight, persistent=False)
        self.register_buffer("bias", bias, persistent=False)
        self.sizes = sizes

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)

    def split(self, y: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return torch.split(y, self.sizes, dim=-1)


class PartwiseLinear(nn.Module):
    """The fused projection of parts that cannot share one weight tensor (quantized parts keep their own scales):
    each part runs on its own and the outputs are concatenated; ``split`` is ``FusedLinear``'s. The parts stay owned
    by their modules (held in a list, so they are not registered twice)."""

    def __init__(self, parts: list[nn.Module]):
        super().__init__()
        self.parts = list(parts)
        self.sizes = [p.out_features for p in parts]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([p(x) for p in self.parts], dim=-1)

    def split(self, y: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return torch.split(y, self.sizes, dim=-1)


@torch.no_grad()
def fuse_linears(*parts: nn.Module) -> FusedLinear | PartwiseLinear:
    """Concatenate ``parts`` (same input size, same dtype and device; all with or all without bias) and point each
    part's parameters at its block of the result. The old per-part storage is freed as it is replaced. Parts that are
    not plain ``nn.Linear`` (quantized layers) give a ``PartwiseLinear`` instead."""
    if len({p.in_features for p in parts}) != 1:
        raise ValueError("fused projections must share their input size")
    if not all(isinstance(p, nn.Linear) for p in parts):
        return PartwiseLinear(list(parts))
    with_bias = [p.bias is not None for p in parts]
    if any(with_bias) and not all(with_bias):
        raise ValueError("fused projections must all have a bias or none")
    sizes = [p.out_features for p in parts]
    weight = torch.cat([p.weight for p in parts], dim=0)
    bias = torch.cat([p.bias for p in parts], dim=0) if all(with_bias) else None
    start = 0
    for p, n in zip(parts, sizes):
        p.weight = nn.Parameter(weight[start : start + n], requires_grad=False)
        if bias is not None:
            p.bias = nn.Parameter(bias[start : start + n], requires_grad=False)
        start += n
    return FusedLinear(weight, bias, sizes)


def fuse_projections(model: nn.Module) -> None:
    """Every module of ``model`` with a ``fuse_projections()`` method fuses its own projections."""
    for m in list(model.modules()):  # (fusing adds FusedLinear children)
        if m is not model and hasattr(m, "fuse_projections"):
            m.fuse_projections()
