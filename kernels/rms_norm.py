"""RMS norms of the decode hot path as single Triton kernels, each beside the torch reference it is tested against.

    rms_norm(x, w)           one_plus: (xf · r · (1 + w)).to(dtype)        r = rsqrt(mean(xf²) + eps), xf = x in fp32
                             plain:    w · (xf · r).to(dtype)              (Llama: cast BEFORE the weight multiply)
    add_rms_norm(x, res, w)  s = (x + res).to(dtype); (rms_norm(s, w), s)  (the decoder's ``h = h + mixer(x)``, fused)
    gated_rms_norm(x, z, w)  (w · (xf · r).to(dtype) · silu(zf)).to(dtype)  (Gated DeltaNet output norm)

The references reproduce ``freetoken.layers.norm.RMSNorm`` and ``layers.gated_deltanet.GatedRMSNorm`` exactly, rounding
to the activation dtype where they do. Inputs are ``[..., N]`` with a contiguous last dim; the leading dims may be
row-strided views (e.g. ``qg[..., :D]``) as long as they collapse to one row stride. Outputs are new contiguous tensors
in x's dtype, except ``add_rms_norm(..., inplace=True)``, which writes the sum into ``residual``'s own storage (the
decoder's one residual stream buffer) and returns ``residual`` as the sum. All math is fp32; bf16 / fp16 / fp32 in.
The plain and gated variants round ``w · n`` to x's dtype: equal to the layers when the weight is in x's dtype, as it
is in every model.

The Triton kernel is one program per ``BLOCK_R`` rows, the whole row in registers (N ≤ 65536). Block sizes come from
the shapes alone and nothing reads back to the host, so every call can be captured in a CUDA graph. ``rms_norm``,
``add_rms_norm`` and ``gated_rms_norm`` run Triton on CUDA tensors and the torch reference elsewhere.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

try:  # keep the references importable without triton
    import triton
    import triton.language as tl

    from .pdl import pdl_launch, pdl_wait_then_release
except Exception:  # pragma: no cover
    triton = None
    tl = None


# ----------------------------------------------------------------------------------------------------------------------
# torch references
# ----------------------------------------------------------------------------------------------------------------------


def _normalize(x: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    return xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)


def rms_norm_torch(x: torch.Tensor, weight: torch.Tensor, eps: float, one_plus: bool) -> torch.Tensor:
    """``RMSNorm.forward``: ``(1 + w)`` in fp32 (one_plus) or ``w`` times the normalised x rounded to x's dtype."""
    n = _normalize(x, eps)
    if one_plus:
        return (n * (1.0 + weight.float())).to(x.dtype)
    return (weight * n.to(x.dtype)).to(x.dtype)


