"""W4A16 NVFP4 linear: ``y = x · Wᵀ (+ bias)`` with ``W`` kept packed (layout ``quant/nvfp4.py``), beside the torch
reference it is tested against.

    x [..., K] (bf16 / fp16 / fp32)   weight uint8 [N, K/2]   weight_scale e4m3 [N, K/16]   weight_scale_2 fp32 []
    W[n, k] = e2m1(code[n, k]) * float(weight_scale[n, k // 16]) * weight_scale_2          -> y [..., N] in x's dtype

``nvfp4_linear_torch`` is the reference (``Nvfp4Linear``'s: dequantize to x's dtype, then one matmul). The Triton
paths never materialize ``W``: each tile is decoded in registers (``nvfp4_tiles.py``) right where it is used, so a
step reads 0.5625 bytes per weight instead of 2. Three paths (the first in two forms), by the number of rows ``M``
of x:

- ``M <= GEMV_MAX_M``, or ``M <= GEMV_MAX_M_FEW_ROWS`` for weights with few rows (``pick_path``): a GEMV on the
  CUDA cores. One program per block of output rows (and, when there are too few rows to fill the GPU, per slice of
  K: split-K, the fp32 partial sums added by a second small kernel in a fixed order, so the result does not depend
  on timing). Each step loads a ``[rows, words]`` tile with 16-byte
  loads (a word = 8 weights), decodes two weights per 32-bit operation (``nvfp4_tiles.e2m1_word``), multiplies by
  the matching activations, sums each 16-weight block in registers and applies its scale once. The K loop is
  software-pipelined (loads run ahead through shared memory): a weight-streaming kernel needs that many bytes in
  flight to reach HBM bandwidth. Every row of x costs a multiply-add per weight on the CUDA cores, so past a couple
  of rows the ALUs, not HBM, set the pace: hence the tensor-core path above.
- ``half``: the same GEMV in packed half precision (``nvfp4_half_gemv.py``: ``fma.rn.f16x2`` on the placed code
  pairs, x packed as fp16 pairs by one extra launch), ~40 % fewer instructions a weight; for 16-bit x at up to
  ``HALF_AUTO_MAX_M`` rows on weights of at least ``HALF_MIN_WEIGHTS`` (lm_head: 75 % of HBM at M=1 on the H200).
- ``half_dot``: tensor cores on fp16 tiles (``nvfp4_tiles.dequant_tile_half``: each placed code pair times its
  block scale in one ``mul.rn.f16x2``, fed to the mma without repacking, its columns in pair order) against x's
  rows in fp16 (``half_rows``: scaled per row by a power of two, exact, in the tile's column order, one extra
  launch): ~4.4 instructions a weight against the bf16 tile's ~8.2, whatever M is (~3.7 at K steps of 256 since
  the pairs' cheaper decode, 2026-12-07). For 16-bit x at 2 to ``HALF_DOT_AUTO_MAX_M`` rows on large weights
  (lm_head: 114-116 us at M = 2..16 on the H200, 63 % of HBM, the H100's time too, 2026-12-07; 197-213 on the
  bf16 tile).
- Otherwise tensor cores. Each K step decodes a ``[BLOCK_N, BLOCK_K]`` tile to x's dtype in registers
  (exact: ``e2m1 * scale`` fits bf16) and runs ``tl.dot(W_tile, xᵀ_tile)``: the weights are the left operand, which
  Hopper's wgmma takes from registers, x the right one (read through shared memory). The decode costs the same
  whatever M is. Up to ``SMALL_M_MAX`` rows the tile is narrow in M (16..64) and wide in N; above, 128 x 128 tiles
  like a plain GEMM, where the decode is amortized over 128 rows. One kernel, two configs.
  Why not dequantize to FP8 for Hopper's FP8 tensor cores: ``e2m1 * e4m3`` needs up to 6 significant bits and E4M3
  has 4, and the activations would have to be quantized too (W4A8): not the W4A16 numbers the reference and the
  BF16 path give. Why not dequantize to a BF16 scratch and call cuBLAS: it writes and re-reads 2 bytes per weight
  (3.5x the NVFP4 bytes) and needs a scratch as large as the biggest weight (1 GB for the 248320 x 2048 lm_head).

The global scale ``weight_scale_2`` is read on the device and applied in the epilogue (after the K loop, in fp32),
the bias added there too. Block sizes depend only on the shapes and nothing is read back on the host: CUDA-graph
capturable. ``nvfp4_linear`` runs Triton on CUDA tensors and the reference elsewhere.

Rounding: the reference rounds every weight to x's dtype after multiplying by the global scale; here ``e2m1 *
scale`` is exact and the global scale multiplies the fp32 sum, so results differ from the reference by that
rounding (about 2^-9 relative per weight in bf16, averaging out over K) and by the order of the fp32 sums.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from ..quant import nvfp4
from .device_sms import scaled, sm_count

try:  # keep the reference importable without triton
    import triton
    import triton.language as tl

    from .nvfp4_half_gemv import HALF_MAX_M, half_decode, half_pairs, half_row, half_rows
    from .nvfp4_tiles import (
        block_scale,
        dequant_tile_half,
        dequant_tile_words,
        e2m1_word,
        gemv_row,
    )
    from .pdl import pdl_launch, pdl_prefetch_rows, pdl_wait_then_release
except Exception:  # pragma: no cover
    triton = None
    tl = None

# M up to this runs the CUDA-core GEMV; above, tensor cores. Statically (sm_90 SASS of the inner loops) the GEMV
# costs ~6 instructions per weight for one row and ~8 for two, ~12 for four; the tensor-core tile ~7 whatever M
# is. (bench/nvfp4_kernel_bench.py measures both paths at small M: retune here.)
GEMV_MAX_M = 2
# ... and up to this M when the weight has too few rows to give every SM a tensor-core program (the GEMV splits K,
# the tensor-core path does not): on the H200 the shared expert's gate (512 x 2048) took 4.8 / 6.4 us at M = 4 / 8
# on the GEMV against 16.5 on tensor cores
GEMV_MAX_M_FEW_ROWS = 8
# for 16-bit x and weights of at least HALF_MIN_WEIGHTS weights (below, the extra launch that scales x costs more
# than it saves): the packed-half GEMV (``nvfp4_half_gemv``) up to HALF_AUTO_MAX_M rows, then the fp16 tensor-core
# tiles (``half_dot``) up to HALF_DOT_AUTO_MAX_M. H200, lm_head (2026-12-04,
# bench/results/2026-12-04-h200-nvfp4-half-dot.txt): M=1 half 91.0 us, half_dot 110.9; M=2 121.4 / 109.8; M=3..16
# half 206.6-207.0 (M<=4), dot 199-214, half_dot 110.1-118.0 (60-62 % of HBM)
HALF_AUTO_MAX_M = 1
HALF_DOT_AUTO_MAX_M = 16
HALF_MIN_WEIGHTS = 1 << 26
# up to this many rows the tensor-core path uses tiles narrow in M (16..64 rows) and wide in N
SMALL_M_MAX = 64

# a weight-streaming kernel wants about four programs per SM (the H200's 132; ``device_sms.scaled`` for other GPUs)
_TARGET_PROGRAMS = 528
# weight bytes one GEMV program loads per step: 64 per thread at 4 warps (four 16-byte loads, 128 decoded weights).
# H200 sweep (2026-12-02, bench/results/2026-12-02-h200-nvfp4-sweep.txt): lm_head at M=1 115.7 us with 8192 against
# 134.1 with 4096 (63 % vs 54 % of HBM), M=2 184 vs 210; the small shared-expert shapes equal.
_GEMV_TILE = 8192
_NUM_STAGES = 3
# the packed-half GEMV's (tile bytes, words a row per step) for M > 1 and M = 1. H200, lm_head (2026-12-04,
# bench/results/2026-12-04-h200-nvfp4-half-gemv.txt): 32 words of 128 rows a program at M = 1 took 83.9 us, of 64
# rows 88.3, and 64 words of 32 rows (the fp32 GEMV's tile) 101.5; at M = 2..4 32 words of 64 rows were best
# (119.4 / 203.6 / 204.3 us)
_HALF_TILES = {False: (8192, 32), True: (16384, 32)}


# ----------------------------------------------------------------------------------------------------------------------
# torch reference
# ----------------------------------------------------------------------------------------------------------------------


def nvfp4_linear_torch(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    weight_scale_2: torch.Tensor,
    bias: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Reference: the whole weight dequantized to x's dtype (ModelOpt's dequantization), then ``F.linear``."""
    return F.linear(x, nvfp4.dequantize(weight, weight_scale, weight_scale_2, x.dtype), bias)


