"""Routed experts for decode-sized steps (a few (token, expert) pairs) as two GEMV kernels, beside the torch
reference they are tested against.

Same weights and ids as ``fused_moe``: ``w13 [S, 2I, H]`` (rows ``[gate | up]``), ``w2 [S, H, I]``, ``topk_ids
[T, k]`` indexing their first dim (expert ids of resident weights, or slot ids of the expert cache; ids outside
``[0, S)`` contribute nothing), ``topk_weights [T, k]`` in any float dtype. Optionally the block's shared expert is
added in the epilogue, gated by ``sigmoid(shared_gate)`` (its logit ``[T, 1]``), either as its output
``shared [T, H]`` or computed here from its ``shared_gate_up [T, 2Is]`` projection and ``shared_down [H, Is]``
weight::

    out[t] = sum_j  w[t, j] * down_e(silu(gate_e x_t) * up_e x_t)      e = ids[t, j]
             (+ sigmoid(shared_gate[t]) * shared[t])       shared[t] = shared_down · silu_and_mul(shared_gate_up[t])

Why not the grouped kernel (``fused_moe_triton``): at decode sizes almost every pair has an expert of its own, so
grouping buys no weight reuse while it pads each pair to a 16-row tensor-core tile, needs two alignment launches,
writes ``[T*k, H]`` fp32 partials and sums them in a third kernel. Here:

- ``gate_up``: one program per (pair, block of I rows), each reading its expert's gate and up rows along H with
  16-byte loads, SiLU-and-mul in the epilogue -> ``inter [T*k, I]``.
- ``down``: one program per (token, block of H rows) holding all k pairs in one ``[rows, k, cols]`` tile (every
  expert's rows load at once), weighting and summing in fp32, plus the shared term -> ``out [T, H]`` in x's dtype.

Block sizes are picked so the grid has about four programs per SM, and the K loops are software-pipelined (loads
run ahead through shared memory): a weight-streaming kernel needs that many bytes in flight per SM to reach HBM
bandwidth. A pair whose expert repeats (two tokens routed to one expert) reads that expert's weights once per pair;
the programs of one weight block are launched next to each other, so the repeat mostly comes from L2. That is why
this path is for small steps only: ``MAX_PAIRS``.

Rounding: the same points as ``fused_moe_torch``'s gather path, i.e. as the layers in torch: gate and up rounded to
x's dtype, the SiLU rounded, the product rounded; the down projection rounded, the routing weight rounded to x's
dtype (what ``SparseMoeBlock`` used to do before the call), their product rounded, the k products summed in fp32
and rounded once; then, as ``out + torch.sigmoid(g) * s``: the sigmoid rounded, its product with the shared output
rounded, the sum rounded (and ``shared`` computed from ``shared_gate_up`` is rounded where ``silu_and_mul`` and the
down GEMV round). Only the order of the fp32 accumulations differs from cuBLAS / torch.

Every size comes from the shapes (H, I, Is and k are compile-time constants) and nothing is read back on the host:
CUDA-graph capturable. ``moe_decode`` runs Triton on CUDA tensors and the reference elsewhere.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from .activation import silu_and_mul_torch
from .device_sms import scaled
from .fused_moe import _moe_gather_torch

try:  # keep the reference importable without triton
    import triton
    import triton.language as tl

    from .pdl import pdl_launch, pdl_wait_then_release
except Exception:  # pragma: no cover
    triton = None
    tl = None

# Up to this many (token, expert) pairs a step takes these kernels (callers check; ``run_experts`` does). 64 pairs is
# batch 8 at top-8: with 256 experts under uniform routing fewer than 1 pair in 10 repeats an expert (57 distinct
# of 64 expected), so per-pair GEMVs read barely more than the grouped GEMM would, and without its padding and
# alignment launches. Past it repeats grow (batch 32: 163 distinct experts for 256 pairs) and the grouped kernel's
# weight reuse wins. It is also where ``fused_moe_torch`` switches to the gather path this file's reference uses.
MAX_PAIRS = 64

# about four programs per SM on the H200's 132 (``device_sms.scaled`` for other GPUs)
_TARGET_PROGRAMS = 512
# weight elements one program loads per matrix per step: 32 per thread at 4 warps, four 16-byte loads of bf16
_TILE = 4096
# the K loops keep two steps of loads in flight ahead of the math
_NUM_STAGES = 3


# ----------------------------------------------------------------------------------------------------------------------
# torch reference
# ----------------------------------------------------------------------------------------------------------------------


def _check_shared(shared, shared_gate, shared_gate_up, shared_down) -> None:
    given_output, given_expert = shared is not None, shared_gate_up is not None or shared_down is not None
    if given_output and given_expert:
        raise ValueError("pass the shared expert's output or its gate_up and down weight, not both")
    if given_expert and (shared_gate_up is None or shared_down is None):
        raise ValueError("the shared expert needs both shared_gate_up and shared_down")
    if (given_output or given_expert) != (shared_gate is not None):
        raise ValueError("shared_gate goes with a shared expert term, and only with one")


def moe_decode_torch(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    shared: Optional[torch.Tensor] = None,
    shared_gate: Optional[torch.Tensor] = None,
    shared_gate_up: Optional[torch.Tensor] = None,
    shared_down: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Reference: ``fused_moe_torch``'s gather path with the weights in x's dtype, then ``out + sigmoid(g) * s`` as
    ``SparseMoeBlock`` adds its shared expert. Fixed shapes, no host reads."""
    _check_shared(shared, shared_gate, shared_gate_up, shared_down)
    T, H = x.shape
    if T == 0:
        return torch.zeros_like(x)
    out = _moe_gather_torch(x, w13, w2, topk_ids, topk_weights.to(x.dtype))
    if shared_gate is None:
        return out
    if shared is None:
        shared = F.linear(silu_and_mul_torch(shared_gate_up), shared_down)
    return out + torch.sigmoid(shared_gate.reshape(T, 1)) * shared


