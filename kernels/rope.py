"""Per-head q/k RMSNorm and rotate-half (NeoX) RoPE in one Triton kernel, beside the torch reference it is tested
against.

    q_out = rope(norm(q)),  k_out = rope(norm(k))          q [T, nh, D], k [T, nkv, D], positions [T] int64

- ``norm``: optional per-head RMSNorm over D, ``(1 + w)`` (``one_plus``: Qwen3-Next/3.5/3.6 gated attention) or plain
  ``w`` (Qwen3 / Qwen3-MoE q_norm/k_norm), rounded to the activation dtype exactly like ``kernels.rms_norm``; without
  weights (Llama) the values go straight to the rotation.
- ``rope``: the first R dims (``rotary_dim``) are rotated in fp32, ``out = x·cos + rotate_half(x)·sin`` with
  ``cos/sin(positions.float() · inv_freq)`` over ``cat([f, f])``, then rounded; dims ``R..D`` pass through (Qwen3.6:
  R = 64 of D = 256; Llama/Qwen3: R = D). ``inv_freq [R/2]`` fp32 is ``RotaryEmbedding.inv_freq`` (Llama-3 scaling
  included, as it is folded into inv_freq).

The reference composes ``layers.norm.RMSNorm`` and ``layers.rotary.RotaryEmbedding`` exactly. q and k may be views with
any head/token strides (e.g. ``qg[..., :D]`` of a ``[T, nh, 2D]`` projection) as long as the last dim is contiguous;
outputs are new contiguous tensors in the input's dtype.

Triton: one program per (token, head) over q's heads then k's. Each program loads its head twice, the second time at the
rotate-half partner of each dim (``d ± R/2``), so the rotation needs no register shuffle. On CUDA cos/sin come from
libdevice (``__nv_cosf``, what torch's ``cos`` runs): the fast hardware approximation loses accuracy at positions in
the tens of thousands; the interpreter has no libdevice and uses ``tl.cos`` (numpy). Fixed block sizes from the shapes
and no host reads: CUDA-graph capturable. ``qk_norm_rope`` runs Triton on CUDA tensors and the reference elsewhere.
"""

from __future__ import annotations

import os

import torch

from .rms_norm import rms_norm_torch

try:  # keep the reference importable without triton
    import triton
    import triton.language as tl
    from triton.language.extra import libdevice

    from .pdl import pdl_launch, pdl_wait_then_release
except Exception:  # pragma: no cover
    triton = None
    tl = None


# ----------------------------------------------------------------------------------------------------------------------
# torch reference
# ----------------------------------------------------------------------------------------------------------------------


def _rotate_torch(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rotary_dim: int) -> torch.Tensor:
    """``RotaryEmbedding._rotate``."""
    r = rotary_dim
    rot, rest = x[..., :r].float(), x[..., r:]
    half = r // 2
    rotated = torch.cat([-rot[..., half:], rot[..., :half]], dim=-1)
    out = rot * cos[:, None, :] + rotated * sin[:, None, :]
    return torch.cat([out.to(x.dtype), rest], dim=-1) if r < x.shape[-1] else out.to(x.dtype)


