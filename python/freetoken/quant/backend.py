"""``--nvfp4-backend``: what runs the NVFP4 layers. ``auto`` resolves to ``triton`` on CUDA (our W4A16 kernels:
``kernels/nvfp4_linear.py``, ``kernels/nvfp4_moe.py``) and ``torch`` elsewhere (dequantize on the fly, then the BF16
matmul: the reference); ``triton`` and ``torch`` pin one (``triton`` needs CUDA, or TRITON_INTERPRET=1 in tests);
``none`` when the model has no NVFP4 weights. With ``auto`` the layers decide by the device of their input (``impl``
auto), so this names what they will do; a pinned backend is set on every NVFP4 layer (``apply_nvfp4_backend``). The
Rust CLI refuses marlin / flashinfer before anything loads."""

from __future__ import annotations

import os
from typing import Optional

import torch
from torch import nn

from .config import NVFP4_SCHEMES, QuantConfig

BACKENDS = ("auto", "triton", "torch")


def resolve_nvfp4_backend(flag: Optional[str], qcfg: Optional[QuantConfig], device=None) -> str:
    if qcfg is None or not (qcfg.schemes & set(NVFP4_SCHEMES)):
        return "none"
    flag = flag or "auto"
    if flag not in BACKENDS:
        raise ValueError(f"--nvfp4-backend {flag} is not built (auto: triton on CUDA, the torch reference elsewhere)")
    on_cuda = device is not None and torch.device(device).type == "cuda"
    if flag == "triton" and not (on_cuda or os.environ.get("TRITON_INTERPRET") == "1"):
        raise ValueError("--nvfp4-backend triton needs CUDA (use auto or torch on the CPU)")
    if flag == "auto":
        return "triton" if on_cuda else "torch"
    return flag


def apply_nvfp4_backend(model: nn.Module, flag: Optional[str]) -> None:
    """Pins ``impl`` of every NVFP4 Linear and expert bank when the flag names a backend (auto leaves them be)."""
    if flag in (None, "auto"):
        return
    from ..layers.nvfp4_experts import Nvfp4Experts
    from ..layers.quantized_linear import Nvfp4Linear

    for m in model.modules():
        if isinstance(m, (Nvfp4Linear, Nvfp4Experts)):
            m.impl = flag