def add_rms_norm_torch(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    one_plus: bool,
    inplace: bool = False,
    out: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``summed = x + residual`` (rounded to the dtype, as the eager add), ``(rms_norm(summed), summed)``. With
    ``inplace`` the sum is written into ``residual`` and ``residual`` is returned as ``summed``; ``out`` (x's shape
    and dtype): where the norm is written (a MoE prefill graph's input rows), and returned."""
    summed = residual.add_(x) if inplace else x + residual
    normed = rms_norm_torch(summed, weight, eps, one_plus)
    return (normed if out is None else out.copy_(normed)), summed


def gated_rms_norm_torch(x: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``GatedRMSNorm.forward``: ``w · n`` rounded to the dtype, times ``silu(z)`` in fp32, rounded."""
    out = (weight * _normalize(x, eps).to(x.dtype)).to(x.dtype)
    return (out * F.silu(z.float())).to(x.dtype)


# ----------------------------------------------------------------------------------------------------------------------
# Triton
# ----------------------------------------------------------------------------------------------------------------------

if triton is not None:
    # the row count is not specialized (a count divisible by 16 would compile another kernel on a request's path)
    @triton.jit(do_not_specialize=["R"])
    def _rms_norm_kernel(
        x_ptr,
        res_ptr,
        z_ptr,
        w_ptr,
        out_ptr,
        sum_ptr,
        R,
        N,
        eps,
        stride_x,
        stride_res,
        stride_z,
        z_heads,  # the gate's rows come in groups of z_heads heads: row r reads (r // z_heads, r % z_heads)
        stride_zh,
        stride_out,
        stride_sum,
        ONE_PLUS: tl.constexpr,
        HAS_RESIDUAL: tl.constexpr,
        HAS_GATE: tl.constexpr,
        BLOCK_R: tl.constexpr,
        BLOCK_N: tl.constexpr,
        PDL: tl.constexpr = False,  # kernels/pdl.py
    ):
        pdl_wait_then_release(PDL)
        dt = out_ptr.dtype.element_ty
        rows = (tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)
        cols = tl.arange(0, BLOCK_N)
        col_mask = cols < N
        mask = (rows < R)[:, None] & col_mask[None, :]
        x = tl.load(x_ptr + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        if HAS_RESIDUAL:
            r = tl.load(res_ptr + rows[:, None] * stride_res + cols[None, :], mask=mask, other=0.0).to(tl.float32)
            s = (x + r).to(dt)  # the eager residual add rounds to the dtype before the norm reads it
            tl.store(sum_ptr + rows[:, None] * stride_sum + cols[None, :], s, mask=mask)
            x = s.to(tl.float32)
        rstd = tl.rsqrt(tl.sum(x * x, 1) / N + eps)
        n = x * rstd[:, None]
        w = tl.load(w_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
        if ONE_PLUS:
            y = n * (1.0 + w)
        else:
            y = n.to(dt).to(tl.float32) * w  # Llama casts before the weight multiply
            if HAS_GATE:
                z_row = (rows // z_heads) * stride_z + (rows % z_heads) * stride_zh
                z = tl.load(z_ptr + z_row[:, None] + cols[None, :], mask=mask, other=0.0).to(tl.float32)
                y = y.to(dt).to(tl.float32) * (z / (1.0 + tl.exp(-z)))
        tl.store(out_ptr + rows[:, None] * stride_out + cols[None, :], y.to(dt), mask=mask)


def _rows(t: torch.Tensor, n: int) -> torch.Tensor:
    """``t`` as ``[R, n]`` rows with a unit last stride: a view where the leading dims collapse, else a copy."""
    t = t.reshape(-1, n)
    return t if t.stride(-1) == 1 or t.shape[0] == 0 else t.contiguous()


def _launch(x2, res2, z2, weight, out2, sum2, eps, one_plus, z_heads: int = 1):
    """``z2``: the gate as ``[R, N]`` rows, or (``z_heads`` > 1) as ``[R // z_heads, z_heads, N]`` with any strides
    but a unit last one."""
    R, N = x2.shape
    if R == 0:
        return
    assert N <= 65536, "rms_norm keeps a whole row in registers"
    block_n = triton.next_power_of_2(N)
    block_r = max(1, 2048 // block_n)  # ~2k elements per program (not from R: one kernel for every row count)
    elems = block_r * block_n
    num_warps = 4 if elems <= 2048 else 8 if elems <= 8192 else 16
    weight = weight if weight.stride(-1) == 1 else weight.contiguous()
    _rms_norm_kernel[(triton.cdiv(R, block_r),)](
        x2,
        res2 if res2 is not None else x2,
        z2 if z2 is not None else x2,
        weight,
        out2,
        sum2 if sum2 is not None else out2,
        R,
        N,
        eps,
        x2.stride(0),
        res2.stride(0) if res2 is not None else 0,
        z2.stride(0) if z2 is not None else 0,
        z_heads,
        z2.stride(1) if z_heads > 1 else 0,
        out2.stride(0),
        sum2.stride(0) if sum2 is not None else 0,
        ONE_PLUS=one_plus,
        HAS_RESIDUAL=res2 is not None,
        HAS_GATE=z2 is not None,
        BLOCK_R=block_r,
        BLOCK_N=block_n,
        num_warps=num_warps,
        **pdl_launch(x2),
    )


def rms_norm_triton(x: torch.Tensor, weight: torch.Tensor, eps: float, one_plus: bool) -> torch.Tensor:
    """Same contract as ``rms_norm_torch``; CUDA, or CPU under TRITON_INTERPRET=1."""
    N = x.shape[-1]
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    _launch(_rows(x, N), None, None, weight, out.view(-1, N), None, eps, one_plus)
    return out


def add_rms_norm_triton(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    one_plus: bool,
    inplace: bool = False,
    out: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as ``add_rms_norm_torch``; one kernel reads x and residual once and writes both outputs."""
    assert x.shape == residual.shape and x.dtype == residual.dtype
    N = x.shape[-1]
    if out is None:
        out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    assert out.shape == x.shape and out.dtype == x.dtype and out.is_contiguous()
    res2 = _rows(residual, N)
    if inplace:
        assert res2.data_ptr() == residual.data_ptr() or residual.numel() == 0, "residual rows must be a view"
        summed, sum2 = residual, res2
    else:
        summed = torch.empty(x.shape, dtype=x.dtype, device=x.device)
        sum2 = summed.view(-1, N)
    _launch(_rows(x, N), res2, None, weight, out.view(-1, N), sum2, eps, one_plus)
    return out, summed


def gated_rms_norm_triton(x: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Same contract as ``gated_rms_norm_torch``. A ``[T, heads, N]`` gate whose rows do not collapse into one
    stride (the Gated DeltaNet's z: a column slice of the fused input projection) is read where it lies."""
    assert x.shape == z.shape
    N = x.shape[-1]
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    z_heads = 1
    if z.dim() == 3 and z.stride(-1) == 1 and z.shape[0] > 1 and z.stride(0) != z.shape[1] * z.stride(1):
        z_heads = z.shape[1]  # no [T * heads, N] view exists (a reshape would copy): index (token, head) instead
    z2 = z if z_heads > 1 else _rows(z, N)
    _launch(_rows(x, N), None, z2, weight, out.view(-1, N), None, eps, False, z_heads)
    return out


# ----------------------------------------------------------------------------------------------------------------------
# dispatch: Triton on CUDA tensors, the reference elsewhere
# ----------------------------------------------------------------------------------------------------------------------


def _use_triton(x: torch.Tensor) -> bool:
    return x.is_cuda and triton is not None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, one_plus: bool) -> torch.Tensor:
    if _use_triton(x):
        return rms_norm_triton(x, weight, eps, one_plus)
    return rms_norm_torch(x, weight, eps, one_plus)


def add_rms_norm(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    one_plus: bool,
    inplace: bool = False,
    out: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    if _use_triton(x):
        return add_rms_norm_triton(x, residual, weight, eps, one_plus, inplace, out)
    return add_rms_norm_torch(x, residual, weight, eps, one_plus, inplace, out)


def gated_rms_norm(x: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    if _use_triton(x):
        return gated_rms_norm_triton(x, z, weight, eps)
    return gated_rms_norm_torch(x, z, weight, eps)