# ----------------------------------------------------------------------------------------------------------------------
# Triton
# ----------------------------------------------------------------------------------------------------------------------

if triton is not None:

    @triton.jit
    def _gemv_row_step(
        v0, v1, v2, v3, v4, v5, v6, v7, scale, m, M, x_ptr, stride_xm, xp_ptr, stride_pm, K, kw0, k_mask, b_mask,
        offs_x, BLOCK_N: tl.constexpr, BLOCK_W: tl.constexpr, HALF: tl.constexpr, ASM: tl.constexpr,
    ):  # fmt: skip
        """Row ``m`` of x against a decoded step (``e2m1_word``'s weights, or with ``HALF`` ``half_decode``'s code
        pairs): the ``[BLOCK_N, BLOCK_W // 2]`` scaled block sums."""
        if HALF:
            return half_row(
                v0, v1, v2, v3, v4, v5, v6, v7, scale, xp_ptr, m, M, stride_pm, K // 16, kw0 // 2, b_mask,
                BLOCK_W // 2, ASM,
            )  # fmt: skip
        else:
            return gemv_row(
                v0, v1, v2, v3, v4, v5, v6, v7, scale, x_ptr, m, M, stride_xm, 8 * kw0, k_mask, offs_x, BLOCK_N,
                BLOCK_W,
            )  # fmt: skip

    @triton.jit
    def _gemv_store(acc, m, M, g, bias_ptr, out_ptr, stride_om, offs_n, n_mask, HAS_BIAS, PARTIAL, xf_ptr, HALF):
        """Row ``m``: the sum over the step's blocks (``HALF``: times the row's ``2^-s`` from ``xf_ptr``, undoing
        ``half_pairs``' scale), then (unless a split-K partial) the global scale and bias."""
        y = tl.sum(acc, 1)
        if HALF:
            y = y * tl.load(xf_ptr + m + offs_n * 0, mask=n_mask & (offs_n * 0 + m < M), other=0.0)
        if not PARTIAL:
            y = y * g
            if HAS_BIAS:
                y += tl.load(bias_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)
        tl.store(out_ptr + m * stride_om + offs_n, y.to(out_ptr.dtype.element_ty), mask=n_mask & (offs_n * 0 + m < M))

    @triton.jit
    def _nvfp4_gemv_kernel(
        x_ptr,  # [M, K]
        xp_ptr,  # HALF: x's fp16 pairs, int32 [M, 8, K/16] (``nvfp4_half_gemv.half_pairs``)
        xf_ptr,  # HALF: fp32 [M], 2^-s of each row's scale
        w_ptr,  # int32 words of the packed weight [N, K/8]
        s_ptr,  # uint8 (e4m3 bits) [N, K/16]
        g_ptr,  # fp32 [] global scale
        bias_ptr,  # [N] (HAS_BIAS)
        out_ptr,  # SPLIT_K == 1: [M, N] in x's dtype; else fp32 partials [SPLIT_K, M, N]
        M,
        N,
        K,
        stride_xm,
        stride_pm,
        stride_wn,
        stride_sn,
        stride_om,
        stride_os,  # between the split-K partials
        KW_PER_SPLIT,  # words of K per split, a multiple of BLOCK_W
        HAS_BIAS: tl.constexpr,
        EVEN: tl.constexpr,  # N a multiple of BLOCK_N and every split whole steps: no masks in the loop
        SPLIT_K: tl.constexpr,
        BLOCK_M: tl.constexpr,  # 1..8 (HALF: 1..4): rows of x, each with its own accumulator
        BLOCK_N: tl.constexpr,
        BLOCK_W: tl.constexpr,  # words of a row per step (8 weights each)
        NUM_STAGES: tl.constexpr,
        HALF: tl.constexpr,  # the packed-half GEMV (``nvfp4_half_gemv``): x as fp16 pairs, f16x2 multiply-adds
        ASM: tl.constexpr,  # HALF: its inline PTX (CUDA) or the interpreter's emulation
        PDL: tl.constexpr = False,  # kernels/pdl.py
    ):
        # FREETOKEN_PDL=prefetch: this program's first weight and scale lines into L2 before the wait (kernels/pdl.py)
        pf_rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        pdl_prefetch_rows(w_ptr, pf_rows, stride_wn, N, tl.program_id(1) * KW_PER_SPLIT, K // 8, 2, PDL)
        pdl_prefetch_rows(s_ptr, pf_rows, stride_sn, N, tl.program_id(1) * KW_PER_SPLIT // 2, K // 16, 1, PDL)
        pdl_wait_then_release(PDL)
        NB: tl.constexpr = BLOCK_W // 2  # scale blocks per step
        pid_n = tl.program_id(0)
        pid_k = tl.program_id(1)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        n_mask = offs_n < N
        offs_w = tl.arange(0, BLOCK_W)
        offs_s = tl.arange(0, NB)
        offs_x = tl.arange(0, 8 * BLOCK_W)
        KW = K // 8
        kw_start = pid_k * KW_PER_SPLIT
        kw_end = tl.minimum(kw_start + KW_PER_SPLIT, KW)
        w_ptrs = w_ptr + offs_n[:, None].to(tl.int64) * stride_wn + offs_w[None, :]
        s_ptrs = s_ptr + offs_n[:, None].to(tl.int64) * stride_sn + offs_s[None, :]
        # one accumulator per row of x ([output rows, scale blocks of a step], reduced once after the loop): a 3-D
        # [rows of x, rows of W, K] product would get a layout of one element per thread (no wide loads)
        a0 = tl.zeros((BLOCK_N, NB), dtype=tl.float32)
        a1 = tl.zeros((BLOCK_N, NB), dtype=tl.float32)
        a2 = tl.zeros((BLOCK_N, NB), dtype=tl.float32)
        a3 = tl.zeros((BLOCK_N, NB), dtype=tl.float32)
        a4 = tl.zeros((BLOCK_N, NB), dtype=tl.float32)
        a5 = tl.zeros((BLOCK_N, NB), dtype=tl.float32)
        a6 = tl.zeros((BLOCK_N, NB), dtype=tl.float32)
        a7 = tl.zeros((BLOCK_N, NB), dtype=tl.float32)
        for kw0 in tl.range(kw_start, kw_end, BLOCK_W, num_stages=NUM_STAGES):
            if EVEN:  # no masks: full-width loads, no predicates
                w = tl.load(w_ptrs + kw0)
                scale = block_scale(tl.load(s_ptrs + kw0 // 2))
                b_mask = offs_s >= 0
            else:
                w_mask = n_mask[:, None] & ((kw0 + offs_w) < kw_end)[None, :]
                b_mask = (kw0 // 2 + offs_s) < kw_end // 2  # the step's scale blocks inside the split
                w = tl.load(w_ptrs + kw0, mask=w_mask, other=0)
                scale = block_scale(tl.load(s_ptrs + kw0 // 2, mask=n_mask[:, None] & b_mask[None, :], other=0))
            k_mask = (8 * kw0 + offs_x) < 8 * kw_end if not EVEN else offs_x >= 0
            if HALF:  # code pairs as fp16, for f16x2 multiply-adds
                v0, v1, v2, v3, v4, v5, v6, v7 = half_decode(w, BLOCK_N, NB)
            else:
                v0, v1, v2, v3, v4, v5, v6, v7 = e2m1_word(w)
            a0 += _gemv_row_step(
                v0, v1, v2, v3, v4, v5, v6, v7, scale, 0, M, x_ptr, stride_xm, xp_ptr, stride_pm, K, kw0,
                k_mask, b_mask, offs_x, BLOCK_N, BLOCK_W, HALF, ASM,
            )  # fmt: skip
            if BLOCK_M > 1:
                a1 += _gemv_row_step(
                    v0, v1, v2, v3, v4, v5, v6, v7, scale, 1, M, x_ptr, stride_xm, xp_ptr, stride_pm, K, kw0,
                    k_mask, b_mask, offs_x, BLOCK_N, BLOCK_W, HALF, ASM,
                )  # fmt: skip
            if BLOCK_M > 2:
                a2 += _gemv_row_step(
                    v0, v1, v2, v3, v4, v5, v6, v7, scale, 2, M, x_ptr, stride_xm, xp_ptr, stride_pm, K, kw0,
                    k_mask, b_mask, offs_x, BLOCK_N, BLOCK_W, HALF, ASM,
                )  # fmt: skip
                a3 += _gemv_row_step(
                    v0, v1, v2, v3, v4, v5, v6, v7, scale, 3, M, x_ptr, stride_xm, xp_ptr, stride_pm, K, kw0,
                    k_mask, b_mask, offs_x, BLOCK_N, BLOCK_W, HALF, ASM,
                )  # fmt: skip
            if BLOCK_M > 4:
                a4 += _gemv_row_step(
                    v0, v1, v2, v3, v4, v5, v6, v7, scale, 4, M, x_ptr, stride_xm, xp_ptr, stride_pm, K, kw0,
                    k_mask, b_mask, offs_x, BLOCK_N, BLOCK_W, HALF, ASM,
                )  # fmt: skip
                a5 += _gemv_row_step(
                    v0, v1, v2, v3, v4, v5, v6, v7, scale, 5, M, x_ptr, stride_xm, xp_ptr, stride_pm, K, kw0,
                    k_mask, b_mask, offs_x, BLOCK_N, BLOCK_W, HALF, ASM,
                )  # fmt: skip
                a6 += _gemv_row_step(
                    v0, v1, v2, v3, v4, v5, v6, v7, scale, 6, M, x_ptr, stride_xm, xp_ptr, stride_pm, K, kw0,
                    k_mask, b_mask, offs_x, BLOCK_N, BLOCK_W, HALF, ASM,
                )  # fmt: skip
                a7 += _gemv_row_step(
                    v0, v1, v2, v3, v4, v5, v6, v7, scale, 7, M, x_ptr, stride_xm, xp_ptr, stride_pm, K, kw0,
                    k_mask, b_mask, offs_x, BLOCK_N, BLOCK_W, HALF, ASM,
                )  # fmt: skip
        g = tl.load(g_ptr)
        out_ptr += pid_k * stride_os
        PARTIAL: tl.constexpr = SPLIT_K > 1
        _gemv_store(a0, 0, M, g, bias_ptr, out_ptr, stride_om, offs_n, n_mask, HAS_BIAS, PARTIAL, xf_ptr, HALF)
        if BLOCK_M > 1:
            _gemv_store(a1, 1, M, g, bias_ptr, out_ptr, stride_om, offs_n, n_mask, HAS_BIAS, PARTIAL, xf_ptr, HALF)
        if BLOCK_M > 2:
            _gemv_store(a2, 2, M, g, bias_ptr, out_ptr, stride_om, offs_n, n_mask, HAS_BIAS, PARTIAL, xf_ptr, HALF)
            _gemv_store(a3, 3, M, g, bias_ptr, out_ptr, stride_om, offs_n, n_mask, HAS_BIAS, PARTIAL, xf_ptr, HALF)
        if BLOCK_M > 4:
            _gemv_store(a4, 4, M, g, bias_ptr, out_ptr, stride_om, offs_n, n_mask, HAS_BIAS, PARTIAL, xf_ptr, HALF)
            _gemv_store(a5, 5, M, g, bias_ptr, out_ptr, stride_om, offs_n, n_mask, HAS_BIAS, PARTIAL, xf_ptr, HALF)
            _gemv_store(a6, 6, M, g, bias_ptr, out_ptr, stride_om, offs_n, n_mask, HAS_BIAS, PARTIAL, xf_ptr, HALF)
            _gemv_store(a7, 7, M, g, bias_ptr, out_ptr, stride_om, offs_n, n_mask, HAS_BIAS, PARTIAL, xf_ptr, HALF)

    @triton.jit
    def _splitk_reduce_kernel(
        part_ptr,  # fp32 [SPLIT_K, M, N]
        g_ptr,
        bias_ptr,
        out_ptr,  # [M, N]
        N,
        stride_ps,
        stride_pm,
        stride_om,
        HAS_BIAS: tl.constexpr,
        SPLIT_K: tl.constexpr,
        BLOCK: tl.constexpr,
        PDL: tl.constexpr = False,  # kernels/pdl.py
    ):
        pdl_wait_then_release(PDL)
        m = tl.program_id(0).to(tl.int64)
        offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < N
        y = tl.zeros((BLOCK,), dtype=tl.float32)
        for s in tl.static_range(SPLIT_K):  # fixed order: the same sum on every run
            y += tl.load(part_ptr + s * stride_ps + m * stride_pm + offs, mask=mask, other=0.0)
        y = y * tl.load(g_ptr)
        if HAS_BIAS:
            y += tl.load(bias_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        tl.store(out_ptr + m * stride_om + offs, y.to(out_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _dot_k_step(
        acc, w_ptrs, s_ptrs, xt_ptrs, k0, K, offs_w, offs_s, offs_k, n_mask, m_mask,
        BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT_PREC: tl.constexpr, HALF: tl.constexpr,
        EVEN: tl.constexpr, ASM: tl.constexpr,
    ):  # fmt: skip
        """One K step of ``_nvfp4_dot_kernel``'s tile: the weight tile at weight ``k0`` decoded, times xᵀ, into
        ``acc``."""
        BW: tl.constexpr = BLOCK_K // 8
        if EVEN:
            w = tl.load(w_ptrs + k0 // 8)
            s = tl.load(s_ptrs + k0 // 16)
            # rows of the tile past M are masked, not read as padding: a masked async copy fills zeros
            # without touching memory, so M = 2 reads 2 rows of x a K step, not 16 (every program reads x,
            # from L2: at 16 rows its bytes equal the weight tile's)
            xt = tl.load(xt_ptrs + k0, mask=m_mask[None, :], other=0.0)
        else:
            w_mask = n_mask[:, None] & ((k0 // 8 + offs_w) < K // 8)[None, :]
            w = tl.load(w_ptrs + k0 // 8, mask=w_mask, other=0)
            s_mask = n_mask[:, None] & ((k0 // 16 + offs_s) < K // 16)[None, :]
            s = tl.load(s_ptrs + k0 // 16, mask=s_mask, other=0)
            xt = tl.load(xt_ptrs + k0, mask=((k0 + offs_k) < K)[:, None] & m_mask[None, :], other=0.0)
        if HALF:
            return tl.dot(dequant_tile_half(w, s, BLOCK_N, BW, ASM), xt, acc)
        else:
            return tl.dot(
                dequant_tile_words(w, s, BLOCK_N, BW, xt_ptrs.dtype.element_ty), xt, acc, input_precision=DOT_PREC
            )

    @triton.jit
    def _dot_store(
        acc, g_ptr, xf_ptr, bias_ptr, out_ptr, offs_m, m_mask, offs_n, n_mask, stride_om,
        HAS_BIAS: tl.constexpr, HALF: tl.constexpr,
    ):  # fmt: skip
        """A finished tile (``acc``: yᵀ) with the global scale, HALF's factors and the bias, stored."""
        y = acc * tl.load(g_ptr)
        if HALF:  # undo the tile's 2^-7 and the row's 2^s
            y = y * (128.0 * tl.load(xf_ptr + offs_m, mask=m_mask, other=0.0))[None, :]
        if HAS_BIAS:
            y += tl.load(bias_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[:, None]
        o_ptrs = out_ptr + offs_m[None, :].to(tl.int64) * stride_om + offs_n[:, None]
        tl.store(o_ptrs, y.to(out_ptr.dtype.element_ty), mask=n_mask[:, None] & m_mask[None, :])

    # (M: a row count; each value divisible by 16 would compile its own kernel, inside a step of that many rows)
    @triton.jit(do_not_specialize=["M"])
    def _nvfp4_dot_kernel(
        x_ptr,  # [M, K]; HALF: ``half_rows``' fp16 rows (scaled, in the tile's column order)
        xf_ptr,  # HALF: fp32 [M], 2^-s of each row's scale
        w_ptr,  # int32 words of the packed weight [N, K/8]
        s_ptr,  # uint8 (e4m3 bits) [N, K/16]
        g_ptr,  # fp32 [] global scale
        bias_ptr,  # [N] (HAS_BIAS)
        out_ptr,  # [M, N]
        M,
        N,
        K,
        stride_xm,
        stride_wn,
        stride_sn,
        stride_om,
        HAS_BIAS: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
        NUM_STAGES: tl.constexpr,
        DOT_PREC: tl.constexpr,
        HALF: tl.constexpr,  # fp16 tiles (``dequant_tile_half``) against fp16 x: fewer instructions a weight
        EVEN: tl.constexpr,  # HALF, N a multiple of WALK * BLOCK_N and K of BLOCK_K: no masks in the loop
        ASM: tl.constexpr,  # HALF: ``mul.rn.f16x2`` (CUDA) or the interpreter's emulation
        WALK: tl.constexpr = 1,  # N tiles a program (every P-th of P programs), one pipelined loop (1: one tile)
        PDL: tl.constexpr = False,  # kernels/pdl.py
    ):
        # FREETOKEN_PDL=prefetch: this program's first weight and scale lines into L2 before the wait
        first_n = tl.program_id(1) * BLOCK_N
        pf_rows = first_n + tl.arange(0, BLOCK_N)
        pdl_prefetch_rows(w_ptr, pf_rows, stride_wn, N, 0, K // 8, 2, PDL)
        pdl_prefetch_rows(s_ptr, pf_rows, stride_sn, N, 0, K // 16, 1, PDL)
        pdl_wait_then_release(PDL)
        # M blocks vary fastest: programs launched together share a weight tile (read from HBM once, then L2)
        offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        m_mask = offs_m < M
        offs_tile = tl.arange(0, BLOCK_N)
        offs_w = tl.arange(0, BLOCK_K // 8)
        offs_s = tl.arange(0, BLOCK_K // 16)
        offs_k = tl.arange(0, BLOCK_K)
        # xᵀ tile [BLOCK_K, BLOCK_M] (HALF: ``half_rows`` wrote x's columns in the fp16 tile's order)
        xt_ptrs = x_ptr + offs_m[None, :].to(tl.int64) * stride_xm + offs_k[:, None]
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)  # yᵀ
        if WALK == 1:
            offs_n = first_n + offs_tile
            n_mask = offs_n < N
            w_ptrs = w_ptr + offs_n[:, None].to(tl.int64) * stride_wn + offs_w[None, :]
            s_ptrs = s_ptr + offs_n[:, None].to(tl.int64) * stride_sn + offs_s[None, :]
            for k0 in tl.range(0, K, BLOCK_K, num_stages=NUM_STAGES):
                acc = _dot_k_step(acc, w_ptrs, s_ptrs, xt_ptrs, k0, K, offs_w, offs_s, offs_k, n_mask, m_mask,
                                  BLOCK_N, BLOCK_K, DOT_PREC, HALF, EVEN, ASM)  # fmt: skip
            _dot_store(acc, g_ptr, xf_ptr, bias_ptr, out_ptr, offs_m, m_mask, offs_n, n_mask, stride_om, HAS_BIAS,
                       HALF)  # fmt: skip
        else:
            # the K steps of all the program's tiles in one loop: the next tile's first loads are in flight while
            # this one's last steps compute, where a one-tile program fills and drains its pipeline alone. Tiles
            # are dealt out in turn (program p: tiles p, p + P, p + 2P, ... of P programs), so programs launched
            # together read neighbouring tiles, and all of them finish within a tile of each other
            k_steps = tl.cdiv(K, BLOCK_K)
            tile_stride = tl.num_programs(1) * BLOCK_N
            w_ptrs = w_ptr + (first_n + offs_tile)[:, None].to(tl.int64) * stride_wn + offs_w[None, :]
            s_ptrs = s_ptr + (first_n + offs_tile)[:, None].to(tl.int64) * stride_sn + offs_s[None, :]
            for step in tl.range(0, WALK * k_steps, num_stages=NUM_STAGES):
                tile_i = step // k_steps
                k0 = (step - tile_i * k_steps) * BLOCK_K
                offs_n = first_n + tile_i * tile_stride + offs_tile
                n_mask = offs_n < N
                rows = tile_i.to(tl.int64) * tile_stride  # the tile's first row past the program's first
                acc = _dot_k_step(acc, w_ptrs + rows * stride_wn, s_ptrs + rows * stride_sn, xt_ptrs, k0, K, offs_w,
                                  offs_s, offs_k, n_mask, m_mask, BLOCK_N, BLOCK_K, DOT_PREC, HALF, EVEN, ASM)  # fmt: skip
                if k0 + BLOCK_K >= K:  # the tile's last K step: its rows are done
                    _dot_store(acc, g_ptr, xf_ptr, bias_ptr, out_ptr, offs_m, m_mask, offs_n, n_mask, stride_om,
                               HAS_BIAS, HALF)  # fmt: skip
                    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)


def _gemv_config(M: int, N: int, K: int, tile: int = _GEMV_TILE, max_words: int = 64) -> tuple[int, int, int, int]:
    """``(BLOCK_M, BLOCK_N, BLOCK_W, SPLIT_K)`` for the GEMV: tiles of ``tile`` bytes, 4..``max_words`` words (8
    weights each) of a row per step; K split (each split at least one step long), then fewer rows per program,
    until the grid has about ``_TARGET_PROGRAMS`` programs."""
    bm = triton.next_power_of_2(M)
    kw = K // 8
    bw = max(4, min(max_words, triton.next_power_of_2(kw)))
    bn = max(4, min(64, tile // (4 * bw)))
    bn = min(bn, max(4, triton.next_power_of_2(N)))
    split, target = 1, scaled(_TARGET_PROGRAMS)
    while triton.cdiv(N, bn) * split < target and triton.cdiv(kw, split * 2) >= bw:
        split *= 2
    while triton.cdiv(N, bn) * split < target and bn > 4:  # then fewer rows per program
        bn //= 2
    return bm, bn, bw, split


def _dot_config(M: int, N: int, K: int, half: bool = False) -> tuple[int, int, int, int]:
    """``(BLOCK_M, BLOCK_N, BLOCK_K, num_warps)`` for the tensor-core path (``half``: its fp16 tiles)."""
    bk = max(32, min(128, triton.next_power_of_2(K)))
    if M <= SMALL_M_MAX:
        # narrow programs, many of them in flight per SM to hide the decode's latency. H200 sweeps (2026-12-02,
        # lm_head 248320 x 2048): M <= 16 took 197-214 us with 32 output rows and 2 warps a program, 250 with 64
        # rows and 4 warps, 329 with 128 rows (the former default); M = 32 / 64: 278 / 371 us with 64 rows. The
        # fp16 tiles (2026-12-04): 64 rows on 2 warps 111-112 us at M = 1 / 4, 32 rows 117-118. Their K step 256
        # (H100 sweep 2026-12-06, bench/results/2026-12-06-h100-nvfp4-sweep.txt): 114.7-118.7 us at M = 2..16
        # against 137.5-142.0 with 128 (83-84 % of HBM against 68-70 %): twice the bytes in flight per program
        bm = max(16, triton.next_power_of_2(M))
        if bm == 16:
            return (bm, 64, max(32, min(256, triton.next_power_of_2(K))), 2) if half else (bm, 32, bk, 2)
        return bm, 64, bk, 4 if bm <= 32 else 8  # 4 warps at 64 rows spill registers on sm_80/89
    return 128, 128, min(bk, 64), 8


# Launch settings a benchmark may override per call (``nvfp4_linear_triton(..., tune=...)``; bench/nvfp4_kernel_bench.py
# --groups sweep times them): GEMV ``tile`` (weight bytes a program loads per step), ``words`` (at most this many
# words of a row per step), ``warps``, ``stages``; tensor cores
# ``block_n``, ``block_k``, ``warps``, ``stages``, ``walk`` (N tiles a program). Anything not given keeps the default.
TUNE_KEYS = {
    "gemv": ("tile", "words", "warps", "stages"),
    "half": ("tile", "words", "warps", "stages"),
    "dot": ("block_n", "block_k", "warps", "stages", "walk"),
    "half_dot": ("block_n", "block_k", "warps", "stages", "walk"),
}


def _launch_gemv(
    x2, weight, weight_scale, weight_scale_2, bias, out, tune: Optional[dict] = None, half: bool = False, asm=None
) -> None:
    """The fp32 GEMV, or with ``half`` the packed-half one (``nvfp4_half_gemv``; ``asm``: its inline PTX, the
    default on CUDA, or the interpreter's emulation, which a GPU test compares against it)."""
    M, K = x2.shape
    N = weight.shape[0]
    tune = tune or {}
    assert not half or M <= HALF_MAX_M, f"the packed-half GEMV carries at most {HALF_MAX_M} rows of x, not {M}"
    tile, max_words = _HALF_TILES[M == 1] if half else (_GEMV_TILE, 64)
    bm, bn, bw, split = _gemv_config(M, N, K, tune.get("tile", tile), tune.get("words", max_words))
    kw_per_split = triton.cdiv(triton.cdiv(K // 8, split), bw) * bw
    split = triton.cdiv(K // 8, kw_per_split)  # no empty splits
    dst = out if split == 1 else torch.empty(split, M, N, dtype=torch.float32, device=x2.device)
    b = bias if bias is not None else out  # never read without HAS_BIAS
    words = weight.view(torch.int32)  # [N, K/8]: 16-byte loads of 4 words, 8 weights decoded per word
    # the packed-half GEMV reads x as fp16 pairs (one small launch packs them), the fp32 GEMV x itself
    xp, xf = half_pairs(x2) if half else (x2, x2)
    _nvfp4_gemv_kernel[(triton.cdiv(N, bn), split)](
        x2, xp, xf, words, weight_scale, weight_scale_2, b, dst, M, N, K,
        x2.stride(0), xp.stride(0), words.stride(0), weight_scale.stride(0), dst.stride(-2),
        dst.stride(0) if split > 1 else 0, kw_per_split, HAS_BIAS=bias is not None,
        EVEN=N % bn == 0 and (K // 8) % kw_per_split == 0, SPLIT_K=split, BLOCK_M=bm, BLOCK_N=bn, BLOCK_W=bw,
        NUM_STAGES=tune.get("stages", _NUM_STAGES), HALF=half, ASM=x2.is_cuda if asm is None else asm,
        num_warps=tune.get("warps", 4),
        **pdl_launch(x2),
    )  # fmt: skip
    if split > 1:
        block = min(1024, triton.next_power_of_2(N))
        _splitk_reduce_kernel[(M, triton.cdiv(N, block))](
            dst, weight_scale_2, b, out, N, dst.stride(0), dst.stride(1), out.stride(0),
            HAS_BIAS=bias is not None, SPLIT_K=split, BLOCK=block, num_warps=4,
            **pdl_launch(dst),
        )  # fmt: skip


def _launch_dot(
    x2, weight, weight_scale, weight_scale_2, bias, out, tune: Optional[dict] = None, half: bool = False, asm=None
) -> None:
    """The tensor-core path; ``half``: its fp16 tiles against x's rows in fp16 (``half_rows``: one small launch
    scales each row by a power of two; the kernel masks the tile's rows past M; ``asm`` as in ``_launch_gemv``)."""
    M, K = x2.shape
    N = weight.shape[0]
    bm, bn, bk, warps = _dot_config(M, N, K, half)
    tune = tune or {}
    bn, bk, warps = tune.get("block_n", bn), tune.get("block_k", bk), tune.get("warps", warps)
    walk = tune.get("walk", 1)
    prec = "ieee" if x2.dtype == torch.float32 else "tf32"  # fp32 must not silently drop to tf32
    words = weight.view(torch.int32)
    xh, xf = half_rows(x2) if half else (x2, out)  # (xf never read without HALF)
    _nvfp4_dot_kernel[(triton.cdiv(M, bm), triton.cdiv(N, bn * walk))](
        xh, xf, words, weight_scale, weight_scale_2, bias if bias is not None else out, out, M, N, K,
        xh.stride(0), words.stride(0), weight_scale.stride(0), out.stride(0),
        HAS_BIAS=bias is not None, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, NUM_STAGES=tune.get("stages", _NUM_STAGES),
        DOT_PREC=prec, HALF=half, EVEN=half and N % (bn * walk) == 0 and K % bk == 0,
        ASM=x2.is_cuda if asm is None else asm, WALK=walk, num_warps=warps,
        **pdl_launch(xh),
    )  # fmt: skip


def pick_path(M: int, N: int, K: int = 0, dtype: Optional[torch.dtype] = None) -> str:
    """``gemv`` (CUDA cores, fp32), ``half`` (CUDA cores, packed half), ``dot`` (tensor cores) or ``half_dot``
    (tensor cores, fp16 tiles) for ``M`` rows of x (``dtype``) against an ``N x K`` weight."""
    if dtype in (torch.bfloat16, torch.float16) and N * K >= HALF_MIN_WEIGHTS:
        if M <= HALF_AUTO_MAX_M:
            return "half"
        if M <= HALF_DOT_AUTO_MAX_M:
            return "half_dot"
    if M <= GEMV_MAX_M or (M <= GEMV_MAX_M_FEW_ROWS and triton.cdiv(N, _dot_config(M, N, 16)[1]) < sm_count()):
        return "gemv"
    return "dot"


def launch_variant(M: int, N: int, K: int, dtype: Optional[torch.dtype] = None) -> tuple:
    """What ``M`` rows against an ``N x K`` weight compile: the path ``pick_path`` takes and the launch settings that
    depend on ``M`` (the start-up warm-up reaches each one a step's token count can take; tests check it)."""
    path = pick_path(M, N, K, dtype)
    if path in ("dot", "half_dot"):
        return (path, *_dot_config(M, N, K, path == "half_dot"))
    tile = _HALF_TILES[M == 1] if path == "half" else (_GEMV_TILE, 64)
    return (path, *_gemv_config(M, N, K, *tile))


def nvfp4_linear_triton(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    weight_scale_2: torch.Tensor,
    bias: Optional[torch.Tensor] = None,
    path: str = "auto",
    tune: Optional[dict] = None,
) -> torch.Tensor:
    """Same contract as ``nvfp4_linear_torch``; CUDA, or CPU under TRITON_INTERPRET=1. Rows of x may be strided
    (last dim contiguous); the weight and its scales must be row-major with contiguous rows. ``path``: ``auto``
    (by M), or ``gemv`` (M <= 8) / ``half`` (16-bit x, M <= 4) / ``dot`` / ``half_dot`` (16-bit x) pinned (tests
    and the benchmark compare them); ``tune`` overrides the chosen path's launch settings (``TUNE_KEYS``)."""
    assert triton is not None, "triton is not installed"
    K = x.shape[-1]
    N = weight.shape[0]
    assert weight.shape[1] * 2 == K and weight_scale.shape == (N, K // nvfp4.BLOCK), "NVFP4 shapes do not match x"
    x2 = x.reshape(-1, K)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    M = x2.shape[0]
    out = torch.empty(M, N, dtype=x.dtype, device=x.device)
    if path == "auto":
        path = pick_path(M, N, K, x.dtype)
    sixteen_bit = x.dtype in (torch.bfloat16, torch.float16)
    assert (
        path == "dot"
        or (path == "gemv" and M <= 8)
        or (path == "half" and M <= HALF_MAX_M and sixteen_bit)
        or (path == "half_dot" and sixteen_bit)
    ), f"unknown path {path!r} for M={M}, {x.dtype}"
    if M > 0 and N > 0:
        scale_bytes = weight_scale.view(torch.uint8)  # E4M3 bits, decoded in the kernel
        if tune and set(tune) - set(TUNE_KEYS[path]):
            raise ValueError(f"unknown {path} settings {sorted(set(tune) - set(TUNE_KEYS[path]))}")
        g = weight_scale_2.reshape(())
        if path in ("dot", "half_dot"):
            _launch_dot(x2, weight, scale_bytes, g, bias, out, tune, half=path == "half_dot")
        else:
            _launch_gemv(x2, weight, scale_bytes, g, bias, out, tune, half=path == "half")
    return out.view(*x.shape[:-1], N)


def nvfp4_linear(x, weight, weight_scale, weight_scale_2, bias=None) -> torch.Tensor:
    """Triton on CUDA tensors, the torch reference elsewhere."""
    fn = nvfp4_linear_triton if x.is_cuda and triton is not None else nvfp4_linear_torch
    return fn(x, weight, weight_scale, weight_scale_2, bias)
