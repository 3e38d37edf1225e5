"""A few tokens of one sequence through the Gated DeltaNet delta rule, token by token, in one launch.

A cached agent turn that takes a snapshot at the last 64-token grid point inside its chunk (issue 12) runs the
delta rule in two pieces per GDN layer: the chunk up to the grid point (fla's chunked kernels, or their CUDA graph)
and the < 64 tokens after it. fla's chunked path pads that tail to a whole chunk, and its recurrent kernel sits behind
a Python wrapper; either costs several launches and copies of host time per layer in a host-bound step. This kernel
is the whole tail in one launch: each program keeps a ``[dk, BV]`` block of one value head's state in registers
(fp32) across the tokens.

Math per token t and value head h (key head ``h // (Hv/Hk)``), as fla's ``use_qk_l2norm_in_kernel=True``:
``q̂ = l2norm(q)·scale, k̂ = l2norm(k)``, ``S ← exp(g)·S;  S ← S + k̂ ⊗ β(v − k̂ᵀS);  o = q̂ᵀS``, with ``g`` (log-decay)
and ``β`` given (``kernels/gdn_gates.py``). ``gdn_recurrent_piece_torch`` is the reference (the layer's torch
recurrence); ``gdn_recurrent_piece`` dispatches (Triton on CUDA, or anywhere under ``TRITON_INTERPRET=1``).
"""

from __future__ import annotations

from typing import Optional

import torch

try:  # keep the reference importable without triton
    import triton
    import triton.language as tl

    from .pdl import pdl_launch, pdl_wait_then_release

except Exception:  # pragma: no cover
    triton = None
    tl = None

L2NORM_EPS = 1e-6


def gdn_recurrent_piece_torch(q, k, v, g, beta, initial_state, scale: Optional[float] = None):
    """Reference: ``q, k [T, Hk, dk]``, ``v [T, Hv, dv]``, ``g, beta [T, Hv]`` fp32, ``initial_state [1, Hv, dk, dv]``
    -> ``(o [T, Hv, dv] in v's dtype, final [1, Hv, dk, dv] fp32)``, the layer's token-by-token torch math."""
    from freetoken.layers.gated_deltanet import l2norm, torch_recurrent_gated_delta_rule

    dk, r = q.shape[-1], v.shape[1] // q.shape[1]
    scale = dk**-0.5 if scale is None else scale
    qf = l2norm(q.float(), L2NORM_EPS) * scale
    kf = l2norm(k.float(), L2NORM_EPS)
    if r > 1:
        qf, kf = qf.repeat_interleave(r, dim=1), kf.repeat_interleave(r, dim=1)
    o, final = torch_recurrent_gated_delta_rule(
        *(x.transpose(0, 1)[None] for x in (qf, kf, v.float(), g.float(), beta.float())), initial_state.float()
    )
    return o[0].transpose(0, 1).to(v.dtype), final


if triton is not None:
    # T (1..63 tokens) is not specialized: a tail of 16, 32 or 48 tokens would otherwise compile its own kernel on
    # the request path (~200 ms; an agent turn's tail is whatever its length leaves after the grid point)
    @triton.jit(do_not_specialize=["T"])
    def _gdn_recurrent_piece_kernel(
        q_ptr,  # [T, HK, DK], last dim contiguous
        k_ptr,  # [T, HK, DK]
        v_ptr,  # [T, HV, DV]
        g_ptr,  # [T, HV] fp32
        beta_ptr,  # [T, HV] fp32
        s0_ptr,  # [HV, DK, DV] fp32, contiguous: the state before the piece (only read)
        o_ptr,  # [T, HV, DV]
        s1_ptr,  # [HV, DK, DV] fp32, contiguous: the state after it
        T,
        scale,
        stride_qt,
        stride_qh,
        stride_kt,
        stride_kh,
        stride_vt,
        stride_vh,
        stride_gt,
        stride_bt,
        stride_ot,
        stride_oh,
        R: tl.constexpr,  # value heads per key head
        DK: tl.constexpr,
        DV: tl.constexpr,
        BK: tl.constexpr,  # next power of 2 >= DK: a program holds every key row of its value columns
        BV: tl.constexpr,
        EPS: tl.constexpr,
        PDL: tl.constexpr = False,  # kernels/pdl.py
    ):
        pdl_wait_then_release(PDL)
        i_h = tl.program_id(0)
        i_hk = i_h // R
        offs_k = tl.arange(0, BK)
        offs_v = tl.program_id(1) * BV + tl.arange(0, BV)
        k_mask = offs_k < DK
        v_mask = offs_v < DV
        s_off = i_h * DK * DV + offs_k[:, None] * DV + offs_v[None, :]
        s_mask = k_mask[:, None] & v_mask[None, :]
        S = tl.load(s0_ptr + s_off, mask=s_mask, other=0.0)
        # token t+1's inputs are loaded before token t is computed: the loads do not depend on the state, so their
        # latency hides behind the token's reductions instead of stalling every step of this sequential loop
        q_n = tl.load(q_ptr + i_hk * stride_qh + offs_k, mask=k_mask, other=0.0)
        k_n = tl.load(k_ptr + i_hk * stride_kh + offs_k, mask=k_mask, other=0.0)
        v_n = tl.load(v_ptr + i_h * stride_vh + offs_v, mask=v_mask, other=0.0)
        g_n = tl.load(g_ptr + i_h)
        beta_n = tl.load(beta_ptr + i_h)
        for t in range(T):
            q, k, v, g, beta = q_n.to(tl.float32), k_n.to(tl.float32), v_n.to(tl.float32), g_n, beta_n
            tn = tl.minimum(t + 1, T - 1)  # (the last token loads itself again, unused: no scalar masks)
            q_n = tl.load(q_ptr + tn * stride_qt + i_hk * stride_qh + offs_k, mask=k_mask, other=0.0)
            k_n = tl.load(k_ptr + tn * stride_kt + i_hk * stride_kh + offs_k, mask=k_mask, other=0.0)
            v_n = tl.load(v_ptr + tn * stride_vt + i_h * stride_vh + offs_v, mask=v_mask, other=0.0)
            g_n = tl.load(g_ptr + tn * stride_gt + i_h)
            beta_n = tl.load(beta_ptr + tn * stride_bt + i_h)
            # with q̂ = rq·q, k̂ = rk·k (l2norm) and S' = exp(g)·S:  d = β(v - k̂ᵀS'),  S <- S' + k̂ ⊗ d  and
            # o = q̂ᵀS = q̂ᵀS' + (q̂·k̂)·d. Every reduction of a token (|q|², |k|², q·k, kᵀS', qᵀS') reads only the
            # token's raw inputs and S', so all five run side by side: one dependent reduction a token, not three
            S = S * tl.exp(g)
            rq = tl.rsqrt(tl.sum(q * q, axis=0) + EPS) * scale
            rk = tl.rsqrt(tl.sum(k * k, axis=0) + EPS)
            qk = tl.sum(q * k, axis=0)
            kS = tl.sum(S * k[:, None], axis=0)
            qS = tl.sum(S * q[:, None], axis=0)
            d = (v - kS * rk) * beta
            S = S + (k * rk)[:, None] * d[None, :]
            o = (qS + qk * rk * d) * rq
            tl.store(o_ptr + t * stride_ot + i_h * stride_oh + offs_v, o.to(o_ptr.dtype.element_ty), mask=v_mask)
        tl.store(s1_ptr + s_off, S, mask=s_mask)


