"""FP8 E4M3 per-tensor linear (ModelOpt ``FP8``, REFERENCES §3.5) as W8A8 through ``torch._scaled_mm`` with
tensor-wise scales, beside the torch reference it is tested against.

    x [..., K]   weight float8_e4m3fn [N, K]   weight_scale fp32 []   input_scale fp32 [] (static) or None (dynamic)
    y = (fp8(x / s_x) · weightᵀ) * s_x * weight_scale (+ bias)        s_x = input_scale, or amax(|x|) / 448

- ``fp8_linear_torch``: the reference (``Fp8Linear``'s): the weight dequantized to x's dtype, one matmul (W8A16).
- ``fp8_quantize``: x -> (fp8, its scale), one Triton pass (fp32 division, round to nearest even, saturated to
  ±448: ModelOpt's ``fp8(x / input_scale)`` and what cuBLAS' FP8 kernels expect). A dynamic scale is
  ``amax(|x|) / 448`` computed on the device.
- ``fp8_scaled_mm``: ``torch._scaled_mm`` with both scales tensor-wise (0-d), on the current stream.

Never row-wise: row-wise-scaled ``_scaled_mm`` runs a CUTLASS kernel that ignores the current CUDA stream on sm_89
with torch < 2.12 (pytorch#177651) and hung FreeToken on every prompt over ~200 tokens. A fused projection whose
parts carry different scales therefore runs one tensor-wise GEMM per part (``layers/fused_linear.py``,
``Fp8PartwiseLinear``), never one GEMM with a per-row scale vector.

``fp8_linear`` takes ``_scaled_mm`` on CUDA devices with FP8 tensor cores (sm_89+) when K and N are multiples of
16 (cuBLASLt's FP8 requirement), and the reference elsewhere (CPU, sm_80). No host reads, shapes from the inputs:
CUDA-graph capturable.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from ..quant import fp8

try:  # keep the reference importable without triton
    import triton
    import triton.language as tl

    from .pdl import pdl_launch, pdl_wait_then_release
except Exception:  # pragma: no cover
    triton = None
    tl = None

E4M3_MAX = fp8.E4M3_MAX


def fp8_linear_torch(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    input_scale: Optional[torch.Tensor] = None,
    bias: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Reference: ``F.linear`` with the weight dequantized to x's dtype (``input_scale`` unused: W8A16)."""
    return F.linear(x, fp8.dequantize(weight, weight_scale, x.dtype), bias)


def fp8_quantize_torch(x: torch.Tensor, input_scale: Optional[torch.Tensor] = None):
    """``(fp8(x / s), s)`` in torch ops: ``s`` = ``input_scale``, or ``amax(|x|) / 448`` (at least 1e-12)."""
    s = dynamic_scale(x) if input_scale is None else input_scale.float().reshape(())
    return (x.float() / s).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn), s


def dynamic_scale(x: torch.Tensor) -> torch.Tensor:
    """``amax(|x|) / 448`` as a 0-d fp32 device tensor (a zero input gets 1e-12, not a division by zero)."""
    return (x.abs().amax().float() / E4M3_MAX).clamp(min=1e-12)


if triton is not None:

    @triton.jit
    def _fp8_quantize_kernel(x_ptr, s_ptr, out_ptr, n, BLOCK: tl.constexpr, PDL: tl.constexpr = False):
        pdl_wait_then_release(PDL)  # kernels/pdl.py
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        q = tl.minimum(tl.maximum(x / tl.load(s_ptr), -448.0), 448.0)
        tl.store(out_ptr + offs, q.to(tl.float8e4nv), mask=mask)


def fp8_quantize(x2: torch.Tensor, input_scale: Optional[torch.Tensor] = None):
    """``fp8_quantize_torch`` for a contiguous ``x2 [M, K]`` on CUDA: one Triton pass."""
    s = dynamic_scale(x2) if input_scale is None else input_scale.float().reshape(())
    out = torch.empty(x2.shape, dtype=torch.float8_e4m3fn, device=x2.device)
    n = x2.numel()
    if n:
        _fp8_quantize_kernel[(triton.cdiv(n, 2048),)](x2, s, out, n, BLOCK=2048, num_warps=4, **pdl_launch(x2))
    return out, s


def fp8_scaled_mm(
    xq: torch.Tensor,
    x_scale: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    bias: Optional[torch.Tensor],
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """``xq [M, K]`` fp8 row-major times ``weight [N, K]`` (``weight.t()`` is the column-major operand cuBLASLt wants),
    both scales 0-d: tensor-wise, the only scaling used here."""
    assert x_scale.numel() == 1 and weight_scale.numel() == 1, "tensor-wise scales only (never row-wise)"
    fuse_bias = bias is not None and bias.dtype == out_dtype and out_dtype != torch.float32  # (cuBLASLt refuses)
    y = torch._scaled_mm(
        xq,
        weight.t(),
        scale_a=x_scale.reshape(()),
        scale_b=weight_scale.float().reshape(()),
        bias=bias if fuse_bias else None,
        out_dtype=out_dtype,
    )
    return y if bias is None or fuse_bias else y + bias


def scaled_mm_supported(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """``_scaled_mm`` can run this shape: CUDA with FP8 tensor cores (sm_89+), K and N multiples of 16."""
    if not x.is_cuda or triton is None or x.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        return False
    N, K = weight.shape
    return torch.cuda.get_device_capability(x.device) >= (8, 9) and K % 16 == 0 and N % 16 == 0


def fp8_linear_scaled_mm(x, weight, weight_scale, input_scale=None, bias=None) -> torch.Tensor:
    """W8A8: x quantized per tensor (static ``input_scale``, or dynamic when None), one tensor-wise ``_scaled_mm``."""
    K = x.shape[-1]
    x2 = x.reshape(-1, K)
    if x2.shape[0] == 0:
        return fp8_linear_torch(x, weight, weight_scale, input_scale, bias)
    if not x2.is_contiguous():
        x2 = x2.contiguous()
    xq, s = fp8_quantize(x2, input_scale)
    y = fp8_scaled_mm(xq, s, weight, weight_scale, bias, x.dtype)
    return y.view(*x.shape[:-1], weight.shape[0])


def fp8_linear(x, weight, weight_scale, input_scale=None, bias=None) -> torch.Tensor:
    """``_scaled_mm`` where supported (``scaled_mm_supported``), the reference elsewhere."""
    fn = fp8_linear_scaled_mm if scaled_mm_supported(x, weight) else fp8_linear_torch
    return fn(x, weight, weight_scale, input_scale, bias)
