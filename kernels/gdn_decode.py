"""Gated DeltaNet decode step (one token per sequence), in place on the ``RecurrentStatePool`` tensors of one layer.

Two steps, each a Triton kernel beside the torch reference it is tested against (REFERENCES §1.6, §2):

- ``gdn_conv_decode``: the causal depthwise conv update + SiLU. Per sequence b (slot ``s = slots[b]``) and channel c:
  ``window = [conv_state[s, c, 0 .. Kc-2], qkv[b, c]]``, ``y[b, c] = silu(Σ_j weight[c, j] · window[j])``, then
  ``conv_state[s, c, :] = window[1:]``.
- ``gdn_recurrent_decode``: gating (``g = −exp(A_log)·softplus(a + dt_bias)``, ``β = sigmoid(b)``), l2norm of q/k
  (eps inside the sqrt), q scaled, GVA (value head h reads key head ``h // (Hv/Hk)``) and one delta-rule step on
  the state ``ssm_state[s, h] ∈ R^{dk×dv}`` (HF/fla layout, NOT vLLM/SGLang's ``[Hv, dv, dk]``):
  ``S ← exp(g)·S;  S ← S + k ⊗ β(v − kᵀS);  o = qᵀS``.

Both read each sequence's state straight from its slot and write it back in place (no gather/scatter copies),
batched over all sequences in one launch each, with no host sync and launch configs that depend on shapes only,
so a decode step can be captured in a CUDA graph.

Slots: a slot list never holds a slot twice, EXCEPT the padding rows of a CUDA-graph batch, which all point at one
scratch slot. Those rows race on the scratch slot (in the Triton kernels, and the torch references' scatter keeps an
arbitrary one), so their outputs and the scratch slot's content are garbage; every program touches only the state
of its own row's slot, so real rows are unaffected.

The references (``*_torch``) reproduce the layer's eager decode path (``GatedDeltaNet.forward``'s ``if decode:``
block; ``_prepare_torch`` + ``torch_recurrent_gated_delta_rule``) and work on any device. ``gdn_conv_decode`` /
``gdn_recurrent_decode`` dispatch: Triton on CUDA tensors, torch elsewhere (``impl`` forces one; Triton on CPU
needs ``TRITON_INTERPRET=1``).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

try:  # triton is a hard dependency on GPU machines; keep the references importable without it
    import triton
    import triton.language as tl

    from .gdn_gates import gate_values
    from .pdl import pdl_launch, pdl_wait_then_release
except Exception:  # pragma: no cover
    triton = None
    tl = None

L2NORM_EPS = 1e-6


# ----------------------------------------------------------------------------------------------------------------------
# torch references
# ----------------------------------------------------------------------------------------------------------------------


def gdn_conv_decode_torch(
    qkv: torch.Tensor, conv_state: torch.Tensor, weight: torch.Tensor, slots: torch.Tensor, out=None
) -> torch.Tensor:
    """Reference for ``gdn_conv_decode_triton``: exactly the layer's eager decode conv (math in qkv's dtype)."""
    window = torch.cat([conv_state[slots].to(qkv.dtype), qkv[:, :, None]], dim=-1)  # [B, C, Kc]
    y = F.silu((window * weight.to(qkv.dtype)).sum(-1))
    conv_state[slots] = window[:, :, 1:].to(conv_state.dtype)
    if out is None:
        return y
    return out.copy_(y)


def gdn_recurrent_decode_torch(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    ssm_state: torch.Tensor,
    slots: torch.Tensor,
    scale: Optional[float] = None,
    out=None,
) -> torch.Tensor:
    """Reference for ``gdn_recurrent_decode_triton``: the layer's gating, ``_prepare_torch`` and one step of
    ``torch_recurrent_gated_delta_rule``, in the same op order (fp32 math)."""
    Hv, dk = v.shape[1], q.shape[-1]
    r = Hv // q.shape[1]
    scale = dk**-0.5 if scale is None else scale
    qf = q.float()
    kf = k.float()
    qf = qf * torch.rsqrt((qf * qf).sum(-1, keepdim=True) + L2NORM_EPS) * scale
    kf = kf * torch.rsqrt((kf * kf).sum(-1, keepdim=True) + L2NORM_EPS)
    if r > 1:
        qf = qf.repeat_interleave(r, dim=1)
        kf = kf.repeat_interleave(r, dim=1)
    g = -torch.exp(A_log.float()) * F.softplus(a.float() + dt_bias.float())  # [B, Hv]
    beta = torch.sigmoid(b.float())
    S = ssm_state[slots].float() * g.exp()[..., None, None]  # [B, Hv, dk, dv]
    kv_mem = torch.einsum("bhk,bhkv->bhv", kf, S)
    delta = (v.float() - kv_mem) * beta[..., None]
    S = S + kf[..., :, None] * delta[..., None, :]
    o = torch.einsum("bhk,bhkv->bhv", qf, S)
    ssm_state[slots] = S.to(ssm_state.dtype)
    if out is None:
        return o.to(v.dtype)
    return out.copy_(o)


# ----------------------------------------------------------------------------------------------------------------------
# Triton kernels
# ----------------------------------------------------------------------------------------------------------------------

if triton is not None:

    @triton.jit
    def delta_rule_token(S, q, k, v, g, beta, scale, EPS: tl.constexpr):
        """One token of the delta rule on a ``[BK, BV]`` fp32 state block: ``q, k [BK]`` fp32 as projected
        (l2-normalised here, q scaled), ``v [BV]`` fp32, ``g, beta`` the token's gates. Returns ``(S, o [BV])``.
        The decode step's form; the token-by-token piece kernel (``gdn_recurrent_piece.py``) runs the same math with
        its reductions side by side (one warp a program, where a token's latency is the cost)."""
        q = q * tl.rsqrt(tl.sum(q * q, axis=0) + EPS) * scale
        k = k * tl.rsqrt(tl.sum(k * k, axis=0) + EPS)
        S = S * tl.exp(g)
        kv_mem = tl.sum(S * k[:, None], axis=0)
        S = S + k[:, None] * ((v - kv_mem) * beta)[None, :]
        return S, tl.sum(S * q[:, None], axis=0)

    @triton.jit
    def _gdn_conv_decode_kernel(
        x_ptr,  # [B, C] (row stride free)
        state_ptr,  # [S, C, KC-1]
        w_ptr,  # [C, KC]
        slots_ptr,  # [B]
        y_ptr,  # [B, C]
        C,
        stride_xb,
        stride_xc,
        stride_ss,
        stride_sc,
        stride_sk,
        stride_wc,
        stride_wk,
        stride_yb,
        stride_yc,
        KC: tl.constexpr,
        KW: tl.constexpr,  # next power of 2 >= KC: the window's columns
        BLOCK_C: tl.constexpr,
        PDL: tl.constexpr = False,  # kernels/pdl.py
    ):
        pdl_wait_then_release(PDL)
        i_b = tl.program_id(0)
        offs_c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
        c_mask = offs_c < C
        j = tl.arange(0, KW)[None, :]
        xdt = x_ptr.dtype.element_ty
        slot = tl.load(slots_ptr + i_b).to(tl.int64)
        x = tl.load(x_ptr + i_b * stride_xb + offs_c * stride_xc, mask=c_mask, other=0.0)[:, None]
        # the reference rounds the cached inputs and the weight to qkv's dtype before the conv
        s_rows = state_ptr + slot * stride_ss + offs_c[:, None].to(tl.int64) * stride_sc
        old = tl.load(s_rows + j * stride_sk, mask=c_mask[:, None] & (j < KC - 1), other=0.0).to(xdt)
        window = tl.where(j == KC - 1, x, old).to(tl.float32)  # column j = window[j]
        w = tl.load(w_ptr + offs_c[:, None] * stride_wc + j * stride_wk, mask=c_mask[:, None] & (j < KC), other=0.0)
        acc = tl.sum(window * w.to(xdt).to(tl.float32), axis=1)
        y = acc * tl.sigmoid(acc)
        tl.store(y_ptr + i_b * stride_yb + offs_c * stride_yc, y.to(y_ptr.dtype.element_ty), mask=c_mask)
        # new state = window[1:]: registers cannot be shifted, so read it shifted by one column (an L1 hit) ...
        nxt = tl.load(s_rows + (j + 1) * stride_sk, mask=c_mask[:, None] & (j + 1 < KC - 1), other=0.0).to(xdt)
        nxt = tl.where(j == KC - 2, x, nxt)
        # ... and make every thread's reads of this block happen before any thread overwrites it
        tl.debug_barrier()
        tl.store(s_rows + j * stride_sk, nxt.to(state_ptr.dtype.element_ty), mask=c_mask[:, None] & (j < KC - 1))

    @triton.jit
    def _gdn_recurrent_decode_kernel(
        q_ptr,  # [B, HK, DK]
        k_ptr,  # [B, HK, DK]
        v_ptr,  # [B, HV, DV]
        a_ptr,  # [B, HV]
        b_ptr,  # [B, HV]
        A_log_ptr,  # [HV]
        dt_bias_ptr,  # [HV]
        state_ptr,  # [S, HV, DK, DV]
        slots_ptr,  # [B]
        o_ptr,  # [B, HV, DV]
        scale,
        stride_qb,
        stride_qh,
        stride_qk,
        stride_kb,
        stride_kh,
        stride_kk,
        stride_vb,
        stride_vh,
        stride_vv,
        stride_ab,
        stride_ah,
        stride_bb,
        stride_bh,
        stride_ss,
        stride_sh,
        stride_sk,
        stride_sv,
        stride_ob,
        stride_oh,
        stride_ov,
        R: tl.constexpr,  # value heads per key head (GVA)
        DK: tl.constexpr,
        DV: tl.constexpr,
        BK: tl.constexpr,  # next power of 2 >= DK: a program holds every key row of its value columns
        BV: tl.constexpr,
        EPS: tl.constexpr,
        PDL: tl.constexpr = False,  # kernels/pdl.py
    ):
        pdl_wait_then_release(PDL)
        i_b = tl.program_id(0)
        i_h = tl.program_id(1)
        i_hk = i_h // R
        offs_k = tl.arange(0, BK)
        offs_v = tl.program_id(2) * BV + tl.arange(0, BV)
        k_mask = offs_k < DK
        v_mask = offs_v < DV
        slot = tl.load(slots_ptr + i_b).to(tl.int64)

        q = tl.load(q_ptr + i_b * stride_qb + i_hk * stride_qh + offs_k * stride_qk, mask=k_mask, other=0.0)
        k = tl.load(k_ptr + i_b * stride_kb + i_hk * stride_kh + offs_k * stride_kk, mask=k_mask, other=0.0)
        v = tl.load(v_ptr + i_b * stride_vb + i_h * stride_vh + offs_v * stride_vv, mask=v_mask, other=0.0)

        g, beta = gate_values(
            tl.load(a_ptr + i_b * stride_ab + i_h * stride_ah).to(tl.float32),
            tl.load(b_ptr + i_b * stride_bb + i_h * stride_bh).to(tl.float32),
            tl.load(A_log_ptr + i_h).to(tl.float32),
            tl.load(dt_bias_ptr + i_h).to(tl.float32),
        )

        # [BK, BV] block of the state: every element read once and written once by this program only
        s_ptrs = (
            state_ptr + slot * stride_ss + i_h * stride_sh + offs_k[:, None] * stride_sk + offs_v[None, :] * stride_sv
        )
        s_mask = k_mask[:, None] & v_mask[None, :]
        S = tl.load(s_ptrs, mask=s_mask, other=0.0).to(tl.float32)
        S, o = delta_rule_token(S, q.to(tl.float32), k.to(tl.float32), v.to(tl.float32), g, beta, scale, EPS)
        tl.store(s_ptrs, S.to(state_ptr.dtype.element_ty), mask=s_mask)
        tl.store(
            o_ptr + i_b * stride_ob + i_h * stride_oh + offs_v * stride_ov, o.to(o_ptr.dtype.element_ty), mask=v_mask
        )


CONV_BLOCK_C = 256
# programs the recurrent launch aims for before it widens its value blocks (fills an H100/H200 a few times over)
RECURRENT_TARGET_PROGRAMS = 1024


def gdn_conv_decode_triton(
    qkv: torch.Tensor, conv_state: torch.Tensor, weight: torch.Tensor, slots: torch.Tensor, out=None
) -> torch.Tensor:
    """Triton form of ``gdn_conv_decode``; grid ``(B, cdiv(C, 256))``."""
    assert triton is not None, "triton is not installed"
    B, C = qkv.shape
    S, C_s, Kc1 = conv_state.shape
    Kc = weight.shape[-1]
    assert C_s == C and weight.shape == (C, Kc) and Kc1 == Kc - 1 and Kc >= 2, (
        qkv.shape,
        conv_state.shape,
        weight.shape,
    )
    assert slots.shape == (B,) and slots.device == qkv.device == conv_state.device
    y = torch.empty(B, C, dtype=qkv.dtype, device=qkv.device) if out is None else out
    assert y.shape == (B, C)
    if B == 0:
        return y
    block_c = min(CONV_BLOCK_C, triton.next_power_of_2(C))
    _gdn_conv_decode_kernel[(B, triton.cdiv(C, block_c))](
        qkv,
        conv_state,
        weight,
        slots,
        y,
        C,
        qkv.stride(0),
        qkv.stride(1),
        conv_state.stride(0),
        conv_state.stride(1),
        conv_state.stride(2),
        weight.stride(0),
        weight.stride(1),
        y.stride(0),
        y.stride(1),
        KC=Kc,
        KW=triton.next_power_of_2(Kc),
        BLOCK_C=block_c,
        num_warps=4,
        **pdl_launch(qkv),
    )
    return y


def recurrent_block_v(batch: int, num_v_heads: int, dv: int) -> int:
    """Value columns per program: narrow (8) when few sequences decode, so that B = 1 still spreads over many SMs;
    wider (up to 32) once ``B·Hv·dv/BV`` programs fill the GPU anyway. Shapes only: graph-capturable."""
    widest = min(32, triton.next_power_of_2(dv))
    bv = min(8, widest)
    while bv < widest and batch * num_v_heads * triton.cdiv(dv, 2 * bv) >= RECURRENT_TARGET_PROGRAMS:
        bv *= 2
    return bv


def gdn_recurrent_decode_triton(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    ssm_state: torch.Tensor,
    slots: torch.Tensor,
    scale: Optional[float] = None,
    out=None,
) -> torch.Tensor:
    """Triton form of ``gdn_recurrent_decode``; grid ``(B, Hv, cdiv(dv, BV))`` with ``BV = recurrent_block_v(...)``,
    each program holding a ``[dk, BV]`` block of one head's state in registers (fp32)."""
    assert triton is not None, "triton is not installed"
    B, Hk, dk = q.shape
    Hv, dv = v.shape[1], v.shape[2]
    assert k.shape == q.shape and v.shape[0] == B and Hv % Hk == 0, (q.shape, k.shape, v.shape)
    assert a.shape == (B, Hv) and b.shape == (B, Hv) and A_log.shape == (Hv,) and dt_bias.shape == (Hv,)
    assert ssm_state.shape[1:] == (Hv, dk, dv), (ssm_state.shape, (Hv, dk, dv))
    assert slots.shape == (B,) and slots.device == q.device == ssm_state.device
    o = torch.empty(B, Hv, dv, dtype=v.dtype, device=v.device) if out is None else out
    assert o.shape == (B, Hv, dv)
    if B == 0:
        return o
    scale = dk**-0.5 if scale is None else float(scale)
    bk = triton.next_power_of_2(dk)
    bv = recurrent_block_v(B, Hv, dv)
    _gdn_recurrent_decode_kernel[(B, Hv, triton.cdiv(dv, bv))](
        q,
        k,
        v,
        a,
        b,
        A_log,
        dt_bias,
        ssm_state,
        slots,
        o,
        scale,
        *q.stride(),
        *k.stride(),
        *v.stride(),
        *a.stride(),
        *b.stride(),
        *ssm_state.stride(),
        *o.stride(),
        R=Hv // Hk,
        DK=dk,
        DV=dv,
        BK=bk,
        BV=bv,
        EPS=L2NORM_EPS,
        num_warps=max(1, min(4, bk * bv // 512)),  # about 16 state elements per thread
        **pdl_launch(q),
    )
    return o


# ----------------------------------------------------------------------------------------------------------------------
# dispatch
# ----------------------------------------------------------------------------------------------------------------------


def _use_triton(impl: str, x: torch.Tensor) -> bool:
    if impl not in ("auto", "triton", "torch"):
        raise ValueError(f"unknown GDN decode implementation {impl!r}")
    return impl == "triton" or (impl == "auto" and x.is_cuda and triton is not None)


def gdn_conv_decode(
    qkv: torch.Tensor,
    conv_state: torch.Tensor,
    weight: torch.Tensor,
    slots: torch.Tensor,
    out: Optional[torch.Tensor] = None,
    impl: str = "auto",
) -> torch.Tensor:
    """Causal conv update + SiLU for one token per sequence; updates ``conv_state`` in place.

    ``qkv [B, C]`` (row stride free: may be the first C columns of a wider projection), ``conv_state [S, C, Kc-1]``
    (any dtype; window values are rounded to qkv's dtype, as the eager path does), ``weight [C, Kc]``,
    ``slots [B]`` int. Returns ``y [B, C]`` in qkv's dtype (into ``out`` when given).
    ``impl``: ``auto`` (Triton on CUDA, torch elsewhere) | ``triton`` | ``torch``."""
    fn = gdn_conv_decode_triton if _use_triton(impl, qkv) else gdn_conv_decode_torch
    return fn(qkv, conv_state, weight, slots, out=out)


def gdn_recurrent_decode(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    ssm_state: torch.Tensor,
    slots: torch.Tensor,
    scale: Optional[float] = None,
    out: Optional[torch.Tensor] = None,
    impl: str = "auto",
) -> torch.Tensor:
    """Gating + one delta-rule step per sequence and value head; updates ``ssm_state`` in place.

    ``q, k [B, Hk, dk]`` and ``v [B, Hv, dv]`` (the raw conv outputs, any strides), ``a, b [B, Hv]`` (raw
    projections), ``A_log, dt_bias [Hv]``, ``ssm_state [S, Hv, dk, dv]`` (fp32 by default, bf16/fp16 allowed; math
    is fp32 either way), ``slots [B]`` int, ``scale`` defaults to ``dk**-0.5``. Returns ``o [B, Hv, dv]`` in v's
    dtype (into ``out`` when given). ``impl`` as for ``gdn_conv_decode``."""
    fn = gdn_recurrent_decode_triton if _use_triton(impl, q) else gdn_recurrent_decode_torch
    return fn(q, k, v, a, b, A_log, dt_bias, ssm_state, slots, scale=scale, out=out)
