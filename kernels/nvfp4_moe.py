"""Grouped MoE over an NVFP4 expert bank (layout: ``layers/nvfp4_experts.py``): the torch reference and the Triton
kernels it is tested against.

The bank, six tensors whose leading dim ``S`` indexes experts (a resident layer: ``S = E``) or slots (an expert cache
in the same layout: ``topk_ids`` are then slot ids, as for the BF16 decode kernel)::

    w13 uint8 [S, 2I, H/2]   w13_scale e4m3 [S, 2I, H/16]   w13_global fp32 [S, 2I]      rows [gate(I) | up(I)]
    w2  uint8 [S, H, I/2]    w2_scale  e4m3 [S, H, I/16]    w2_global  fp32 [S, H]

    out[t] = sum_j w[t, j] * down_e(silu(gate_e x_t) * up_e x_t),  e = topk_ids[t, j]; ids outside [0, S) add nothing

- ``nvfp4_moe_torch``: the reference. It dequantizes only the experts the step routes to (to x's dtype, ModelOpt's
  dequantization) and runs ``fused_moe_torch`` on them, with the ids remapped into the gathered copy, so its result
  equals ``fused_moe_torch`` over the whole bank dequantized. A decode-sized step gathers one copy per (token,
  expert) pair (fixed shapes, no host sync); larger steps dequantize each expert hit once.
- ``nvfp4_moe_decode_triton`` (steps of at most ``DECODE_MAX_PAIRS`` pairs; modelled on ``moe_decode.py``): two GEMV
  kernels on the packed bytes (``nvfp4_tiles.py``: words of 8 codes decoded two weights per 32-bit operation).
  ``gate_up``: one program per (pair, block of I rows) reading its expert's gate and up rows, the per-row global
  scales and SiLU-and-mul in the epilogue -> ``inter [T*k, I]``. ``down``: one program per (token, block of H rows)
  taking the k pairs as one more axis of its weight tile (``_routed_down_tiled``: one load, one reduction for all of
  them), weighting and summing in fp32, the shared expert's gated output added in the epilogue -> ``out [T, H]``
  (``tile_pairs=False`` runs the pairs one after another, ``_routed_down_serial``, measured slower:
  ``decode_config``). A pair whose id is outside the bank reads nothing (its loads are masked off): CUDA-graph padding
  rows and the offload slot cache's misses cost no bandwidth. The shared expert comes as its output, or
  (``shared_down_nvfp4``, an NVFP4 checkpoint's shared expert) as its gate|up projection ``[T, 2Is]`` and NVFP4 down
  weight ``[H, Is]``: the epilogue then runs its SiLU-and-mul and down GEMV for the program's rows (the same word
  decoding), which saves the block the two launches per layer of a separate ``silu_and_mul`` and ``Nvfp4Linear``; it
  rounds where those two do (the SiLU, its product with up, the GEMV's output after its global scale).
- ``nvfp4_fused_moe_triton`` (mid-sized steps; modelled on ``fused_moe.py``; from ``DEQUANT_MIN_PAIRS`` pairs
  ``layers/nvfp4_experts`` dequantizes the bank instead, ``nvfp4_dequant.py``): the pairs sorted by expert and padded
  to the block size (``moe_align_block_size``; ids outside the bank go to a dummy expert whose blocks write zeros),
  then two grouped tensor-core GEMMs, each K step decoding a ``[BLOCK_N, BLOCK_K]`` weight tile to x's dtype in
  registers as the left operand of ``tl.dot`` (``nvfp4_linear.py`` says why: no BF16 copy of the experts, one launch
  each); for large steps the gate and up rows of a block are decoded as one tile (``FUSE_GU``; launch settings in
  ``grouped_config``).

Rounding follows ``moe_decode``: gate and up rounded to x's dtype, the SiLU rounded, the product rounded; each down
projection rounded, times the routing weight rounded to x's dtype; the k terms summed in fp32 and rounded once (the
grouped path leaves the weighted product in fp32, as ``moe_combine`` does for BF16 experts; the torch reference
rounds it before the sum: within the tests' tolerance). The per-row global scale multiplies the fp32 sum before
that first rounding (``e2m1 * block scale`` is exact in every dtype; the reference instead rounds each weight after
the global scale). Everything is sized from the shapes and nothing is read back on the host: CUDA-graph capturable.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from ..quant import nvfp4
from ..tuning_env import choice_from_env, int_from_env, with_overrides
from .activation import silu_and_mul_torch
from .device_sms import scaled
from .fused_moe import _GATHER_PAIRS, _moe_gather_torch, fused_moe_torch
from .moe_combine import moe_combine_triton

try:  # keep the reference importable without triton
    import triton
    import triton.language as tl

    from .fused_moe import _block_rows, _no_tail_rows, _tail_rows, moe_align_block_size
    from .nvfp4_half_gemv import half2_dot8, half_decode, half_pairs, half_row, half_rows
    from .nvfp4_tiles import (
        TL_DTYPES,
        block_scale,
        gemv_step,
        gemv_step_split,
        load8,
        pair_tile_step,
        tile_decode,
    )
    from .pdl import pdl_launch, pdl_wait_then_release
except Exception:  # pragma: no cover
    triton = None
    tl = None

# Up to this many (token, expert) pairs a step takes the decode GEMVs (one program per pair): 32 decode streams of a
# top-8 model, four times the BF16 path's cut (``moe_decode.MAX_PAIRS``). Measured on the H200 at Qwen3.6's expert
# shapes (bench/nvfp4_kernel_bench.py --groups moe; bench/results/2026-12-02-h200-nvfp4-moe-decode-cut.txt): at 16
# to 32 tokens the GEMVs ran 1.5-1.9x faster than the grouped tensor-core kernel under uniform routing (32 tokens:
# 211 vs 314 us a layer; Zipf: even at 32), from 48-64 tokens the grouped kernel's weight reuse wins. A BF16 expert
# costs bytes, so reading a repeated expert twice loses early; an NVFP4 expert costs decode work, which the grouped
# kernel's tensor-core tiles do at about half the GEMV's rate. (Sorting the pairs by expert, so that each expert is
# decoded once for its 1-4 tokens, ran slower still: the repeats come from L2.) ``FREETOKEN_NVFP4_DECODE_MAX_PAIRS``
# moves the cut (A/B runs).
DECODE_MAX_PAIRS = int_from_env("FREETOKEN_NVFP4_DECODE_MAX_PAIRS", 256)

# The down kernel's pairs as a tile axis (``decode_config``); ``FREETOKEN_NVFP4_DECODE_DOWN=serial`` runs them one
# after another (A/B runs of a whole model).
DECODE_DOWN = choice_from_env("FREETOKEN_NVFP4_DECODE_DOWN", "tiled", ("tiled", "serial"))

# From this many pairs (16-bit x) the gate|up decode GEMV runs in packed half precision (``nvfp4_half_gemv``: about
# 40 % fewer instructions a weight, one extra launch packing x): the batched steps, where the kernel is bound by its
# instructions. ``FREETOKEN_NVFP4_HALF_GATE_UP_MIN_PAIRS`` moves the cut (A/B runs).
HALF_GATE_UP_MIN_PAIRS = int_from_env("FREETOKEN_NVFP4_HALF_GATE_UP_MIN_PAIRS", 64)

# The same for the down decode GEMV (its activations: the pairs' SiLU(gate)·up rows, packed by one more launch);
# ``FREETOKEN_NVFP4_HALF_DOWN_MIN_PAIRS`` moves the cut (A/B runs).
HALF_DOWN_MIN_PAIRS = int_from_env("FREETOKEN_NVFP4_HALF_DOWN_MIN_PAIRS", 64)

_TARGET_PROGRAMS = 528  # about four programs per SM on the H200's 132 (``device_sms.scaled`` for other GPUs)
_NUM_STAGES = 3


# ----------------------------------------------------------------------------------------------------------------------
# torch reference
# ----------------------------------------------------------------------------------------------------------------------


def dequantize_experts(packed, scale, glob, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Experts ``ids`` of one bank part -> ``[len(ids), N, K]`` in ``dtype``."""
    return nvfp4.dequantize(packed[ids], scale[ids], glob[ids], dtype)


def nvfp4_moe_torch(x, w13, w13_scale, w13_global, w2, w2_scale, w2_global, topk_ids, topk_weights):
    """Same contract as ``fused_moe_torch``; ``topk_ids`` index the bank's experts (ids outside it add nothing)."""
    T, k = topk_ids.shape
    E = w13.shape[0]
    ids = topk_ids.reshape(-1).to(torch.int64)
    valid = (ids >= 0) & (ids < E)
    # inside a CUDA-graph capture always gather: the loop's torch.unique would sync the host
    gather = T * k <= _GATHER_PAIRS or (x.is_cuda and torch.cuda.is_current_stream_capturing())
    if gather:
        take = ids.clamp(0, E - 1)  # one copy per pair
        local = torch.where(valid, torch.arange(T * k, device=ids.device), -1).view(T, k)
    else:
        take = torch.unique(ids[valid])  # sorted: the loop visits experts in the order it would over the bank
        remap = torch.full((E,), -1, dtype=torch.int64, device=ids.device)
        remap[take] = torch.arange(take.numel(), device=ids.device)
        local = torch.where(valid, remap[ids.clamp(0, E - 1)], -1).view(T, k)
    g13 = dequantize_experts(w13, w13_scale, w13_global, take, x.dtype)
    g2 = dequantize_experts(w2, w2_scale, w2_global, take, x.dtype)
    if gather:
        return _moe_gather_torch(x, g13, g2, local, topk_weights)
    return fused_moe_torch(x, g13, g2, local, topk_weights)


# ----------------------------------------------------------------------------------------------------------------------
# Triton: decode GEMVs
# ----------------------------------------------------------------------------------------------------------------------

