"""SiLU-and-mul of a fused gate/up projection as one Triton kernel, beside the torch reference it is tested against.

    silu_and_mul(x [T, 2I]) = silu(x[:, :I]) * x[:, I:]            -> [T, I] in x's dtype

The reference is ``GatedMLP.forward``'s ``F.silu(gate) * up``, with torch's rounding in low precision: the SiLU is
computed in fp32 and rounded to the dtype, then the product is computed in fp32 and rounded again; the kernel rounds
at the same two places. Rows may be strided (a view of a wider buffer); the last dim must be contiguous.

Triton: a 2-D grid (token, block of I). Fixed block sizes from the shapes, no host reads: CUDA-graph capturable.
``silu_and_mul`` runs Triton on CUDA tensors and the reference elsewhere.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

try:  # keep the reference importable without triton
    import triton
    import triton.language as tl

    from .pdl import pdl_launch, pdl_wait_then_release
except Exception:  # pragma: no cover
    triton = None
    tl = None


def silu_and_mul_torch(x: torch.Tensor) -> torch.Tensor:
    """``F.silu(gate) * up`` over the two halves of the last dim."""
    I = x.shape[-1] // 2
    return F.silu(x[..., :I]) * x[..., I:]


if triton is not None:

    @triton.jit
    def _silu_and_mul_kernel(
        x_ptr,
        out_ptr,
        I,
        stride_x,
        stride_out,
        BLOCK_I: tl.constexpr,
        PDL: tl.constexpr = False,  # kernels/pdl.py
    ):
        pdl_wait_then_release(PDL)
        dt = out_ptr.dtype.element_ty
        t = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK_I + tl.arange(0, BLOCK_I)
        mask = cols < I
        gate = tl.load(x_ptr + t * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
        up = tl.load(x_ptr + t * stride_x + I + cols, mask=mask, other=0.0).to(tl.float32)
        act = (gate / (1.0 + tl.exp(-gate))).to(dt).to(tl.float32)  # F.silu returns the dtype
        tl.store(out_ptr + t * stride_out + cols, (act * up).to(dt), mask=mask)


def silu_and_mul_triton(x: torch.Tensor) -> torch.Tensor:
    """Same contract as ``silu_and_mul_torch`` for ``x [..., 2I]``; CUDA, or CPU under TRITON_INTERPRET=1."""
    two_i = x.shape[-1]
    assert two_i % 2 == 0, "silu_and_mul needs an even last dim"
    I = two_i // 2
    x2 = x.reshape(-1, two_i)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    out = torch.empty(*x.shape[:-1], I, dtype=x.dtype, device=x.device)
    T = x2.shape[0]
    if T == 0 or I == 0:
        return out
    block_i = min(1024, triton.next_power_of_2(I))
    _silu_and_mul_kernel[(T, triton.cdiv(I, block_i))](
        x2,
        out,
        I,
        x2.stride(0),
        I,
        BLOCK_I=block_i,
        num_warps=4 if block_i >= 512 else 1 if block_i <= 128 else 2,
        **pdl_launch(x2),
    )
    return out


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """Triton on CUDA tensors, the torch reference elsewhere."""
    if x.is_cuda and triton is not None:
        return silu_and_mul_triton(x)
    return silu_and_mul_torch(x)
