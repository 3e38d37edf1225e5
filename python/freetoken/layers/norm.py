"""RMS norms. Two kinds matter: Llama's plain ``x·w`` and Qwen3-Next/3.5's ``x·(1+w)`` (weights initialised
to zero), both computed in fp32 and cast back at the end. One fused kernel per call on CUDA
(``kernels/rms_norm.py``), the torch reference elsewhere; ``add`` also folds in the residual add before the norm."""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from ..kernels.rms_norm import add_rms_norm, rms_norm


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6, one_plus: bool = False):
        super().__init__()
        self.eps = eps
        self.one_plus = one_plus  # Qwen3-Next / Qwen3.5: scale by (1 + w), w initialised to 0
        self.weight = nn.Parameter(torch.zeros(dim) if one_plus else torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Llama casts before the weight multiply (HF LlamaRMSNorm); (1+w) multiplies in fp32 before the cast
        return rms_norm(x, self.weight, self.eps, self.one_plus)

    def add(
        self, x: torch.Tensor, residual: torch.Tensor, out: Optional[torch.Tensor] = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(norm(x + residual), x + residual)``: the decoder's residual add and the next norm in one pass;
        ``out``: where the norm goes (the MoE block's graph input rows, ``SparseMoeBlock.input_rows``)."""
        return add_rms_norm(x, residual, self.weight, self.eps, self.one_plus, out=out)


def pre_norm(norm: RMSNorm, h: torch.Tensor, residual) -> tuple[torch.Tensor, torch.Tensor]:
    """A decoder layer's input norm: ``(norm(h), h)`` at the first layer, else the fused add and norm."""
    if residual is None:
        return norm(h), h
    return norm.add(h, residual)


def final_norm(norm: RMSNorm, h: torch.Tensor, residual, rows: torch.Tensor) -> torch.Tensor:
    """The last residual add and the final norm, at ``rows`` only (both are per token)."""
    h = h[rows]
    return norm(h) if residual is None else norm.add(h, residual[rows])[0]
