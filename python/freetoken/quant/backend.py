"""``--nvfp4-backend``: what runs the NVFP4 layers. ``auto`` resolves to ``torch`` (dequantize on the fly, then the
BF16 matmul: the reference) until the Triton kernels land, when it will pick ``triton`` on CUDA; ``none`` when the
model has no NVFP4 weights. The Rust CLI refuses marlin / flashinfer before anything loads."""

from __future__ import annotations

from typing import Optional

from .config import NVFP4_SCHEMES, QuantConfig


def resolve_nvfp4_backend(flag: Optional[str], qcfg: Optional[QuantConfig]) -> str:
    if qcfg is None or not (qcfg.schemes & set(NVFP4_SCHEMES)):
        return "none"
    if flag not in (None, "auto", "torch"):
        raise ValueError(f"--nvfp4-backend {flag} is not built (auto runs the torch reference)")
    return "torch"