if triton is not None:

    @triton.jit
    def _nvfp4_decode_gate_up_kernel(
        x_ptr,  # [T, H]
        w_ptr,  # int32 words [S, 2I, H/8]
        s_ptr,  # uint8 e4m3 bits [S, 2I, H/16]
        g_ptr,  # fp32 [S, 2I]
        ids_ptr,  # [T*k]
        inter_ptr,  # fp32 [T*k, 8, I/8]: column n at [n % 8, n // 8] (the down kernel's split activations); [T*k, I]
        # in column order with INTER_ROWS (what ``half_pairs`` packs for the down kernel's HALF)
        xp_ptr,  # HALF: x's fp16 pairs, int32 [T, 8, H/16] (``nvfp4_half_gemv.half_pairs``)
        xf_ptr,  # HALF: fp32 [T], 2^-s of each token's scale
        num_slots,
        stride_xt,
        stride_pt,
        stride_we,
        stride_wn,
        stride_se,
        stride_sn,
        stride_ge,
        H: tl.constexpr,
        I: tl.constexpr,
        TOPK: tl.constexpr,
        EVEN: tl.constexpr,  # I a multiple of BLOCK_N and H of 8 * BLOCK_W: no masks
        BLOCK_N: tl.constexpr,
        BLOCK_W: tl.constexpr,
        NUM_STAGES: tl.constexpr,
        HALF: tl.constexpr,  # the packed-half GEMV (``nvfp4_half_gemv``): x as fp16 pairs, f16x2 multiply-adds
        ASM: tl.constexpr,  # HALF: its inline PTX (CUDA) or the interpreter's emulation
        INTER_ROWS: tl.constexpr,  # the intermediate in column order (the down kernel's HALF packs it)
        PDL: tl.constexpr = False,  # kernels/pdl.py
    ):
        pdl_wait_then_release(PDL)
        dt = x_ptr.dtype.element_ty
        NB: tl.constexpr = BLOCK_W // 2
        pair = tl.program_id(0)
        offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        n_mask = offs_n < I
        e = tl.load(ids_ptr + pair)
        h = tl.zeros((BLOCK_N,), dtype=tl.float32)
        if (e >= 0) & (e < num_slots):  # an invalid pair reads no weights and leaves a zero row
            e64 = e.to(tl.int64)
            offs_w = tl.arange(0, BLOCK_W)
            offs_s = tl.arange(0, NB)
            offs_x = tl.arange(0, 8 * BLOCK_W)
            x_row = x_ptr + (pair // TOPK).to(tl.int64) * stride_xt
            rows = offs_n[:, None].to(tl.int64)
            gw = w_ptr + e64 * stride_we + rows * stride_wn + offs_w[None, :]
            gs = s_ptr + e64 * stride_se + rows * stride_sn + offs_s[None, :]
            acc_g = tl.zeros((BLOCK_N, NB), dtype=tl.float32)
            acc_u = tl.zeros((BLOCK_N, NB), dtype=tl.float32)
            token = pair // TOPK
            for kw0 in tl.range(0, H // 8, BLOCK_W, num_stages=NUM_STAGES):
                if EVEN:
                    if not HALF:
                        xk = tl.load(x_row + 8 * kw0 + offs_x)
                    wg, sg = tl.load(gw + kw0), tl.load(gs + kw0 // 2)
                    wu, su = tl.load(gw + I * stride_wn + kw0), tl.load(gs + I * stride_sn + kw0 // 2)
                    b_mask = offs_s >= 0
                else:
                    if not HALF:
                        xk = tl.load(x_row + 8 * kw0 + offs_x, mask=(8 * kw0 + offs_x) < H, other=0.0)
                    w_mask = n_mask[:, None] & ((kw0 + offs_w) < H // 8)[None, :]
                    b_mask = (kw0 // 2 + offs_s) < H // 16
                    s_mask = n_mask[:, None] & b_mask[None, :]
                    wg = tl.load(gw + kw0, mask=w_mask, other=0)
                    sg = tl.load(gs + kw0 // 2, mask=s_mask, other=0)
                    wu = tl.load(gw + I * stride_wn + kw0, mask=w_mask, other=0)
                    su = tl.load(gs + I * stride_sn + kw0 // 2, mask=s_mask, other=0)
                if HALF:  # gate and up read the same pairs of x
                    g0, g1, g2, g3, g4, g5, g6, g7 = half_decode(wg, BLOCK_N, NB)
                    acc_g += half_row(
                        g0, g1, g2, g3, g4, g5, g6, g7, block_scale(sg), xp_ptr, token, token + 1, stride_pt,
                        H // 16, kw0 // 2, b_mask, NB, ASM,
                    )  # fmt: skip
                    u0, u1, u2, u3, u4, u5, u6, u7 = half_decode(wu, BLOCK_N, NB)
                    acc_u += half_row(
                        u0, u1, u2, u3, u4, u5, u6, u7, block_scale(su), xp_ptr, token, token + 1, stride_pt,
                        H // 16, kw0 // 2, b_mask, NB, ASM,
                    )  # fmt: skip
                else:
                    acc_g += gemv_step(wg, sg, xk, BLOCK_N, BLOCK_W)
                    acc_u += gemv_step(wu, su, xk, BLOCK_N, BLOCK_W)
            glob = g_ptr + e64 * stride_ge + offs_n
            if HALF:  # undo the token's power-of-two scale
                xf = tl.load(xf_ptr + token + offs_n * 0)
                acc_g = acc_g * xf[:, None]
                acc_u = acc_u * xf[:, None]
            # the reference's rounding: gate, up, F.silu(gate), and the product each in x's dtype
            gate = (tl.sum(acc_g, 1) * tl.load(glob, mask=n_mask, other=0.0)).to(dt).to(tl.float32)
            up = (tl.sum(acc_u, 1) * tl.load(glob + I, mask=n_mask, other=0.0)).to(dt).to(tl.float32)
            act = (gate / (1.0 + tl.exp(-gate))).to(dt).to(tl.float32)
            h = (act * up).to(dt).to(tl.float32)
        # fp32 (the value rounded to x's dtype) in the order the down kernel's words need: no conversion there
        if INTER_ROWS:
            tl.store(inter_ptr + pair.to(tl.int64) * I + offs_n, h, mask=n_mask)
        else:
            tl.store(inter_ptr + pair.to(tl.int64) * I + (offs_n % 8) * (I // 8) + offs_n // 8, h, mask=n_mask)

    @triton.jit
    def _in_bank(offs, e, num_slots):
        """``e`` in ``[0, num_slots)``, broadcast over ``offs`` (a scalar predicate in a tensor mask trips the CPU
        interpreter; ``offs * 0`` folds away on the GPU)."""
        ev = offs * 0 + e
        return (ev >= 0) & (ev < num_slots)

    @triton.jit
    def _nvfp4_shared_down(
        gu_row, w_ptr, s_ptr, g_ptr, stride_w, stride_s, stride_g, offs_n, n_mask,
        DT: tl.constexpr, IS: tl.constexpr, EVEN_S: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_WS: tl.constexpr,
        NUM_STAGES: tl.constexpr,
    ):  # fmt: skip
        """Rows ``offs_n`` of the shared expert's output for one token: its NVFP4 down GEMV over
        ``silu_and_mul(gate|up)`` (``gu_row [2 * IS]``), rounded where the separate launches round (the SiLU, its
        product with up, the GEMV's output: ``silu_and_mul`` and ``Nvfp4Linear``), in fp32."""
        NBS: tl.constexpr = BLOCK_WS // 2
        offs_w = tl.arange(0, BLOCK_WS)
        offs_s = tl.arange(0, NBS)
        offs_x = tl.arange(0, 8 * BLOCK_WS)
        rows = offs_n[:, None].to(tl.int64)
        w_rows = w_ptr + rows * stride_w + offs_w[None, :]
        s_rows = s_ptr + rows * stride_s + offs_s[None, :]
        acc = tl.zeros((BLOCK_N, NBS), dtype=tl.float32)
        for kw0 in tl.range(0, IS // 8, BLOCK_WS, num_stages=NUM_STAGES):
            if EVEN_S:
                g = tl.load(gu_row + 8 * kw0 + offs_x).to(tl.float32)
                u = tl.load(gu_row + IS + 8 * kw0 + offs_x).to(tl.float32)
                w = tl.load(w_rows + kw0)
                s = tl.load(s_rows + kw0 // 2)
            else:
                x_mask = (8 * kw0 + offs_x) < IS
                g = tl.load(gu_row + 8 * kw0 + offs_x, mask=x_mask, other=0.0).to(tl.float32)
                u = tl.load(gu_row + IS + 8 * kw0 + offs_x, mask=x_mask, other=0.0).to(tl.float32)
                w = tl.load(w_rows + kw0, mask=n_mask[:, None] & ((kw0 + offs_w) < IS // 8)[None, :], other=0)
                s = tl.load(
                    s_rows + kw0 // 2, mask=n_mask[:, None] & ((kw0 // 2 + offs_s) < IS // 16)[None, :], other=0
                )
            # SiLU-and-mul recomputed by each program of the token (2 * IS values: cheaper than a launch)
            act = (g / (1.0 + tl.exp(-g))).to(DT).to(tl.float32)
            act = (act * u).to(DT).to(tl.float32)
            acc += gemv_step(w, s, act, BLOCK_N, BLOCK_WS)
        glob = tl.load(g_ptr + offs_n * stride_g, mask=n_mask, other=0.0)
        return (tl.sum(acc, 1) * glob).to(DT).to(tl.float32)

    @triton.jit
    def _routed_down_serial(
        inter_ptr, w_ptr, s_ptr, g_ptr, ids_ptr, wts_ptr, t, offs_n, n_mask, num_slots,
        stride_we, stride_wn, stride_se, stride_sn, stride_ge, DT: tl.constexpr,
        I: tl.constexpr, TOPK: tl.constexpr, EVEN: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_W: tl.constexpr,
        NUM_STAGES: tl.constexpr,
    ):  # fmt: skip
        """Token ``t``'s weighted sum of its k down projections for rows ``offs_n`` (fp32, the sum of the rounded
        terms), the pairs one after another: a ``[BLOCK_N, BLOCK_W]`` tile and a reduction each."""
        NB: tl.constexpr = BLOCK_W // 2
        offs_w = tl.arange(0, BLOCK_W)
        offs_s = tl.arange(0, NB)
        rows = offs_n[:, None].to(tl.int64)
        out = tl.zeros((BLOCK_N,), dtype=tl.float32)
        for j in tl.static_range(TOPK):  # unrolled: every pair's loads can be in flight at once
            pair = t * TOPK + j
            e = tl.load(ids_ptr + pair)
            valid = _in_bank(offs_n, e, num_slots)  # [BLOCK_N]
            valid_w = _in_bank(offs_w, e, num_slots)
            e64 = tl.where((e >= 0) & (e < num_slots), e, 0).to(tl.int64)
            w_rows = w_ptr + e64 * stride_we + rows * stride_wn + offs_w[None, :]
            s_rows = s_ptr + e64 * stride_se + rows * stride_sn + offs_s[None, :]
            a_row = inter_ptr + pair * I + offs_w
            acc = tl.zeros((BLOCK_N, NB), dtype=tl.float32)
            for kw0 in tl.range(0, I // 8, BLOCK_W, num_stages=NUM_STAGES):
                # an invalid pair's loads are predicated off: no bandwidth
                if EVEN:
                    a_mask = valid_w
                    w = tl.load(w_rows + kw0, mask=valid[:, None], other=0)
                    s = tl.load(s_rows + kw0 // 2, mask=valid[:, None], other=0)
                else:
                    a_mask = ((kw0 + offs_w) < I // 8) & valid_w
                    w_mask = (n_mask & valid)[:, None] & ((kw0 + offs_w) < I // 8)[None, :]
                    s_mask = (n_mask & valid)[:, None] & ((kw0 // 2 + offs_s) < I // 16)[None, :]
                    w = tl.load(w_rows + kw0, mask=w_mask, other=0)
                    s = tl.load(s_rows + kw0 // 2, mask=s_mask, other=0)
                acc += gemv_step_split(w, s, a_row + kw0, I // 8, a_mask, BLOCK_N, BLOCK_W)
            glob = tl.load(g_ptr + e64 * stride_ge + offs_n, mask=n_mask & valid, other=0.0)
            # rounded as the reference: the down projection, the weight (in x's dtype), their product
            d = (tl.sum(acc, 1) * glob).to(DT).to(tl.float32)
            rw = tl.load(wts_ptr + pair).to(DT).to(tl.float32)
            out += tl.where(valid, (d * rw).to(DT).to(tl.float32), 0.0)
        return out

    @triton.jit
    def _half_pair_tile_step(w, s, xq, valid, kb0, KB, EVEN: tl.constexpr, KP: tl.constexpr, ROWS: tl.constexpr,
                             NB: tl.constexpr, ASM: tl.constexpr):  # fmt: skip
        """``pair_tile_step`` in packed half precision: words ``w [KP, ROWS, 2 * NB]``, scale bytes ``s [KP, ROWS,
        NB]``, each pair's fp16 activation pairs at ``xq [KP, NB]`` (position q ``KB`` words further; blocks from
        ``kb0``, zeros for invalid pairs or past ``KB``) -> the ``[KP, ROWS, NB]`` scaled block sums."""
        d0, d1, d2, d3, d4, d5, d6, d7 = half_decode(tl.reshape(w, (KP * ROWS, 2 * NB)), KP * ROWS, NB)
        if EVEN:
            x_mask = valid[:, None]
        else:
            x_mask = valid[:, None] & ((kb0 + tl.arange(0, NB)) < KB)[None, :]
        x0, x1, x2, x3, x4, x5, x6, x7 = load8(xq, KB, x_mask)
        d = half2_dot8(
            tl.reshape(d0, (KP, ROWS, NB)), tl.reshape(d1, (KP, ROWS, NB)), tl.reshape(d2, (KP, ROWS, NB)),
            tl.reshape(d3, (KP, ROWS, NB)), tl.reshape(d4, (KP, ROWS, NB)), tl.reshape(d5, (KP, ROWS, NB)),
            tl.reshape(d6, (KP, ROWS, NB)), tl.reshape(d7, (KP, ROWS, NB)),
            x0[:, None, :], x1[:, None, :], x2[:, None, :], x3[:, None, :],
            x4[:, None, :], x5[:, None, :], x6[:, None, :], x7[:, None, :],
            ASM,
        )  # fmt: skip
        return d * block_scale(s)

    @triton.jit
    def _routed_down_tiled(
        inter_ptr, w_ptr, s_ptr, g_ptr, ids_ptr, wts_ptr, xp_ptr, xf_ptr, t, offs_n, n_mask, num_slots,
        stride_we, stride_wn, stride_se, stride_sn, stride_ge, stride_pt, DT: tl.constexpr,
        I: tl.constexpr, TOPK: tl.constexpr, KP: tl.constexpr, EVEN: tl.constexpr, BLOCK_N: tl.constexpr,
        BLOCK_W: tl.constexpr, NUM_STAGES: tl.constexpr, HALF: tl.constexpr, ASM: tl.constexpr,
    ):  # fmt: skip
        """``_routed_down_serial`` with the k pairs as one more tile axis (``KP``: k rounded up to a power of two):
        a ``[KP, BLOCK_N, BLOCK_W]`` tile a step, one reduction over the words for all the pairs and one over the
        pairs (summed as a tree, not in pair order: equal up to fp32 rounding). ``HALF``: in packed half precision
        (``nvfp4_half_gemv``), each pair's activations as fp16 pairs (``xp_ptr``, ``half_pairs`` of the
        intermediate) scaled by a power of two that ``xf_ptr`` undoes."""
        NB: tl.constexpr = BLOCK_W // 2
        offs_j = tl.arange(0, KP)
        pairs = t * TOPK + offs_j
        e = tl.load(ids_ptr + pairs, mask=offs_j < TOPK, other=-1)
        valid = (offs_j < TOPK) & (e >= 0) & (e < num_slots)  # [KP]; an invalid pair's loads are predicated off
        e64 = tl.where(valid, e, 0).to(tl.int64)
        offs_w = tl.arange(0, BLOCK_W)
        offs_s = tl.arange(0, NB)
        rows = offs_n.to(tl.int64)
        rmask = valid[:, None] & n_mask[None, :]  # [KP, BLOCK_N]
        w_base = w_ptr + (e64 * stride_we)[:, None, None] + (rows * stride_wn)[None, :, None] + offs_w[None, None, :]
        s_base = s_ptr + (e64 * stride_se)[:, None, None] + (rows * stride_sn)[None, :, None] + offs_s[None, None, :]
        x_base = inter_ptr + pairs.to(tl.int64)[:, None] * I + offs_w[None, :]  # [KP, BLOCK_W]; position p: + p * I/8
        xp_base = xp_ptr + pairs.to(tl.int64)[:, None] * stride_pt + offs_s[None, :]  # HALF: [KP, NB]; + q * I/16
        acc = tl.zeros((KP, BLOCK_N, NB), dtype=tl.float32)
        for kw0 in tl.range(0, I // 8, BLOCK_W, num_stages=NUM_STAGES):
            if EVEN:
                w_mask = rmask[:, :, None]
                s_mask = rmask[:, :, None]
                x_mask = valid[:, None]
            else:
                in_k = (kw0 + offs_w) < I // 8
                w_mask = rmask[:, :, None] & in_k[None, None, :]
                s_mask = rmask[:, :, None] & ((kw0 // 2 + offs_s) < I // 16)[None, None, :]
                x_mask = valid[:, None] & in_k[None, :]
            w = tl.load(w_base + kw0, mask=w_mask, other=0)
            s = tl.load(s_base + kw0 // 2, mask=s_mask, other=0)
            if HALF:
                acc += _half_pair_tile_step(
                    w, s, xp_base + kw0 // 2, valid, kw0 // 2, I // 16, EVEN, KP, BLOCK_N, NB, ASM
                )
            else:
                xp = x_base + kw0
                acc += pair_tile_step(
                    w, s,
                    tl.load(xp, mask=x_mask, other=0.0)[:, None, :],
                    tl.load(xp + I // 8, mask=x_mask, other=0.0)[:, None, :],
                    tl.load(xp + 2 * (I // 8), mask=x_mask, other=0.0)[:, None, :],
                    tl.load(xp + 3 * (I // 8), mask=x_mask, other=0.0)[:, None, :],
                    tl.load(xp + 4 * (I // 8), mask=x_mask, other=0.0)[:, None, :],
                    tl.load(xp + 5 * (I // 8), mask=x_mask, other=0.0)[:, None, :],
                    tl.load(xp + 6 * (I // 8), mask=x_mask, other=0.0)[:, None, :],
                    tl.load(xp + 7 * (I // 8), mask=x_mask, other=0.0)[:, None, :],
                    KP, BLOCK_N, BLOCK_W,
                )  # fmt: skip
        glob = tl.load(g_ptr + (e64 * stride_ge)[:, None] + rows[None, :], mask=rmask, other=0.0)
        if HALF:  # undo each pair's power-of-two scale
            glob = glob * tl.load(xf_ptr + pairs, mask=valid, other=0.0)[:, None]
        # rounded as the reference: the down projection, the weight (in x's dtype), their product
        d = (tl.sum(acc, 2) * glob).to(DT).to(tl.float32)
        rw = tl.load(wts_ptr + pairs, mask=valid, other=0.0).to(DT).to(tl.float32)
        return tl.sum(tl.where(rmask, (d * rw[:, None]).to(DT).to(tl.float32), 0.0), 0)

    @triton.jit
    def _nvfp4_decode_down_kernel(
        inter_ptr,  # fp32 [T*k, 8, I/8], from the gate_up kernel
        w_ptr,  # int32 words [S, H, I/8]
        s_ptr,  # uint8 e4m3 bits [S, H, I/16]
        g_ptr,  # fp32 [S, H]
        ids_ptr,  # [T*k]
        wts_ptr,  # [T*k] routing weights, any float dtype
        out_ptr,  # [T, H]
        shared_ptr,  # SHARED 1: the shared expert's output [T, H]; SHARED 2: its gate|up [T, 2 * IS]
        sd_w_ptr,  # SHARED 2: the shared expert's NVFP4 down projection, int32 words [H, IS/8]
        sd_s_ptr,  # SHARED 2: its block scale bytes [H, IS/16]
        sd_g_ptr,  # SHARED 2: its global scale, fp32 [H] (stride_sdg 0: one for all rows)
        shared_gate_ptr,  # SHARED 1, 2: its gate logit, [T] strided
        xp_ptr,  # HALF: the intermediate's fp16 pairs, int32 [T*k, 8, I/16] (``half_pairs``)
        xf_ptr,  # HALF: fp32 [T*k], 2^-s of each pair's scale
        num_slots,
        stride_we,
        stride_wn,
        stride_se,
        stride_sn,
        stride_ge,
        stride_ot,
        stride_st,
        stride_sdw,
        stride_sds,
        stride_sdg,
        stride_gt,
        stride_pt,
        H: tl.constexpr,
        I: tl.constexpr,
        IS: tl.constexpr,
        TOPK: tl.constexpr,
        KP: tl.constexpr,  # TOPK rounded up to a power of two (TILE_PAIRS)
        TILE_PAIRS: tl.constexpr,  # the pairs as one tile axis (_routed_down_tiled) or one after another
        SHARED: tl.constexpr,  # 0: none, 1: output given, 2: computed from gate|up and the NVFP4 down weight
        EVEN: tl.constexpr,  # H a multiple of BLOCK_N and I of 8 * BLOCK_W: no masks
        EVEN_S: tl.constexpr,  # H a multiple of BLOCK_N and IS of 8 * BLOCK_WS: no masks in the shared GEMV
        BLOCK_N: tl.constexpr,
        BLOCK_W: tl.constexpr,
        BLOCK_WS: tl.constexpr,  # words of a shared down row per step
        NUM_STAGES: tl.constexpr,
        HALF: tl.constexpr,  # TILE_PAIRS in packed half precision (``_half_pair_tile_step``)
        ASM: tl.constexpr,  # HALF: its inline PTX (CUDA) or the interpreter's emulation
        PDL: tl.constexpr = False,  # kernels/pdl.py
    ):
        pdl_wait_then_release(PDL)
        dt = out_ptr.dtype.element_ty
        t = tl.program_id(0).to(tl.int64)
        offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        n_mask = offs_n < H
        if TILE_PAIRS:
            out = _routed_down_tiled(
                inter_ptr, w_ptr, s_ptr, g_ptr, ids_ptr, wts_ptr, xp_ptr, xf_ptr, t, offs_n, n_mask, num_slots,
                stride_we, stride_wn, stride_se, stride_sn, stride_ge, stride_pt, dt, I, TOPK, KP, EVEN, BLOCK_N,
                BLOCK_W, NUM_STAGES, HALF, ASM,
            )  # fmt: skip
        else:
            out = _routed_down_serial(
                inter_ptr, w_ptr, s_ptr, g_ptr, ids_ptr, wts_ptr, t, offs_n, n_mask, num_slots,
                stride_we, stride_wn, stride_se, stride_sn, stride_ge, dt, I, TOPK, EVEN, BLOCK_N, BLOCK_W,
                NUM_STAGES,
            )  # fmt: skip
        out = out.to(dt).to(tl.float32)
        if SHARED != 0:  # as ``out + torch.sigmoid(g) * s``: each step rounded
            logit = tl.load(shared_gate_ptr + t * stride_gt).to(tl.float32)
            sg = (1.0 / (1.0 + tl.exp(-logit))).to(dt).to(tl.float32)
            if SHARED == 1:
                s = tl.load(shared_ptr + t * stride_st + offs_n, mask=n_mask, other=0.0).to(tl.float32)
            else:
                s = _nvfp4_shared_down(
                    shared_ptr + t * stride_st, sd_w_ptr, sd_s_ptr, sd_g_ptr, stride_sdw, stride_sds, stride_sdg,
                    offs_n, n_mask, dt, IS, EVEN_S, BLOCK_N, BLOCK_WS, NUM_STAGES,
                )  # fmt: skip
            out = out + (sg * s).to(dt).to(tl.float32)
        tl.store(out_ptr + t * stride_ot + offs_n, out.to(dt), mask=n_mask)


def _decode_blocks(rows: int, items: int, k_len: int) -> tuple[int, int]:
    """``(BLOCK_N, BLOCK_W)``: up to 64 words (512 weights) of a row per step and about ``_TARGET_PROGRAMS``
    programs (``items`` programs per block of rows), 4..32 rows each."""
    bw = max(4, min(64, triton.next_power_of_2(k_len // 8)))
    bn, target = 32, scaled(_TARGET_PROGRAMS)
    while bn > 4 and items * triton.cdiv(rows, bn) < target:
        bn //= 2
    return bn, bw


def decode_config(T: int, k: int, H: int, I: int, tune: Optional[dict] = None) -> dict:
    """Launch settings of the two decode GEMVs for ``T`` tokens at top-``k``: rows per program and words per step
    of each (``_decode_blocks``), warps, pipeline stages, whether the down kernel takes the pairs as a tile
    axis (``tile_pairs``), and whether gate|up and down run in packed half precision (``gu_half``, ``down_half``:
    16-bit x only; the down kernel's only with ``tile_pairs``); ``tune`` overrides any of them (benchmarks,
    tests)."""
    tune = tune or {}
    gu_bn, gu_bw = _decode_blocks(I, T * k, H)
    serial_bn, down_bw = _decode_blocks(H, T, I)
    # the down kernel takes the pairs as a tile axis, 64 tile rows a program (8 output rows at top-8): measured on
    # the H200 at Qwen3.6's shapes with the shared expert in the epilogue (bench/nvfp4_kernel_bench.py --groups
    # decsweep, bench/results/2026-12-03-h200-nvfp4-decode-sweep.txt) both kernels took 14.0 / 20.6 / 33.8 / 58.2 /
    # 107.2 / 204.6 us at 1 / 2 / 4 / 8 / 16 / 32 tokens, against 19.5 / 25.6 / 43.3 / 74.3 / 119.7 / 227.0 with the
    # pairs one after another (each a reduction of its own; 4-32 rows a program by _decode_blocks). The same for the
    # gate_up kernel (a program per token and block of rows, x split once for its k pairs) measured level at best
    # (...-nvfp4-decode-sweep-gate-up.txt): it stays one program per pair
    down_bn = max(2, 64 // triton.next_power_of_2(k))
    cfg = dict(
        gu_block_n=gu_bn, gu_block_w=gu_bw, gu_warps=4, down_block_n=down_bn, down_block_w=down_bw, down_warps=4,
        stages=_NUM_STAGES, tile_pairs=DECODE_DOWN == "tiled", gu_half=T * k >= HALF_GATE_UP_MIN_PAIRS,
        down_half=T * k >= HALF_DOWN_MIN_PAIRS,
    )  # fmt: skip
    cfg = with_overrides(cfg, tune, "decode")
    if not cfg["tile_pairs"] and "down_block_n" not in tune:
        cfg["down_block_n"] = serial_bn  # the serial kernel's own pick
    return cfg


def _words(packed: torch.Tensor) -> torch.Tensor:
    """The packed codes as int32 words (8 weights each): the decode kernels' 16-byte loads."""
    return (packed if packed.stride(-1) == 1 else packed.contiguous()).view(torch.int32)


def _scale_bytes(scale: torch.Tensor) -> torch.Tensor:
    return (scale if scale.stride(-1) == 1 else scale.contiguous()).view(torch.uint8)


def _shared_output(shared, shared_gate, shared_gate_up, shared_down) -> Optional[torch.Tensor]:
    """The shared expert's output for the epilogue when it is not computed there: given, or computed here from its
    gate|up projection and a plain down weight."""
    if shared is not None or shared_gate_up is None:
        return shared
    return F.linear(silu_and_mul_torch(shared_gate_up), shared_down)


def _shared_operands(out, shared, shared_gate, shared_gate_up, shared_down, shared_down_nvfp4) -> dict:
    """The down kernel's shared-expert operands: ``SHARED`` 0 (none), 1 (its output, given or computed here) or 2
    (its gate|up and NVFP4 down weight: the down GEMV in the epilogue), with strides; ``out`` stands in for operands
    never read."""
    T, H = out.shape
    ops = dict(mode=0, Is=16, src=out, sd_w=out, sd_s=out, sd_g=out, gate=out, strides=(0, 0, 0, 0, 0))
    if shared_down_nvfp4 is not None and (shared is not None or shared_down is not None or shared_gate_up is None):
        raise ValueError("an NVFP4 shared down weight goes with shared_gate_up only (not shared / shared_down)")
    if (shared is not None or shared_gate_up is not None) != (shared_gate is not None):
        raise ValueError("shared_gate goes with a shared expert term, and only with one")
    if shared_gate is None:
        return ops
    gate = shared_gate.reshape(T, -1)
    if shared_down_nvfp4 is None:
        src = _shared_output(shared, shared_gate, shared_gate_up, shared_down)
        src = src if src.stride(-1) == 1 else src.contiguous()
        return dict(ops, mode=1, src=src, gate=gate, strides=(src.stride(0), 0, 0, 0, gate.stride(0)))
    d = shared_down_nvfp4
    src = shared_gate_up if shared_gate_up.stride(-1) == 1 else shared_gate_up.contiguous()
    sd_w, sd_s, sd_g = _words(d.packed), _scale_bytes(d.scale), d.scale_2.reshape(-1)  # [1] (one) or [H]
    Is = sd_w.shape[1] * 8
    assert sd_w.shape[0] == H and src.shape[1] == 2 * Is and sd_g.numel() in (1, H), "shared expert shapes differ"
    strides = (src.stride(0), sd_w.stride(0), sd_s.stride(0), sd_g.stride(0) if sd_g.numel() > 1 else 0, gate.stride(0))
    return dict(mode=2, Is=Is, src=src, sd_w=sd_w, sd_s=sd_s, sd_g=sd_g, gate=gate, strides=strides)


def nvfp4_moe_decode_triton(
    x, w13, w13_scale, w13_global, w2, w2_scale, w2_global, topk_ids, topk_weights,
    shared=None, shared_gate=None, shared_gate_up=None, shared_down=None, shared_down_nvfp4=None, tune=None,
) -> torch.Tensor:  # fmt: skip
    """Same contract as ``nvfp4_moe_torch`` plus ``moe_decode``'s shared-expert term (``out + sigmoid(shared_gate)
    * s``), ``s`` the shared expert's output: ``shared [T, H]``, or computed from its ``shared_gate_up [T, 2Is]`` and
    either a plain ``shared_down [H, Is]`` (here, in torch) or ``shared_down_nvfp4`` (an ``nvfp4.Nvfp4Tensor``:
    packed ``[H, Is/2]``, block scales ``[H, Is/16]``, global scale ``[]`` or ``[H]``; in the down kernel's
    epilogue). For decode-sized steps; ``tune``: ``decode_config``'s overrides. CUDA, or CPU under
    TRITON_INTERPRET=1."""
    assert triton is not None, "triton is not installed"
    T, H = x.shape
    S, two_i, _ = w13.shape
    I, k = two_i // 2, topk_ids.shape[1]
    out = torch.empty(T, H, dtype=x.dtype, device=x.device)
    if T == 0:
        return out
    x = x if x.stride(-1) == 1 else x.contiguous()
    ids, wts, n = topk_ids.reshape(-1).contiguous(), topk_weights.reshape(-1).contiguous(), T * k
    w13w, w13s, w2w, w2s = _words(w13), _scale_bytes(w13_scale), _words(w2), _scale_bytes(w2_scale)
    inter = torch.empty(n, I, dtype=torch.float32, device=x.device)
    cfg = decode_config(T, k, H, I, tune)
    bn, bw = cfg["gu_block_n"], cfg["gu_block_w"]
    half = cfg["gu_half"] and x.dtype in (torch.bfloat16, torch.float16)
    xp, xf = half_pairs(x) if half else (inter, inter)  # (never read without HALF)
    # the down kernel's half form (tiled pairs only): the intermediate in column order, packed by one more launch
    down_half = cfg["down_half"] and cfg["tile_pairs"] and x.dtype in (torch.bfloat16, torch.float16) and I % 16 == 0
    _nvfp4_decode_gate_up_kernel[(n, triton.cdiv(I, bn))](
        x, w13w, w13s, w13_global, ids, inter, xp, xf, S, x.stride(0), xp.stride(0), w13w.stride(0), w13w.stride(1),
        w13s.stride(0), w13s.stride(1), w13_global.stride(0), H=H, I=I, TOPK=k,
        EVEN=I % bn == 0 and H % (8 * bw) == 0, BLOCK_N=bn, BLOCK_W=bw, NUM_STAGES=cfg["stages"], HALF=half,
        ASM=x.is_cuda, INTER_ROWS=down_half, num_warps=cfg["gu_warps"],
        **pdl_launch(x),
    )  # fmt: skip
    # the intermediate's values are rounded to x's dtype (16-bit here): exact in fp16 once scaled by a power of two
    dp, df = half_pairs(inter) if down_half else (inter, inter)
    ops = _shared_operands(out, shared, shared_gate, shared_gate_up, shared_down, shared_down_nvfp4)
    Is = ops["Is"]
    bn, bw = cfg["down_block_n"], cfg["down_block_w"]
    bws = max(4, min(64, triton.next_power_of_2(Is // 8)))  # as ``_decode_blocks`` picks the routed step
    _nvfp4_decode_down_kernel[(T, triton.cdiv(H, bn))](
        inter, w2w, w2s, w2_global, ids, wts, out, ops["src"], ops["sd_w"], ops["sd_s"], ops["sd_g"], ops["gate"],
        dp, df, S, w2w.stride(0), w2w.stride(1), w2s.stride(0), w2s.stride(1), w2_global.stride(0), out.stride(0),
        *ops["strides"], dp.stride(0), H=H, I=I, IS=Is, TOPK=k, KP=triton.next_power_of_2(k),
        TILE_PAIRS=cfg["tile_pairs"], SHARED=ops["mode"], EVEN=H % bn == 0 and I % (8 * bw) == 0,
        EVEN_S=H % bn == 0 and Is % (8 * bws) == 0, BLOCK_N=bn, BLOCK_W=bw, BLOCK_WS=bws,
        NUM_STAGES=cfg["stages"], HALF=down_half, ASM=x.is_cuda, num_warps=cfg["down_warps"],
        **pdl_launch(inter),
    )  # fmt: skip
    return out


# ----------------------------------------------------------------------------------------------------------------------
# Triton: grouped GEMMs for prefill
# ----------------------------------------------------------------------------------------------------------------------

if triton is not None:
    # A block is BLOCK_M rows plus, when TAIL > 0, TAIL rows of a second token tile that takes the same decoded
    # weight tiles (``fused_moe.py`` says why for the BF16 kernels; here each block also decodes its expert's weight
    # tiles on the CUDA cores, so an expert of 65-80 rows decodes them once instead of twice). A tail that holds only
    # padding is skipped: each run's padding comes last, so its first row says.

    @triton.jit
    def _tile_times(tile, xt, acc, DOT_PREC: tl.constexpr, HALF: tl.constexpr):
        if HALF:
            return tl.dot(tile, xt, acc)
        else:
            return tl.dot(tile, xt, acc, input_precision=DOT_PREC)

    @triton.jit
    def _gate_up_store(gate, up, pair, m_mask, offs_n, n_mask, out_ptr, stride_ot):
        """SiLU(gate) * up of one token tile (``[BLOCK_N, rows]``, rounded as the reference), stored."""
        dt = out_ptr.dtype.element_ty
        h = (gate / (1.0 + tl.exp(-gate))).to(dt).to(tl.float32) * up
        o_ptrs = out_ptr + pair[None, :].to(tl.int64) * stride_ot + offs_n[:, None]
        tl.store(o_ptrs, h.to(dt), mask=n_mask[:, None] & m_mask[None, :])

    @triton.jit
    def _row_factor(xf_ptr, rows, mask, HALF: tl.constexpr):
        """HALF: each column of the sums times its row's 2^-s and the tile's 2^7 (else 1)."""
        if HALF:
            return 128.0 * tl.load(xf_ptr + rows, mask=mask, other=0.0)
        else:
            return tl.full(rows.shape, 1.0, tl.float32)

    @triton.jit
    def _nvfp4_gate_up_rows(
        x_ptr, xf_ptr, w_ptr, s_ptr, g_ptr, out_ptr, e64, pair, m_mask, pair_t, t_mask, H, I,
        stride_xt, stride_we, stride_wn, stride_se, stride_sn, stride_ge, stride_ot,
        TOPK: tl.constexpr, BLOCK_M: tl.constexpr, TAIL_ROWS: tl.constexpr, BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr, NUM_STAGES: tl.constexpr, DOT_PREC: tl.constexpr, FUSE_GU: tl.constexpr,
        HALF: tl.constexpr, ASM: tl.constexpr, WITH_TAIL: tl.constexpr,
    ):  # fmt: skip
        """One block's SiLU(gate) * up rows (and its tail's, ``WITH_TAIL``), each weight tile decoded once."""
        dt = out_ptr.dtype.element_ty
        BW: tl.constexpr = BLOCK_K // 8
        offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        n_mask = offs_n < I
        offs_w = tl.arange(0, BW)
        offs_s = tl.arange(0, BLOCK_K // 16)
        offs_k = tl.arange(0, BLOCK_K)
        xt_ptrs = x_ptr + (pair // TOPK)[None, :].to(tl.int64) * stride_xt + offs_k[:, None]  # xᵀ [K, M]
        tt_ptrs = x_ptr + (pair_t // TOPK)[None, :].to(tl.int64) * stride_xt + offs_k[:, None]
        row_f = _row_factor(xf_ptr, pair // TOPK, m_mask, HALF)
        row_ft = _row_factor(xf_ptr, pair_t // TOPK, t_mask, HALF)
        if FUSE_GU:
            # tile row r: gate row offs_n[r] for r < BLOCK_N, up row offs_n[r - BLOCK_N] after
            r2 = tl.arange(0, 2 * BLOCK_N)
            n2 = tl.program_id(1) * BLOCK_N + r2 % BLOCK_N
            n2_mask = n2 < I
            rows2 = (n2 + (r2 // BLOCK_N) * I)[:, None].to(tl.int64)
            gw2 = w_ptr + e64 * stride_we + rows2 * stride_wn + offs_w[None, :]
            gs2 = s_ptr + e64 * stride_se + rows2 * stride_sn + offs_s[None, :]
            acc = tl.zeros((2 * BLOCK_N, BLOCK_M), dtype=tl.float32)  # [gate | up]ᵀ
            acc_t = tl.zeros((2 * BLOCK_N, TAIL_ROWS), dtype=tl.float32)
            for k0 in tl.range(0, H, BLOCK_K, num_stages=NUM_STAGES):
                k_ok = ((k0 + offs_k) < H)[:, None]
                tile = tile_decode(gw2, gs2, n2_mask, k0, H, offs_w, offs_s, 2 * BLOCK_N, BW, dt, HALF, ASM)
                xt = tl.load(xt_ptrs + k0, mask=k_ok & m_mask[None, :], other=0.0)
                acc = _tile_times(tile, xt, acc, DOT_PREC, HALF)
                if WITH_TAIL:
                    xtt = tl.load(tt_ptrs + k0, mask=k_ok & t_mask[None, :], other=0.0)
                    acc_t = _tile_times(tile, xtt, acc_t, DOT_PREC, HALF)
            glob2 = tl.load(g_ptr + e64 * stride_ge + n2 + (r2 // BLOCK_N) * I, mask=n2_mask, other=0.0)
            acc = acc * row_f[None, :] * glob2[:, None]
            acc_g, acc_u = tl.split(tl.permute(tl.reshape(acc, (2, BLOCK_N, BLOCK_M)), (1, 2, 0)))
            _gate_up_store(acc_g.to(dt).to(tl.float32), acc_u.to(dt).to(tl.float32), pair, m_mask, offs_n, n_mask,
                           out_ptr, stride_ot)  # fmt: skip
            if WITH_TAIL:
                acc_t = acc_t * row_ft[None, :] * glob2[:, None]
                t_g, t_u = tl.split(tl.permute(tl.reshape(acc_t, (2, BLOCK_N, TAIL_ROWS)), (1, 2, 0)))
                _gate_up_store(t_g.to(dt).to(tl.float32), t_u.to(dt).to(tl.float32), pair_t, t_mask, offs_n, n_mask,
                               out_ptr, stride_ot)  # fmt: skip
        else:
            rows = offs_n[:, None].to(tl.int64)
            gw = w_ptr + e64 * stride_we + rows * stride_wn + offs_w[None, :]  # gate rows; up rows I further
            gs = s_ptr + e64 * stride_se + rows * stride_sn + offs_s[None, :]
            gw_u, gs_u = gw + I * stride_wn, gs + I * stride_sn
            acc_g = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)  # gateᵀ
            acc_u = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
            t_g = tl.zeros((BLOCK_N, TAIL_ROWS), dtype=tl.float32)
            t_u = tl.zeros((BLOCK_N, TAIL_ROWS), dtype=tl.float32)
            for k0 in tl.range(0, H, BLOCK_K, num_stages=NUM_STAGES):
                k_ok = ((k0 + offs_k) < H)[:, None]
                xt = tl.load(xt_ptrs + k0, mask=k_ok & m_mask[None, :], other=0.0)
                tile_g = tile_decode(gw, gs, n_mask, k0, H, offs_w, offs_s, BLOCK_N, BW, dt, HALF, ASM)
                acc_g = _tile_times(tile_g, xt, acc_g, DOT_PREC, HALF)
                tile_u = tile_decode(gw_u, gs_u, n_mask, k0, H, offs_w, offs_s, BLOCK_N, BW, dt, HALF, ASM)
                acc_u = _tile_times(tile_u, xt, acc_u, DOT_PREC, HALF)
                if WITH_TAIL:
                    xtt = tl.load(tt_ptrs + k0, mask=k_ok & t_mask[None, :], other=0.0)
                    t_g = _tile_times(tile_g, xtt, t_g, DOT_PREC, HALF)
                    t_u = _tile_times(tile_u, xtt, t_u, DOT_PREC, HALF)
            glob = g_ptr + e64 * stride_ge + offs_n
            glob_g = tl.load(glob, mask=n_mask, other=0.0)[:, None]
            glob_u = tl.load(glob + I, mask=n_mask, other=0.0)[:, None]
            gate = (acc_g * row_f[None, :] * glob_g).to(dt).to(tl.float32)
            up = (acc_u * row_f[None, :] * glob_u).to(dt).to(tl.float32)
            _gate_up_store(gate, up, pair, m_mask, offs_n, n_mask, out_ptr, stride_ot)
            if WITH_TAIL:
                gate = (t_g * row_ft[None, :] * glob_g).to(dt).to(tl.float32)
                up = (t_u * row_ft[None, :] * glob_u).to(dt).to(tl.float32)
                _gate_up_store(gate, up, pair_t, t_mask, offs_n, n_mask, out_ptr, stride_ot)

    @triton.jit(do_not_specialize=["num_pairs"])  # (a pair count, as in fused_moe.py)
    def _nvfp4_moe_gate_up_kernel(
        x_ptr,  # [T, H]; HALF: ``half_rows``' fp16 rows of x
        xf_ptr,  # HALF: fp32 [T], 2^-s of each row's scale
        w_ptr,  # int32 words [E, 2I, H/8]
        s_ptr,  # uint8 e4m3 bits [E, 2I, H/16]
        g_ptr,  # fp32 [E, 2I]
        out_ptr,  # [T*k, I]
        sorted_ids_ptr,
        block_expert_ptr,
        num_pairs,
        num_experts,  # blocks of expert num_experts (the dummy one: ids outside the bank) are skipped
        H,
        I,
        stride_xt,
        stride_we,
        stride_wn,
        stride_se,
        stride_sn,
        stride_ge,
        stride_ot,
        TOPK: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
        NUM_STAGES: tl.constexpr,
        DOT_PREC: tl.constexpr,
        FUSE_GU: tl.constexpr,  # gate and up rows as one [2 * BLOCK_N, BLOCK_K] tile: one decode call, one larger dot
        HALF: tl.constexpr,  # fp16 weight tiles (``dequant_tile_half``) against fp16 x
        ASM: tl.constexpr,  # HALF: ``mul.rn.f16x2`` (CUDA) or the interpreter's emulation
        TAIL: tl.constexpr = 0,  # tail rows a block (0: none), see above
        TAIL_ROWS: tl.constexpr = 16,  # the tail tile's rows: TAIL, or a shape when there is none (never computed)
        PDL: tl.constexpr = False,  # kernels/pdl.py
    ):
        pdl_wait_then_release(PDL)
        pid_m = tl.program_id(0)
        e = tl.load(block_expert_ptr + pid_m)
        if (e >= 0) & (e < num_experts):
            first = pid_m * (BLOCK_M + TAIL)
            pair, m_mask = _block_rows(sorted_ids_ptr, first, num_pairs, BLOCK_M)
            has_tail = False
            if TAIL > 0:
                pair_t, t_mask, has_tail = _tail_rows(sorted_ids_ptr, first, num_pairs, BLOCK_M, TAIL_ROWS)
            else:
                pair_t, t_mask = _no_tail_rows(num_pairs, TAIL_ROWS)
            if has_tail:
                _nvfp4_gate_up_rows(
                    x_ptr, xf_ptr, w_ptr, s_ptr, g_ptr, out_ptr, e.to(tl.int64), pair, m_mask, pair_t, t_mask, H, I,
                    stride_xt, stride_we, stride_wn, stride_se, stride_sn, stride_ge, stride_ot, TOPK, BLOCK_M,
                    TAIL_ROWS, BLOCK_N, BLOCK_K, NUM_STAGES, DOT_PREC, FUSE_GU, HALF, ASM, True,
                )  # fmt: skip
            else:
                _nvfp4_gate_up_rows(
                    x_ptr, xf_ptr, w_ptr, s_ptr, g_ptr, out_ptr, e.to(tl.int64), pair, m_mask, pair_t, t_mask, H, I,
                    stride_xt, stride_we, stride_wn, stride_se, stride_sn, stride_ge, stride_ot, TOPK, BLOCK_M,
                    TAIL_ROWS, BLOCK_N, BLOCK_K, NUM_STAGES, DOT_PREC, FUSE_GU, HALF, ASM, False,
                )  # fmt: skip

    @triton.jit
    def _down_store(acc, pair, m_mask, offs_n, n_mask, hf_ptr, glob, out_ptr, stride_ot, dt, HALF: tl.constexpr):
        """One token tile's down projection (``[BLOCK_N, rows]``): HALF's row factor, the global scale, stored
        rounded to x's dtype as the reference rounds it (the combine applies the routing weight)."""
        acc = acc * _row_factor(hf_ptr, pair, m_mask, HALF)[None, :]
        o_ptrs = out_ptr + pair[None, :].to(tl.int64) * stride_ot + offs_n[:, None]
        tl.store(o_ptrs, (acc * glob[:, None]).to(dt), mask=n_mask[:, None] & m_mask[None, :])

    @triton.jit
    def _zero_rows(
        out_ptr, pair, m_mask, pair_t, t_mask, offs_n, n_mask, stride_ot, dt: tl.constexpr,
        BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr, TAIL_ROWS: tl.constexpr, WITH_TAIL: tl.constexpr,
    ):  # fmt: skip
        """The dummy expert's down rows (ids outside the bank add nothing): zeros at columns ``offs_n``."""
        o_ptrs = out_ptr + pair[None, :].to(tl.int64) * stride_ot + offs_n[:, None]
        tl.store(o_ptrs, tl.zeros((BLOCK_N, BLOCK_M), dtype=dt), mask=n_mask[:, None] & m_mask[None, :])
        if WITH_TAIL:
            o_ptrs = out_ptr + pair_t[None, :].to(tl.int64) * stride_ot + offs_n[:, None]
            zeros = tl.zeros((BLOCK_N, TAIL_ROWS), dtype=dt)
            tl.store(o_ptrs, zeros, mask=n_mask[:, None] & t_mask[None, :])

    @triton.jit
    def _down_k_ptrs(h_ptr, pair, pair_t, stride_ht, BLOCK_K: tl.constexpr):
        """hᵀ pointers (``[BLOCK_K, rows]``, K step 0) of the block's rows and of its tail's."""
        offs_k = tl.arange(0, BLOCK_K)
        ht_ptrs = h_ptr + pair[None, :].to(tl.int64) * stride_ht + offs_k[:, None]
        tt_ptrs = h_ptr + pair_t[None, :].to(tl.int64) * stride_ht + offs_k[:, None]
        return ht_ptrs, tt_ptrs

    @triton.jit
    def _down_k_step(
        ht_ptrs, tt_ptrs, m_mask, t_mask, w_ptr, s_ptr, e64, offs_n, n_mask, k0, I, acc, acc_t,
        stride_we, stride_wn, stride_se, stride_sn,
        BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT_PREC: tl.constexpr, HALF: tl.constexpr, ASM: tl.constexpr,
        dt: tl.constexpr, WITH_TAIL: tl.constexpr,
    ):  # fmt: skip
        """One K step of the down projection's tile at columns ``offs_n``: the weight tile decoded once, times the
        block's rows (and its tail's, ``WITH_TAIL``)."""
        BW: tl.constexpr = BLOCK_K // 8
        offs_w = tl.arange(0, BW)
        offs_s = tl.arange(0, BLOCK_K // 16)
        offs_k = tl.arange(0, BLOCK_K)
        rows = offs_n[:, None].to(tl.int64)
        w_ptrs = w_ptr + e64 * stride_we + rows * stride_wn + offs_w[None, :]
        s_ptrs = s_ptr + e64 * stride_se + rows * stride_sn + offs_s[None, :]
        k_ok = ((k0 + offs_k) < I)[:, None]
        ht = tl.load(ht_ptrs + k0, mask=k_ok & m_mask[None, :], other=0.0)
        tile = tile_decode(w_ptrs, s_ptrs, n_mask, k0, I, offs_w, offs_s, BLOCK_N, BW, dt, HALF, ASM)
        acc = _tile_times(tile, ht, acc, DOT_PREC, HALF)
        if WITH_TAIL:
            htt = tl.load(tt_ptrs + k0, mask=k_ok & t_mask[None, :], other=0.0)
            acc_t = _tile_times(tile, htt, acc_t, DOT_PREC, HALF)
        return acc, acc_t

    @triton.jit
    def _down_tile_store(
        acc, acc_t, pair, m_mask, pair_t, t_mask, offs_n, n_mask, g_ptr, e64, stride_ge, hf_ptr, out_ptr, stride_ot,
        dt: tl.constexpr, HALF: tl.constexpr, WITH_TAIL: tl.constexpr,
    ):  # fmt: skip
        """A finished tile's rows (and its tail's) with the expert's global scales at columns ``offs_n``, stored."""
        glob = tl.load(g_ptr + e64 * stride_ge + offs_n, mask=n_mask, other=0.0)
        _down_store(acc, pair, m_mask, offs_n, n_mask, hf_ptr, glob, out_ptr, stride_ot, dt, HALF)
        if WITH_TAIL:
            _down_store(acc_t, pair_t, t_mask, offs_n, n_mask, hf_ptr, glob, out_ptr, stride_ot, dt, HALF)

    @triton.jit
    def _nvfp4_down_rows(
        h_ptr, hf_ptr, w_ptr, s_ptr, g_ptr, out_ptr, e, num_experts, pair, m_mask, pair_t, t_mask, H, I,
        stride_ht, stride_we, stride_wn, stride_se, stride_sn, stride_ge, stride_ot,
        BLOCK_M: tl.constexpr, TAIL_ROWS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
        NUM_STAGES: tl.constexpr, DOT_PREC: tl.constexpr, HALF: tl.constexpr, ASM: tl.constexpr,
        X_DTYPE: tl.constexpr, WITH_TAIL: tl.constexpr,
    ):  # fmt: skip
        """One block's down projection rows (and its tail's, ``WITH_TAIL``), each weight tile decoded once; the
        dummy expert's rows are written as zeros."""
        dt = X_DTYPE
        offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        n_mask = offs_n < H
        if e < num_experts:
            e64 = e.to(tl.int64)
            ht_ptrs, tt_ptrs = _down_k_ptrs(h_ptr, pair, pair_t, stride_ht, BLOCK_K)
            acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)  # outᵀ
            acc_t = tl.zeros((BLOCK_N, TAIL_ROWS), dtype=tl.float32)
            for k0 in tl.range(0, I, BLOCK_K, num_stages=NUM_STAGES):
                acc, acc_t = _down_k_step(
                    ht_ptrs, tt_ptrs, m_mask, t_mask, w_ptr, s_ptr, e64, offs_n, n_mask, k0, I, acc, acc_t,
                    stride_we, stride_wn, stride_se, stride_sn, BLOCK_N, BLOCK_K, DOT_PREC, HALF, ASM, dt, WITH_TAIL,
                )  # fmt: skip
            _down_tile_store(acc, acc_t, pair, m_mask, pair_t, t_mask, offs_n, n_mask, g_ptr, e64, stride_ge, hf_ptr,
                             out_ptr, stride_ot, dt, HALF, WITH_TAIL)  # fmt: skip
        else:  # the dummy expert: ids outside the bank add zeros
            _zero_rows(out_ptr, pair, m_mask, pair_t, t_mask, offs_n, n_mask, stride_ot, dt, BLOCK_N, BLOCK_M,
                       TAIL_ROWS, WITH_TAIL)  # fmt: skip

    # ``_nvfp4_down_rows`` over ``WALK`` consecutive N tiles a program (``fused_moe.py``'s down walk says why: the
    # down projection's K is short, 512 for Qwen3.6, and here a tile is only 32 KiB of codes and 4 KiB of scales, so a
    # one-tile program spends much of its life filling and draining its pipeline). One flattened loop over the same
    # K step; each tile's rows are stored at its last K step while the next tile's loads are in flight.
    @triton.jit
    def _nvfp4_down_walk_rows(
        h_ptr, hf_ptr, w_ptr, s_ptr, g_ptr, out_ptr, e, num_experts, pair, m_mask, pair_t, t_mask, H, I,
        stride_ht, stride_we, stride_wn, stride_se, stride_sn, stride_ge, stride_ot,
        BLOCK_M: tl.constexpr, TAIL_ROWS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
        NUM_STAGES: tl.constexpr, DOT_PREC: tl.constexpr, HALF: tl.constexpr, ASM: tl.constexpr,
        X_DTYPE: tl.constexpr, WITH_TAIL: tl.constexpr, WALK: tl.constexpr,
    ):  # fmt: skip
        """One block's down projection rows (and its tail's, ``WITH_TAIL``) over the program's ``WALK`` tiles; the
        dummy expert's rows are written as zeros."""
        dt = X_DTYPE
        offs_tile = tl.arange(0, BLOCK_N)
        first_n = tl.program_id(1) * WALK * BLOCK_N
        if e < num_experts:
            e64 = e.to(tl.int64)
            ht_ptrs, tt_ptrs = _down_k_ptrs(h_ptr, pair, pair_t, stride_ht, BLOCK_K)
            k_steps = tl.cdiv(I, BLOCK_K)
            acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)  # outᵀ
            acc_t = tl.zeros((BLOCK_N, TAIL_ROWS), dtype=tl.float32)
            for step in tl.range(0, WALK * k_steps, num_stages=NUM_STAGES):
                tile_i = step // k_steps
                k0 = (step - tile_i * k_steps) * BLOCK_K
                offs_n = first_n + tile_i * BLOCK_N + offs_tile
                n_mask = offs_n < H
                acc, acc_t = _down_k_step(
                    ht_ptrs, tt_ptrs, m_mask, t_mask, w_ptr, s_ptr, e64, offs_n, n_mask, k0, I, acc, acc_t,
                    stride_we, stride_wn, stride_se, stride_sn, BLOCK_N, BLOCK_K, DOT_PREC, HALF, ASM, dt, WITH_TAIL,
                )  # fmt: skip
                if k0 + BLOCK_K >= I:  # the tile's last K step: its rows are done
                    _down_tile_store(acc, acc_t, pair, m_mask, pair_t, t_mask, offs_n, n_mask, g_ptr, e64, stride_ge,
                                     hf_ptr, out_ptr, stride_ot, dt, HALF, WITH_TAIL)  # fmt: skip
                    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
                    if WITH_TAIL:
                        acc_t = tl.zeros((BLOCK_N, TAIL_ROWS), dtype=tl.float32)
        else:  # the dummy expert: ids outside the bank add zeros
            for tile_i in range(0, WALK):
                offs_n = first_n + tile_i * BLOCK_N + offs_tile
                _zero_rows(out_ptr, pair, m_mask, pair_t, t_mask, offs_n, offs_n < H, stride_ot, dt, BLOCK_N,
                           BLOCK_M, TAIL_ROWS, WITH_TAIL)  # fmt: skip

    @triton.jit(do_not_specialize=["num_pairs"])
    def _nvfp4_moe_down_kernel(
        h_ptr,  # [T*k, I]; HALF: ``half_rows``' fp16 rows of it
        hf_ptr,  # HALF: fp32 [T*k], 2^-s of each row's scale
        w_ptr,  # int32 words [E, H, I/8]
        s_ptr,  # uint8 e4m3 bits [E, H, I/16]
        g_ptr,  # fp32 [E, H]
        out_ptr,  # [T*k, H] in x's dtype, unweighted (moe_combine applies the routing weights)
        sorted_ids_ptr,
        block_expert_ptr,
        num_pairs,
        num_experts,  # blocks of expert num_experts (the dummy one) write zeros
        H,
        I,
        stride_ht,
        stride_we,
        stride_wn,
        stride_se,
        stride_sn,
        stride_ge,
        stride_ot,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
        NUM_STAGES: tl.constexpr,
        DOT_PREC: tl.constexpr,
        HALF: tl.constexpr,  # fp16 weight tiles (``dequant_tile_half``) against fp16 rows of h
        ASM: tl.constexpr,  # HALF: ``mul.rn.f16x2`` (CUDA) or the interpreter's emulation
        X_DTYPE: tl.constexpr,  # x's dtype: the down projection is rounded to it, as the reference does
        TAIL: tl.constexpr = 0,  # tail rows a block (0: none), as the gate|up kernel's
        TAIL_ROWS: tl.constexpr = 16,
        WALK: tl.constexpr = 1,  # N tiles a program (``_nvfp4_down_walk_rows``; 1: ``_nvfp4_down_rows``)
        PDL: tl.constexpr = False,  # kernels/pdl.py
    ):
        pdl_wait_then_release(PDL)
        pid_m = tl.program_id(0)
        e = tl.load(block_expert_ptr + pid_m)
        if e >= 0:
            first = pid_m * (BLOCK_M + TAIL)
            pair, m_mask = _block_rows(sorted_ids_ptr, first, num_pairs, BLOCK_M)
            has_tail = False
            if TAIL > 0:
                pair_t, t_mask, has_tail = _tail_rows(sorted_ids_ptr, first, num_pairs, BLOCK_M, TAIL_ROWS)
            else:
                pair_t, t_mask = _no_tail_rows(num_pairs, TAIL_ROWS)
            if WALK > 1:
                if has_tail:
                    _nvfp4_down_walk_rows(
                        h_ptr, hf_ptr, w_ptr, s_ptr, g_ptr, out_ptr, e, num_experts, pair, m_mask, pair_t, t_mask,
                        H, I, stride_ht, stride_we, stride_wn, stride_se, stride_sn, stride_ge, stride_ot, BLOCK_M,
                        TAIL_ROWS, BLOCK_N, BLOCK_K, NUM_STAGES, DOT_PREC, HALF, ASM, X_DTYPE, True, WALK,
                    )  # fmt: skip
                else:
                    _nvfp4_down_walk_rows(
                        h_ptr, hf_ptr, w_ptr, s_ptr, g_ptr, out_ptr, e, num_experts, pair, m_mask, pair_t, t_mask,
                        H, I, stride_ht, stride_we, stride_wn, stride_se, stride_sn, stride_ge, stride_ot, BLOCK_M,
                        TAIL_ROWS, BLOCK_N, BLOCK_K, NUM_STAGES, DOT_PREC, HALF, ASM, X_DTYPE, False, WALK,
                    )  # fmt: skip
            elif has_tail:
                _nvfp4_down_rows(
                    h_ptr, hf_ptr, w_ptr, s_ptr, g_ptr, out_ptr, e, num_experts, pair, m_mask, pair_t, t_mask,
                    H, I, stride_ht, stride_we, stride_wn, stride_se, stride_sn, stride_ge, stride_ot, BLOCK_M,
                    TAIL_ROWS, BLOCK_N, BLOCK_K, NUM_STAGES, DOT_PREC, HALF, ASM, X_DTYPE, True,
                )  # fmt: skip
            else:
                _nvfp4_down_rows(
                    h_ptr, hf_ptr, w_ptr, s_ptr, g_ptr, out_ptr, e, num_experts, pair, m_mask, pair_t, t_mask,
                    H, I, stride_ht, stride_we, stride_wn, stride_se, stride_sn, stride_ge, stride_ot, BLOCK_M,
                    TAIL_ROWS, BLOCK_N, BLOCK_K, NUM_STAGES, DOT_PREC, HALF, ASM, X_DTYPE, False,
                )  # fmt: skip


# the grouped kernels on fp16 weight tiles (``nvfp4_tiles.dequant_tile_half``: ~30 % fewer instructions a weight in
# their K loops' sm_90 SASS) for 16-bit x: ``auto`` where gate and up rows are separate tiles. H200, Qwen3.6's experts,
# uniform routing, two runs each (2026-12-04, bench/results/2026-12-04-h200-nvfp4-grouped-half.txt): 512 / 1,024 /
# 2,048 tokens 620-629 -> 603-609 us, 702-704 -> 673-675, 1,028-1,031 -> 999-1,001 (-3 to -4 %); with gate|up in one
# tile (4,096 and 8,192 tokens) slower, 1,561-1,582 -> 1,807 and 2,551 -> 3,102. ``FREETOKEN_NVFP4_GROUPED_HALF``
# pins it (A/B runs).
GROUPED_HALF = choice_from_env("FREETOKEN_NVFP4_GROUPED_HALF", "auto", ("auto", "on", "off"))


def pick_nvfp4_block_m(num_pairs: int, num_experts: int) -> int:
    """Rows per block of the grouped NVFP4 kernels: 16 while experts average at most 16 pairs, 64 up to 128 pairs,
    then 128 (prefill). Every block decodes its expert's whole weight tile on the CUDA cores, so the decode cost per
    row falls with more rows a block, a cost the BF16 kernel (``fused_moe._pick_block_m``) has no need to spread."""
    per_expert = num_pairs / max(1, min(num_experts, num_pairs))
    if per_expert <= 16:
        return 16
    return 128 if per_expert > 128 else 64


# Launch settings from the H200 sweep at Qwen3.6's expert shapes, uniform routing (bench/nvfp4_kernel_bench.py
# --groups moesweep, bench/results/2026-12-02-h200-nvfp4-moesweep.txt): blocks of 64 rows on 4 warps while experts
# average at most 64 pairs (1,024 tokens 795 -> 722 us, 2,048 tokens 1,418 -> 1,061 us against 32-row blocks on 8
# warps); above, gate and up rows decoded as one tile with K steps of 64 (4,096 tokens 1,966 -> 1,595 us, 8,192
# tokens 2,883 -> 2,571 us).
def grouped_config(num_pairs: int, E: int, H: int, I: int, block_m: int | None = None, tune: Optional[dict] = None):
    """Launch settings of the grouped kernels: rows per block (``pick_nvfp4_block_m``), the gate|up and down tiles,
    warps, pipeline stages, and whether gate and up rows share one tile; ``tune`` overrides any of them."""
    bm = block_m or pick_nvfp4_block_m(num_pairs, E)
    per_expert = num_pairs / max(1, min(E, num_pairs))
    large = per_expert > 64 and bm >= 64
    # rows of a block's tail tile (0, 16, 32 or 64), as fused_moe's: an expert of up to block_m + tail rows decodes
    # its weight tiles once. 16 where blocks are 64 rows with gate and up in separate tiles (16 < pairs an expert <=
    # 64): H200, 2,048 tokens, uniform routing, 972.9 -> 791.8 us (0.69x -> 0.85x of BF16); at 8,192 (128-row
    # blocks) it lost, 2,359.6 -> 2,550.6 (bench/results/2026-12-05-h200-qwen3.6-35b-a3b-nvfp4-moesweep-swap-tail.txt).
    # FREETOKEN_NVFP4_MOE_TAIL sets it for an end-to-end A/B (read at each launch; a graph keeps its capture's)
    tail = int_from_env("FREETOKEN_NVFP4_MOE_TAIL", 16 if bm == 64 and not large and per_expert > 16 else 0, "rows")
    cfg = {
        "block_m": bm,
        "gu_block_n": min(64, max(16, triton.next_power_of_2(I))),
        "gu_block_k": min(64 if large else 128, max(32, triton.next_power_of_2(H))),
        "down_block_n": min(128, max(16, triton.next_power_of_2(H))),
        # 64 on blocks of 64 rows and more. With a tail tile, 128 spills on sm_90 (255 registers, 152 bytes; 222 and
        # none at 64): H100, uniform routing, 1,024 tokens 658 -> 630 us, 2,048 756-765 -> 722-724 (1.13x of BF16).
        # On large steps both cards agree too: 8,192 tokens H100 2,255 -> 2,040 us (0.74x -> 0.82x of BF16), H200
        # 2,170 -> 1,960 (0.62x -> 0.68x); 4,096 H100 1,458 -> 1,411 (bench/results/2026-12-05-h100-...-nvfp4-
        # moesweep-down-k64.txt, 2026-12-05-h200-...-nvfp4-moesweep-down-k64.txt). 16- and 32-row blocks (decode-
        # sized steps just past the GEMVs) keep 128: not measured.
        "down_block_k": min(64 if bm >= 64 else 128, max(32, triton.next_power_of_2(I))),
        # two [BLOCK_N, BLOCK_M] accumulators and the decoded tiles: 4 warps spill at 128 rows
        "warps": 4 if bm <= 16 or (bm <= 64 and not large) else 8,
        "stages": _NUM_STAGES,
        "fuse_gate_up": large,
        "tail": tail,
        # N tiles a down program walks (``_nvfp4_down_walk_rows``; 1: one tile a program). 1: on an H100 walks of
        # 2-16 gained nothing at 2,048 tokens and lost 5-7 % at 8,192 (the BF16 kernel's won: fused_moe.py;
        # bench/results/2026-12-05-h100-qwen3.6-35b-a3b-moe-down-walk.txt). FREETOKEN_NVFP4_MOE_DOWN_WALK sets it
        "down_walk": int_from_env("FREETOKEN_NVFP4_MOE_DOWN_WALK", 1, "tiles"),
    }
    cfg = with_overrides(cfg, tune, "grouped NVFP4")
    if cfg["tail"] not in (0, 16, 32, 64):
        raise ValueError(f"grouped NVFP4 tail {cfg['tail']}: expected 0, 16, 32 or 64 rows")
    if cfg["down_walk"] < 1:
        raise ValueError(f"grouped NVFP4 down_walk {cfg['down_walk']}: expected 1 or more tiles")
    return cfg


def grouped_half(cfg: dict, dtype: torch.dtype, half: Optional[bool]) -> bool:
    """Whether the grouped kernels run on fp16 weight tiles: 16-bit x only; ``half`` when given, else
    ``GROUPED_HALF`` (``auto``: where ``cfg`` keeps gate and up rows in separate tiles)."""
    if half is None:
        half = GROUPED_HALF == "on" or (GROUPED_HALF == "auto" and not cfg["fuse_gate_up"])
    return half and dtype in (torch.bfloat16, torch.float16)


def nvfp4_fused_moe_triton(
    x,
    w13,
    w13_scale,
    w13_global,
    w2,
    w2_scale,
    w2_global,
    topk_ids,
    topk_weights,
    block_m: int | None = None,
    tune: Optional[dict] = None,
    shared: Optional[torch.Tensor] = None,
    shared_gate: Optional[torch.Tensor] = None,
    half: Optional[bool] = None,
    asm: Optional[bool] = None,
    out: Optional[torch.Tensor] = None,
):
    """Grouped NVFP4 MoE; same contract as ``nvfp4_moe_torch`` (``topk_weights`` in x's dtype, as
    ``fused_moe_triton`` takes them), plus ``sigmoid(shared_gate) * shared`` when given (``moe_combine.py``). ``block_m`` overrides ``pick_nvfp4_block_m`` (tests, benchmarks); ``tune``
    overrides the launch settings (``grouped_config``'s keys; bench/nvfp4_kernel_bench.py --groups moesweep).
    ``half`` (16-bit x; default ``GROUPED_HALF``): fp16 weight tiles against x and the intermediate rows in fp16
    (``half_rows``, one launch each); ``asm`` as in ``nvfp4_linear``; ``out`` as ``fused_moe_triton``'s. CUDA, or
    CPU under TRITON_INTERPRET=1."""
    assert triton is not None, "triton is not installed"
    T, H = x.shape
    E, two_i, _ = w13.shape
    I, k = two_i // 2, topk_ids.shape[1]
    if T == 0:
        return torch.zeros_like(x) if out is None else out.zero_()
    x = x if x.stride(-1) == 1 else x.contiguous()
    n = T * k
    ids = topk_ids.reshape(-1)
    ids = torch.where((ids >= 0) & (ids < E), ids, E)  # outside the bank: the dummy expert E
    cfg = grouped_config(n, E, H, I, block_m, tune)
    bm = cfg["block_m"]
    sorted_ids, block_expert = moe_align_block_size(ids, E + 1, bm + cfg["tail"])
    nblocks = block_expert.numel()
    prec = "ieee" if x.dtype == torch.float32 else "tf32"  # fp32 must not silently drop to tf32
    w13b, w13s, w2b, w2s = _words(w13), _scale_bytes(w13_scale), _words(w2), _scale_bytes(w2_scale)
    half = grouped_half(cfg, x.dtype, half)
    asm = x.is_cuda if asm is None else asm
    inter = torch.empty(n, I, dtype=x.dtype, device=x.device)
    xh, xf = half_rows(x) if half else (x, x)  # (xf never read without HALF)
    bn1, bk1 = cfg["gu_block_n"], cfg["gu_block_k"]
    _nvfp4_moe_gate_up_kernel[(nblocks, triton.cdiv(I, bn1))](
        xh, xf, w13b, w13s, w13_global, inter, sorted_ids, block_expert, n, E, H, I, xh.stride(0), w13b.stride(0),
        w13b.stride(1), w13s.stride(0), w13s.stride(1), w13_global.stride(0), inter.stride(0), TOPK=k, BLOCK_M=bm,
        BLOCK_N=bn1, BLOCK_K=bk1, NUM_STAGES=cfg["stages"], DOT_PREC=prec, FUSE_GU=cfg["fuse_gate_up"],
        HALF=half, ASM=asm, TAIL=cfg["tail"], TAIL_ROWS=max(cfg["tail"], 16), num_warps=cfg["warps"],
        **pdl_launch(xh),
    )  # fmt: skip
    # rows rounded to x's dtype, the routing weights applied in the combine (as fused_moe's): half the bytes of fp32
    partial = torch.empty(n, H, dtype=x.dtype, device=x.device)
    ih, hf = half_rows(inter) if half else (inter, inter)
    bn2, bk2 = cfg["down_block_n"], cfg["down_block_k"]
    walk = min(cfg["down_walk"], triton.cdiv(H, bn2))
    _nvfp4_moe_down_kernel[(nblocks, triton.cdiv(H, bn2 * walk))](
        ih, hf, w2b, w2s, w2_global, partial, sorted_ids, block_expert, n, E, H, I, ih.stride(0),
        w2b.stride(0), w2b.stride(1), w2s.stride(0), w2s.stride(1), w2_global.stride(0), partial.stride(0),
        BLOCK_M=bm, BLOCK_N=bn2, BLOCK_K=bk2, NUM_STAGES=cfg["stages"], DOT_PREC=prec, HALF=half, ASM=asm,
        X_DTYPE=TL_DTYPES[x.dtype], TAIL=cfg["tail"], TAIL_ROWS=max(cfg["tail"], 16), WALK=walk,
        num_warps=cfg["warps"], **pdl_launch(ih),
    )  # fmt: skip
    return moe_combine_triton(partial, k, x.dtype, shared, shared_gate, weights=topk_weights, out=out)