# ----------------------------------------------------------------------------------------------------------------------
# Triton
# ----------------------------------------------------------------------------------------------------------------------

if triton is not None:

    @triton.jit
    def _moe_decode_gate_up_kernel(
        x_ptr,  # [T, H]
        w_ptr,  # [S, 2I, H]
        ids_ptr,  # [T*k]
        inter_ptr,  # [T*k, I]
        num_slots,
        stride_xt,
        stride_we,
        stride_wn,
        H: tl.constexpr,
        I: tl.constexpr,
        TOPK: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
        NUM_STAGES: tl.constexpr,
        PDL: tl.constexpr = False,  # kernels/pdl.py
    ):
        pdl_wait_then_release(PDL)
        dt = inter_ptr.dtype.element_ty
        pair = tl.program_id(0)
        offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        n_mask = offs_n < I
        e = tl.load(ids_ptr + pair)
        h = tl.zeros((BLOCK_N,), dtype=tl.float32)
        if (e >= 0) & (e < num_slots):  # an invalid pair reads no weights and leaves a zero row
            offs_k = tl.arange(0, BLOCK_K)
            x_row = x_ptr + (pair // TOPK).to(tl.int64) * stride_xt
            g_ptrs = w_ptr + e.to(tl.int64) * stride_we + offs_n[:, None].to(tl.int64) * stride_wn + offs_k[None, :]
            u_ptrs = g_ptrs + I * stride_wn
            # 2-D accumulators, reduced once after the loop: no cross-thread reduction per step
            acc_g = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
            acc_u = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
            # software-pipelined (loads run NUM_STAGES - 1 steps ahead through shared memory): the bytes in flight
            # per SM that HBM bandwidth needs
            for k0 in tl.range(0, H, BLOCK_K, num_stages=NUM_STAGES):
                k_mask = (offs_k + k0) < H
                w_mask = n_mask[:, None] & k_mask[None, :]
                xk = tl.load(x_row + k0 + offs_k, mask=k_mask, other=0.0).to(tl.float32)
                g = tl.load(g_ptrs + k0, mask=w_mask, other=0.0)
                u = tl.load(u_ptrs + k0, mask=w_mask, other=0.0)
                acc_g += g.to(tl.float32) * xk[None, :]
                acc_u += u.to(tl.float32) * xk[None, :]
            # the reference's rounding: gate, up, F.silu(gate), and the product each in x's dtype
            gate = tl.sum(acc_g, 1).to(dt).to(tl.float32)
            up = tl.sum(acc_u, 1).to(dt).to(tl.float32)
            act = (gate / (1.0 + tl.exp(-gate))).to(dt).to(tl.float32)
            h = act * up
        tl.store(inter_ptr + pair.to(tl.int64) * I + offs_n, h.to(dt), mask=n_mask)

    @triton.jit
    def _moe_decode_down_kernel(
        inter_ptr,  # [T*k, I]
        w_ptr,  # [S, H, I]
        ids_ptr,  # [T*k]
        wts_ptr,  # [T*k] routing weights, any float dtype
        out_ptr,  # [T, H]
        shared_ptr,  # SHARED 1: the shared expert's output [T, H]; SHARED 2: its gate|up [T, 2*IS]
        shared_down_ptr,  # SHARED 2: [H, IS]
        shared_gate_ptr,  # SHARED 1, 2: the shared expert's gate logit, [T] strided
        num_slots,
        stride_we,
        stride_wn,
        stride_ot,
        stride_st,
        stride_sdn,
        stride_gt,
        H: tl.constexpr,
        I: tl.constexpr,
        IS: tl.constexpr,
        TOPK: tl.constexpr,
        SHARED: tl.constexpr,  # 0: none, 1: output given, 2: computed from gate|up
        BLOCK_N: tl.constexpr,
        BLOCK_J: tl.constexpr,  # TOPK rounded up to a power of two
        BLOCK_K: tl.constexpr,
        BLOCK_KS: tl.constexpr,
        NUM_STAGES: tl.constexpr,
        PDL: tl.constexpr = False,  # kernels/pdl.py
    ):
        pdl_wait_then_release(PDL)
        dt = out_ptr.dtype.element_ty
        t = tl.program_id(0).to(tl.int64)
        offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        n_mask = offs_n < H
        # all k pairs of the token in one [BLOCK_N, BLOCK_J, BLOCK_K] tile: every expert's rows load at once
        offs_j = tl.arange(0, BLOCK_J)
        pairs = t * TOPK + offs_j
        e = tl.load(ids_ptr + pairs, mask=offs_j < TOPK, other=-1)
        valid = (offs_j < TOPK) & (e >= 0) & (e < num_slots)
        e = tl.where(valid, e, 0)
        offs_k = tl.arange(0, BLOCK_K)
        a_ptrs = inter_ptr + pairs[:, None] * I + offs_k[None, :]
        w_ptrs = (
            w_ptr
            + e.to(tl.int64)[None, :, None] * stride_we
            + offs_n[:, None, None].to(tl.int64) * stride_wn
            + offs_k[None, None, :]
        )
        acc = tl.zeros((BLOCK_N, BLOCK_J, BLOCK_K), dtype=tl.float32)
        for k0 in tl.range(0, I, BLOCK_K, num_stages=NUM_STAGES):
            k_mask = ((offs_k[None, :] + k0) < I) & valid[:, None]  # an invalid pair loads nothing
            a = tl.load(a_ptrs + k0, mask=k_mask, other=0.0).to(tl.float32)
            w = tl.load(w_ptrs + k0, mask=n_mask[:, None, None] & k_mask[None, :, :], other=0.0)
            acc += w.to(tl.float32) * a[None, :, :]
        # rounded as the reference: each down projection, the weight (cast to x's dtype), their product; then the
        # k products summed in fp32 and rounded once
        rw = tl.load(wts_ptr + pairs, mask=valid, other=0.0).to(dt).to(tl.float32)
        d = tl.sum(acc, 2).to(dt).to(tl.float32)
        c = (d * rw[None, :]).to(dt).to(tl.float32)
        out = tl.sum(tl.where(valid[None, :], c, 0.0), 1).to(dt).to(tl.float32)
        if SHARED != 0:
            logit = tl.load(shared_gate_ptr + t * stride_gt).to(tl.float32)
            sg = (1.0 / (1.0 + tl.exp(-logit))).to(dt).to(tl.float32)
            if SHARED == 1:
                s = tl.load(shared_ptr + t * stride_st + offs_n, mask=n_mask, other=0.0).to(tl.float32)
            else:
                # the shared expert's down GEMV, its SiLU-and-mul done on the fly (rounded as silu_and_mul does)
                offs_ks = tl.arange(0, BLOCK_KS)
                gu_row = shared_ptr + t * stride_st
                sd_ptrs = shared_down_ptr + offs_n[:, None].to(tl.int64) * stride_sdn + offs_ks[None, :]
                acc_s = tl.zeros((BLOCK_N, BLOCK_KS), dtype=tl.float32)
                for k0 in tl.range(0, IS, BLOCK_KS, num_stages=NUM_STAGES):
                    ks_mask = (offs_ks + k0) < IS
                    g = tl.load(gu_row + k0 + offs_ks, mask=ks_mask, other=0.0).to(tl.float32)
                    u = tl.load(gu_row + IS + k0 + offs_ks, mask=ks_mask, other=0.0).to(tl.float32)
                    act = (g / (1.0 + tl.exp(-g))).to(dt).to(tl.float32)
                    act = (act * u).to(dt).to(tl.float32)
                    w = tl.load(sd_ptrs + k0, mask=n_mask[:, None] & ks_mask[None, :], other=0.0)
                    acc_s += w.to(tl.float32) * act[None, :]
                s = tl.sum(acc_s, 1).to(dt).to(tl.float32)
            out = out + (sg * s).to(dt).to(tl.float32)
        tl.store(out_ptr + t * stride_ot + offs_n, out.to(dt), mask=n_mask)


def _row_block(rows: int, items: int) -> int:
    """Output rows per program: the widest power of two <= 64 that still gives ``items * rows / block`` about
    ``_TARGET_PROGRAMS`` programs, at least 4."""
    bn, target = min(64, max(4, triton.next_power_of_2(rows))), scaled(_TARGET_PROGRAMS)
    while bn > 4 and items * triton.cdiv(rows, bn) < target:
        bn //= 2
    return bn


def _col_block(k_len: int, tile_rows: int) -> int:
    """Columns per step: ``_TILE`` elements per tile of ``tile_rows`` rows, at least 32 (64 bytes of bf16 per row)."""
    return min(triton.next_power_of_2(k_len), max(32, _TILE // tile_rows))


def moe_decode_triton(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    shared: Optional[torch.Tensor] = None,
    shared_gate: Optional[torch.Tensor] = None,
    shared_gate_up: Optional[torch.Tensor] = None,
    shared_down: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Same contract as ``moe_decode_torch``; CUDA, or CPU under TRITON_INTERPRET=1. Rows of ``x``, ``shared``,
    ``shared_gate_up`` and ``shared_gate`` may be strided views (their last dim contiguous)."""
    assert triton is not None, "triton is not installed"
    _check_shared(shared, shared_gate, shared_gate_up, shared_down)
    T, H = x.shape
    out = torch.empty(T, H, dtype=x.dtype, device=x.device)
    if T == 0:
        return out
    x = _last_dim_contiguous(x)
    w13, w2 = _last_dim_contiguous(w13), _last_dim_contiguous(w2)
    ids = topk_ids.reshape(-1).contiguous()
    wts = topk_weights.reshape(-1).contiguous()
    inter = _launch_gate_up(x, w13, ids, topk_ids.shape[1])
    operands = _shared_operands(out, shared, shared_gate, shared_gate_up, shared_down)
    _launch_down(inter, w2, ids, wts, out, topk_ids.shape[1], operands)
    return out


def _last_dim_contiguous(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def _launch_gate_up(x: torch.Tensor, w13: torch.Tensor, ids: torch.Tensor, k: int) -> torch.Tensor:
    """SiLU(gate) * up of every (token, expert) pair: ``[T * k, I]``."""
    H = x.shape[1]
    S, two_i, _ = w13.shape
    I = two_i // 2
    n = ids.numel()
    inter = torch.empty(n, I, dtype=x.dtype, device=x.device)
    bn1 = _row_block(I, n)
    _moe_decode_gate_up_kernel[(n, triton.cdiv(I, bn1))](
        x,
        w13,
        ids,
        inter,
        S,
        x.stride(0),
        w13.stride(0),
        w13.stride(1),
        H=H,
        I=I,
        TOPK=k,
        BLOCK_N=bn1,
        BLOCK_K=_col_block(H, bn1),
        NUM_STAGES=_NUM_STAGES,
        num_warps=4,
        **pdl_launch(x),
    )
    return inter


def _shared_operands(out, shared, shared_gate, shared_gate_up, shared_down) -> dict:
    """The down kernel's shared-expert operands: ``SHARED`` 0 (none), 1 (its output given) or 2 (its gate|up given,
    the down projection done in the epilogue), with strides; ``out`` stands in for operands never read."""
    ops = dict(mode=0, Is=1, stride_st=0, stride_sdn=0, stride_gt=0, src=out, down=out, gate=out)
    if shared_gate is None:
        return ops
    gate = shared_gate.reshape(out.shape[0], -1)
    ops.update(gate=gate, stride_gt=gate.stride(0))
    if shared is not None:
        ops.update(mode=1, src=_last_dim_contiguous(shared))
    else:
        src, down = _last_dim_contiguous(shared_gate_up), _last_dim_contiguous(shared_down)
        assert src.shape[-1] == 2 * down.shape[1] and down.shape[0] == out.shape[1], "shared expert shapes do not match"
        ops.update(mode=2, src=src, down=down, Is=down.shape[1], stride_sdn=down.stride(0))
    ops["stride_st"] = ops["src"].stride(0)
    return ops


def _launch_down(inter, w2, ids, wts, out, k: int, ops: dict) -> None:
    """The down projections of every token's experts, weighted and summed (plus the shared expert) into ``out``."""
    T, H = out.shape
    S, I = w2.shape[0], inter.shape[1]
    bn2 = _row_block(H, T)
    bj = triton.next_power_of_2(k)
    _moe_decode_down_kernel[(T, triton.cdiv(H, bn2))](
        inter,
        w2,
        ids,
        wts,
        out,
        ops["src"],
        ops["down"],
        ops["gate"],
        S,
        w2.stride(0),
        w2.stride(1),
        out.stride(0),
        ops["stride_st"],
        ops["stride_sdn"],
        ops["stride_gt"],
        H=H,
        I=I,
        IS=ops["Is"],
        TOPK=k,
        SHARED=ops["mode"],
        BLOCK_N=bn2,
        BLOCK_J=bj,
        BLOCK_K=_col_block(I, bn2 * bj),
        BLOCK_KS=_col_block(ops["Is"], bn2),
        NUM_STAGES=_NUM_STAGES,
        num_warps=4,
        **pdl_launch(inter),
    )


def moe_decode(
    x, w13, w2, topk_ids, topk_weights, shared=None, shared_gate=None, shared_gate_up=None, shared_down=None
) -> torch.Tensor:
    """Triton on CUDA tensors, the torch reference elsewhere."""
    fn = moe_decode_triton if x.is_cuda and triton is not None else moe_decode_torch
    return fn(x, w13, w2, topk_ids, topk_weights, shared, shared_gate, shared_gate_up, shared_down)
