"""RMS norms. Two kinds matter: Llama's plain ``x·w`` and Qwen3-Next/3.5's ``x·(1+w)`` (weights initialised
to zero), both computed in fp32 and cast back at the end."""

from __future__ import annotations

import torch
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6, one_plus: bool = False):
        super().__init__()
        self.eps = eps
        self.one_plus = one_plus  # Qwen3-Next / Qwen3.5: scale by (1 + w), w initialised to 0
        self.weight = nn.Parameter(torch.zeros(dim) if one_plus else torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.one_plus:
            return (xf * (1.0 + self.weight.float())).to(x.dtype)
        # Llama casts before the weight multiply (HF LlamaRMSNorm)
        return self.weight * xf.to(x.dtype)
