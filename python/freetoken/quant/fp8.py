"""FP8 E4M3 per-tensor weights (ModelOpt ``FP8``, REFERENCES §3.5)::

    weight       float8_e4m3fn [N, K]
    weight_scale float32 []          W = float(weight) * weight_scale
    input_scale  float32 []          static activation scale: x_q = fp8(x / input_scale) (W8A8 kernels)

Quantization is ModelOpt 0.47's export (``get_scaling_factor``: ``amax / 448``; ``to_quantized_weight``:
``(w / weight_scale).to(float8_e4m3fn)``, round-to-nearest-even, |values| within 448 by construction).
"""

from __future__ import annotations

import torch

E4M3_MAX = 448.0


def weight_scale(w: torch.Tensor) -> torch.Tensor:
    """``amax(|w|) / 448`` as an fp32 scalar."""
    return w.abs().amax().float() / E4M3_MAX


def quantize(w: torch.Tensor, scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(weight e4m3, weight_scale)``; ``scale`` defaults to ``weight_scale(w)``."""
    scale = weight_scale(w) if scale is None else scale.float().reshape(())
    return (w / scale).to(torch.float8_e4m3fn), scale


def dequantize(weight: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``float(weight) * weight_scale`` in fp32, then cast to ``dtype``."""
    return (weight.float() * scale.float()).to(dtype)


def activation_scale(amax: torch.Tensor) -> torch.Tensor:
    """ModelOpt's static ``input_scale`` from a calibrated activation amax: ``amax / 448``."""
    return amax.float() / E4M3_MAX