def qk_norm_rope_torch(
    q: torch.Tensor,
    k: torch.Tensor,
    positions: torch.Tensor,
    inv_freq: torch.Tensor,
    rotary_dim: int,
    q_weight: torch.Tensor | None = None,
    k_weight: torch.Tensor | None = None,
    eps: float = 1e-6,
    one_plus: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``q_norm``/``k_norm`` (when weights are given), then ``RotaryEmbedding.forward``."""
    assert (q_weight is None) == (k_weight is None), "norm both q and k, or neither"
    if q_weight is not None:
        q, k = rms_norm_torch(q, q_weight, eps, one_plus), rms_norm_torch(k, k_weight, eps, one_plus)
    freqs = positions.float()[:, None] * inv_freq.to(positions.device)[None, :]
    emb = torch.cat([freqs, freqs], dim=-1)
    cos, sin = emb.cos(), emb.sin()
    return _rotate_torch(q, cos, sin, rotary_dim), _rotate_torch(k, cos, sin, rotary_dim)


# ----------------------------------------------------------------------------------------------------------------------
# Triton
# ----------------------------------------------------------------------------------------------------------------------

if triton is not None:

    @triton.jit
    def _norm_rope_head(
        src,
        dst,
        w_ptr,
        inv_freq_ptr,
        pos,
        D,
        R,
        eps,
        HAS_NORM: tl.constexpr,
        ONE_PLUS: tl.constexpr,
        LIBDEVICE_TRIG: tl.constexpr,
        BLOCK_D: tl.constexpr,
    ):
        dt = dst.dtype.element_ty
        half = R // 2
        d = tl.arange(0, BLOCK_D)
        d_mask = d < D
        rot_mask = d < R
        first = d < half
        partner = tl.where(first, d + half, d - half)  # rotate_half reads dim d ± R/2
        x = tl.load(src + d, mask=d_mask, other=0.0).to(tl.float32)
        xp = tl.load(src + partner, mask=rot_mask, other=0.0).to(tl.float32)
        if HAS_NORM:
            rstd = tl.rsqrt(tl.sum(x * x, 0) / D + eps)
            w = tl.load(w_ptr + d, mask=d_mask, other=0.0).to(tl.float32)
            wp = tl.load(w_ptr + partner, mask=rot_mask, other=0.0).to(tl.float32)
            # round to the dtype where RMSNorm does: the rotation reads the norm's output
            if ONE_PLUS:
                x = (x * rstd * (1.0 + w)).to(dt).to(tl.float32)
                xp = (xp * rstd * (1.0 + wp)).to(dt).to(tl.float32)
            else:
                x = ((x * rstd).to(dt).to(tl.float32) * w).to(dt).to(tl.float32)
                xp = ((xp * rstd).to(dt).to(tl.float32) * wp).to(dt).to(tl.float32)
        inv_freq = tl.load(inv_freq_ptr + tl.where(first, d, d - half), mask=rot_mask, other=0.0)
        freq = pos * inv_freq
        if LIBDEVICE_TRIG:
            cos = libdevice.cos(freq)
            sin = libdevice.sin(freq)
        else:
            cos = tl.cos(freq)
            sin = tl.sin(freq)
        rotated = tl.where(first, -xp, xp)
        y = tl.where(rot_mask, x * cos + rotated * sin, x)
        tl.store(dst + d, y.to(dt), mask=d_mask)

    @triton.jit
    def _qk_norm_rope_kernel(
        q_ptr,
        k_ptr,
        qo_ptr,
        ko_ptr,
        qw_ptr,
        kw_ptr,
        pos_ptr,
        inv_freq_ptr,
        NH,
        D,
        R,
        eps,
        stride_qt,
        stride_qh,
        stride_kt,
        stride_kh,
        stride_qot,
        stride_qoh,
        stride_kot,
        stride_koh,
        HAS_NORM: tl.constexpr,
        ONE_PLUS: tl.constexpr,
        LIBDEVICE_TRIG: tl.constexpr,
        BLOCK_D: tl.constexpr,
        PDL: tl.constexpr = False,  # kernels/pdl.py
    ):
        pdl_wait_then_release(PDL)
        t = tl.program_id(0).to(tl.int64)
        h = tl.program_id(1)
        pos = tl.load(pos_ptr + t).to(tl.float32)  # positions.float(), as the reference
        if h < NH:
            _norm_rope_head(
                q_ptr + t * stride_qt + h * stride_qh,
                qo_ptr + t * stride_qot + h * stride_qoh,
                qw_ptr,
                inv_freq_ptr,
                pos,
                D,
                R,
                eps,
                HAS_NORM,
                ONE_PLUS,
                LIBDEVICE_TRIG,
                BLOCK_D,
            )
        else:
            hk = h - NH
            _norm_rope_head(
                k_ptr + t * stride_kt + hk * stride_kh,
                ko_ptr + t * stride_kot + hk * stride_koh,
                kw_ptr,
                inv_freq_ptr,
                pos,
                D,
                R,
                eps,
                HAS_NORM,
                ONE_PLUS,
                LIBDEVICE_TRIG,
                BLOCK_D,
            )


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def qk_norm_rope_triton(
    q: torch.Tensor,
    k: torch.Tensor,
    positions: torch.Tensor,
    inv_freq: torch.Tensor,
    rotary_dim: int,
    q_weight: torch.Tensor | None = None,
    k_weight: torch.Tensor | None = None,
    eps: float = 1e-6,
    one_plus: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as ``qk_norm_rope_torch``; CUDA, or CPU under TRITON_INTERPRET=1."""
    assert (q_weight is None) == (k_weight is None), "norm both q and k, or neither"
    T, NH, D = q.shape
    NKV = k.shape[1]
    assert k.shape[0] == T and k.shape[2] == D and q.dtype == k.dtype and positions.shape == (T,)
    assert rotary_dim % 2 == 0 and 0 < rotary_dim <= D and inv_freq.numel() == rotary_dim // 2
    q = q if q.stride(-1) == 1 else q.contiguous()
    k = k if k.stride(-1) == 1 else k.contiguous()
    q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    k_out = torch.empty(k.shape, dtype=k.dtype, device=k.device)
    if T == 0:
        return q_out, k_out
    has_norm = q_weight is not None
    qw = q_weight.contiguous() if has_norm else q_out  # never read without HAS_NORM
    kw = k_weight.contiguous() if has_norm else k_out
    inv_freq = inv_freq.to(device=q.device, dtype=torch.float32).contiguous()
    block_d = triton.next_power_of_2(D)
    _qk_norm_rope_kernel[(T, NH + NKV)](
        q,
        k,
        q_out,
        k_out,
        qw,
        kw,
        positions.contiguous(),
        inv_freq,
        NH,
        D,
        rotary_dim,
        eps,
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        q_out.stride(0),
        q_out.stride(1),
        k_out.stride(0),
        k_out.stride(1),
        HAS_NORM=has_norm,
        ONE_PLUS=one_plus,
        LIBDEVICE_TRIG=not _interpreting(),
        BLOCK_D=block_d,
        num_warps=max(1, min(4, block_d // 128)),
        **pdl_launch(q),
    )
    return q_out, k_out


def qk_norm_rope(
    q: torch.Tensor,
    k: torch.Tensor,
    positions: torch.Tensor,
    inv_freq: torch.Tensor,
    rotary_dim: int,
    q_weight: torch.Tensor | None = None,
    k_weight: torch.Tensor | None = None,
    eps: float = 1e-6,
    one_plus: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton on CUDA tensors, the torch reference elsewhere."""
    fn = qk_norm_rope_triton if q.is_cuda and triton is not None else qk_norm_rope_torch
    return fn(q, k, positions, inv_freq, rotary_dim, q_weight, k_weight, eps, one_plus)
