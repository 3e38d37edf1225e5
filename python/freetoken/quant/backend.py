"""``--nvfp4-backend``: what runs the NVFP4 layers. ``auto`` resolves to ``triton`` on CUDA (our W4A16 kernels:
``kernels/nvfp4_linear.py``, ``kernels/nvfp4_moe.py``) and ``torch`` elsewhere (dequantize on the fly, then the BF16
matmul: the reference); ``none`` when the model has no NVFP4 weights. The layers decide by the device of their
input (``impl`` auto), so this names what they will do. The Rust CLI refuses marlin / flashinfer before anything
loads."""

from __future__ import annotations

from typing import Optional

import torch

from .config import NVFP4_SCHEMES, QuantConfig


def resolve_nvfp4_backend(flag: Optional[str], qcfg: Optional[QuantConfig], device=None) -> str:
    if qcfg is None or not (qcfg.schemes & set(NVFP4_SCHEMES)):
        return "none"
    if flag not in (None, "auto"):
        raise ValueError(f"--nvfp4-backend {flag} is not built (auto: triton on CUDA, the torch reference elsewhere)")
    return "triton" if device is not None and torch.device(device).type == "cuda" else "torch"