# a program's warps and value columns: one warp reduces over the key rows with shuffles alone (no shared-memory
# round trip and barrier a reduction), and Qwen3.6's 32 heads x 8 blocks of 16 columns still make 256 programs
PIECE_WARPS = 1
PIECE_BLOCK_V = 16


def gdn_recurrent_piece_triton(
    q,
    k,
    v,
    g,
    beta,
    initial_state,
    scale: Optional[float] = None,
    warps: int = PIECE_WARPS,
    block_v: int = PIECE_BLOCK_V,
    out: Optional[torch.Tensor] = None,
):
    """Triton form of ``gdn_recurrent_piece_torch`` (same contract); grid ``(Hv, dv / block_v)``, ``warps`` a
    program (A/B runs: ``bench/gdn_piece_bench.py --warps``); ``out`` (``[T, Hv, dv]`` in v's dtype, last dim
    contiguous: rows of the caller's whole output) receives o instead of a new tensor."""
    assert triton is not None, "triton is not installed"
    T, Hk, dk = q.shape
    Hv, dv = v.shape[1], v.shape[2]
    assert k.shape == q.shape and v.shape[0] == T and Hv % Hk == 0, (q.shape, k.shape, v.shape)
    assert g.shape == (T, Hv) and beta.shape == (T, Hv) and g.dtype == beta.dtype == torch.float32
    assert initial_state.shape == (1, Hv, dk, dv), (initial_state.shape, (1, Hv, dk, dv))
    assert q.stride(-1) == 1 and k.stride(-1) == 1 and v.stride(-1) == 1 and g.stride(1) == 1 and beta.stride(1) == 1
    s0 = initial_state.float().contiguous()
    if out is None:
        out = torch.empty(T, Hv, dv, dtype=v.dtype, device=v.device)
    assert out.shape == (T, Hv, dv) and out.dtype == v.dtype and out.stride(-1) == 1, (out.shape, out.dtype)
    final = torch.empty_like(s0)
    bv = min(block_v, triton.next_power_of_2(dv))
    _gdn_recurrent_piece_kernel[(Hv, triton.cdiv(dv, bv))](
        q,
        k,
        v,
        g,
        beta,
        s0,
        out,
        final,
        T,
        dk**-0.5 if scale is None else float(scale),
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        g.stride(0),
        beta.stride(0),
        out.stride(0),
        out.stride(1),
        R=Hv // Hk,
        DK=dk,
        DV=dv,
        BK=triton.next_power_of_2(dk),
        BV=bv,
        EPS=L2NORM_EPS,
        num_warps=warps,
        **pdl_launch(q),
    )
    return out, final


def gdn_recurrent_piece(q, k, v, g, beta, initial_state, scale: Optional[float] = None, out=None):
    """One sequence's few tokens (``[T, H, *]``) -> ``(o [T, Hv, dv] in v's dtype, final [1, Hv, dk, dv] fp32)``:
    Triton on CUDA, the torch reference elsewhere; o written into ``out`` when given (rows of the caller's output)."""
    if q.is_cuda and triton is not None:
        return gdn_recurrent_piece_triton(q, k, v, g, beta, initial_state, scale, out=out)
    o, final = gdn_recurrent_piece_torch(q, k, v, g, beta, initial_state, scale)
    if out is None:
        return o, final
    out.copy_(o)
    return out, final
