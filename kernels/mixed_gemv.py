"""One launch for a decode-sized projection whose output rows come in up to three formats: BF16 (or the activation
dtype), FP8 E4M3 with a scale per row, NVFP4 with a global scale per row. Beside its torch reference.

    x [M, K], M <= MAX_M
    dense  [Nd, K] in x's dtype                                          -> out[:, d_col : d_col + Nd]
    fp8    e4m3 bytes [Nf, K], scale fp32 [Nf] (or one, stride 0)        -> out[:, f_col : f_col + Nf]
    nvfp4  packed [Nn, K/2], e4m3 block scales [Nn, K/16], global fp32 [Nn] (or one) -> out[:, n_col : n_col + Nn]

Why: in a decode step every projection is a GEMV of a few microseconds, and a fused projection whose parts have
different formats ran as one kernel per part plus a concatenation. Qwen3.6's NVFP4 checkpoint (ModelOpt
``MIXED_PRECISION``) has them everywhere: the MoE block's router and shared-expert gate (BF16) beside its shared
gate|up (NVFP4), the GDN input projection's qkv|z (FP8) beside b|a (BF16), q|k|v (FP8, one W8A8 GEMM and one
activation quantization each). On the H200 that made ~1,100 kernels a token (the BF16 model ~500) and 5.7 ms a step.
Here each program takes a block of rows of one format (the format is the program's, so there is no divergence), runs
all of K and writes its columns of the one output.

FP8 runs W8A16 here: the weight bytes are decoded to floats in registers (``e4m3_word``: placed into the fp16 bit
pattern, exact, subnormals included), the activations stay in x's dtype; that is the reference's arithmetic
(``fp8_linear_torch`` dequantizes the weight) and closer to it than the W8A8 GEMM prefill takes. NVFP4 reuses the
W4A16 GEMV's decode (``nvfp4_tiles.py``). All sums are fp32; the scales multiply once per row at the end (the NVFP4
block scales once per 16 weights). Nothing is read back on the host and the grid depends only on the shapes:
CUDA-graph capturable. ``mixed_gemv_torch`` is the reference: each format's reference, concatenated.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Optional

import torch
import torch.nn.functional as F

from ..quant import nvfp4
from .device_sms import scaled

try:  # keep the reference importable without triton
    import triton
    import triton.language as tl

    from .nvfp4_tiles import block_scale, e2m1_word, f16_halves, gemv_row
    from .pdl import pdl_launch, pdl_prefetch_rows, pdl_wait_then_release
except Exception:  # pragma: no cover
    triton = None
    tl = None

# rows of x the kernel takes (one fp32 accumulator tile per row); larger batches run GEMMs
MAX_M = 4
# ... and for projections with FP8 rows: from three rows of x the W8A8 GEMMs of the per-part path win on the H200
# (2026-12-02, bench/nvfp4_kernel_bench.py --groups mixed: GDN in_proj 38.9 us here against 27.5, q|k|v 32 vs 19), while
# at one or two rows this kernel does (in_proj 12.5 vs 28.5 us, q|k|v 12.2 vs 19.0, o_proj 7.9 vs 9.3); without FP8
# rows it wins up to four (the MoE block's router | shared expert: 5.7 vs 20.6 us)
FP8_MAX_M = 2
# weights of a row per step (NVFP4: the same count, as BLOCK_K / 8 words; FP8 as BLOCK_K / 4 words): 256 where a
# program has 16-32 rows, 512 where the projection is small enough that the grid runs 4-8 rows a program, so that
# each step still has a few KB of loads in flight. H200, 2026-12-02 (bench/nvfp4_kernel_bench.py --groups mixed
# --mixed-block-k): at one row of x, 512 took o_proj 7.3 -> 5.9 us, the MoE router|shared 4.8 -> 3.9, the shared
# expert's down 2.7 -> 2.3, but GDN in_proj 10.1 -> 11.5 (20.4 at two rows); 128 at three or four rows of x ran 2-4x
# slower than 256.
_BLOCK_K = 256
_BLOCK_K_FEW_ROWS = 512
# about two programs per SM (the H200's 132): these projections are 1-25 MB, a program streams a block of rows
_TARGET_PROGRAMS = 264
_NUM_STAGES = 3


@dataclass
class MixedRows:
    """The row blocks of one projection, each optional (``None``), in output order dense? fp8? nvfp4? given by the
    column offsets. Tensors are row-major with contiguous rows; scales are 1-D per row or 0-d (one for all rows)."""

    K: int
    dense: Optional[torch.Tensor] = None  # [Nd, K]
    fp8_weight: Optional[torch.Tensor] = None  # float8_e4m3fn [Nf, K]
    fp8_scale: Optional[torch.Tensor] = None  # fp32 [Nf] or []
    nvfp4_weight: Optional[torch.Tensor] = None  # uint8 [Nn, K/2]
    nvfp4_scale: Optional[torch.Tensor] = None  # float8_e4m3fn [Nn, K/16]
    nvfp4_global: Optional[torch.Tensor] = None  # fp32 [Nn] or []
    dense_col: int = 0
    fp8_col: int = 0
    nvfp4_col: int = 0

    def tensors(self) -> dict[str, torch.Tensor]:
        """The fields that hold tensors (the others are sizes and column offsets)."""
        return {f.name: getattr(self, f.name) for f in fields(self) if isinstance(getattr(self, f.name), torch.Tensor)}

    @property
    def rows(self) -> tuple[int, int, int]:
        return tuple(0 if w is None else w.shape[0] for w in (self.dense, self.fp8_weight, self.nvfp4_weight))

    @property
    def max_m(self) -> int:
        """The most rows of x this projection takes the kernel for (``FP8_MAX_M`` when it has FP8 rows)."""
        return FP8_MAX_M if self.rows[1] else MAX_M

    @property
    def out_features(self) -> int:
        nd, nf, nn_ = self.rows
        return max(self.dense_col + nd, self.fp8_col + nf, self.nvfp4_col + nn_)


# ----------------------------------------------------------------------------------------------------------------------
# torch reference
# ----------------------------------------------------------------------------------------------------------------------


def mixed_gemv_torch(x: torch.Tensor, rows: MixedRows) -> torch.Tensor:
    """Each block through its format's reference (weights dequantized to x's dtype, then ``F.linear``), written to
    its columns."""
    x2 = x.reshape(-1, rows.K)
    out = x2.new_zeros(x2.shape[0], rows.out_features)
    nd, nf, nn_ = rows.rows
    if nd:
        out[:, rows.dense_col : rows.dense_col + nd] = F.linear(x2, rows.dense)
    if nf:
        w = rows.fp8_weight.float() * rows.fp8_scale.float().reshape(-1, 1)
        out[:, rows.fp8_col : rows.fp8_col + nf] = F.linear(x2, w.to(x.dtype))
    if nn_:
        g = rows.nvfp4_global.float()
        one = torch.ones((), dtype=torch.float32, device=g.device)  # the global scale per row, below
        w = nvfp4.dequantize(rows.nvfp4_weight, rows.nvfp4_scale, one, torch.float32)
        w = w * (g.reshape(-1, 1) if g.dim() else g)
        out[:, rows.nvfp4_col : rows.nvfp4_col + nn_] = F.linear(x2, w.to(x.dtype))
    return out.view(*x.shape[:-1], rows.out_features)


# ----------------------------------------------------------------------------------------------------------------------
# Triton
# ----------------------------------------------------------------------------------------------------------------------

if triton is not None:

    @triton.jit
    def e4m3_word(w):
        """int32 words of four E4M3 bytes (weight 4j + p in bits 8p..8p+7) -> ``v0..v3``: weight 4j + p as
        ``e4m3 * 2^-8`` in fp32, each shaped like ``w`` (``* 256`` is the caller's, once per row). A byte's 7
        magnitude bits placed at fp16 bits 7..13 and its sign at bit 15 make an fp16 equal to that value exactly
        (subnormals too); bytes 0 and 2 are placed as an fp16 pair in one register and bytes 1 and 3 in another, two
        weights per 32-bit operation, which the half -> float conversions split."""
        w = w.to(tl.uint32, bitcast=True)
        v0, v2 = f16_halves(((w & 0x00800080) << 8) | ((w & 0x007F007F) << 7))
        v1, v3 = f16_halves((w & 0x80008000) | ((w >> 1) & 0x3F803F80))
        return v0, v1, v2, v3

    @triton.jit
    def split4(x, COLS: tl.constexpr):
        """``x [4 * COLS]`` -> ``x0..x3 [COLS]`` with ``xp[c] = x[4c + p]`` (the activations of ``e4m3_word``'s
        ``vp``), fp32: one contiguous load, split by register renaming."""
        x = tl.reshape(x.to(tl.float32), (COLS, 2, 2))  # [c, p // 2, p % 2]
        e, o = tl.split(x)
        x0, x2 = tl.split(e)
        x1, x3 = tl.split(o)
        return x0, x1, x2, x3

    @triton.jit
    def _word_row_products(v0, v1, v2, v3, x_ptr, m, M, stride_xm, k0, offs_x, x_mask, WORDS: tl.constexpr):
        """Row ``m`` of x against a decoded FP8 step (``e4m3_word``'s ``v0..v3 [BLOCK_N, WORDS]``): per word the sum
        of its four products (summed over the words after the loop)."""
        xm = tl.load(x_ptr + m * stride_xm + k0 + offs_x, mask=x_mask & (offs_x * 0 + m < M), other=0.0)
        x0, x1, x2, x3 = split4(xm, WORDS)
        d = v0 * x0[None, :]  # one chain: each line a fused multiply-add
        d += v1 * x1[None, :]
        d += v2 * x2[None, :]
        d += v3 * x3[None, :]
        return d

    # FP8 rows in packed half precision (``fma.rn.f16x2`` on E4M3 bytes placed as fp16 pairs) were tried and timed
    # slower on the H200, 2026-12-04: M=1 o_proj 6.1 -> 8.4 us, q|k|v 9.9 -> 10.6; M=2 in_proj 13.7 -> 16.1
    # (bench/results/2026-12-04-h200-mixed-fp8-half-ab.txt): FP8 rows are a byte a weight, nearer HBM-bound, so the
    # pair decode costs more than it saves.
    @triton.jit
    def _fp8_rows(
        w_ptrs, n_mask, x_ptr, M, stride_xm,
        K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
        NUM_STAGES: tl.constexpr,
    ):  # fmt: skip
        """FP8 rows (``w_ptrs [BLOCK_N, BLOCK_K / 4]`` int32 words of four bytes, at k = 0) times rows 0..3 of x:
        four ``[BLOCK_N]`` sums of ``e4m3 * 2^-8 * x`` (zeros for rows past ``BLOCK_M``). Read as words (16-byte
        loads, no per-byte unpacking) and decoded once for every row of x."""
        WORDS: tl.constexpr = BLOCK_K // 4
        offs_w = tl.arange(0, WORDS)
        offs_x = tl.arange(0, BLOCK_K)
        a0 = tl.zeros((BLOCK_N, WORDS), dtype=tl.float32)
        a1 = tl.zeros((BLOCK_N, WORDS), dtype=tl.float32)
        a2 = tl.zeros((BLOCK_N, WORDS), dtype=tl.float32)
        a3 = tl.zeros((BLOCK_N, WORDS), dtype=tl.float32)
        for k0 in tl.range(0, K, BLOCK_K, num_stages=NUM_STAGES):
            w_mask = n_mask[:, None] & ((k0 // 4 + offs_w) < K // 4)[None, :]
            w = tl.load(w_ptrs + k0 // 4, mask=w_mask, other=0).to(tl.int32)  # (a no-op; see the dummies)
            v0, v1, v2, v3 = e4m3_word(w)
            x_mask = (k0 + offs_x) < K
            a0 += _word_row_products(v0, v1, v2, v3, x_ptr, 0, M, stride_xm, k0, offs_x, x_mask, WORDS)
            if BLOCK_M > 1:
                a1 += _word_row_products(v0, v1, v2, v3, x_ptr, 1, M, stride_xm, k0, offs_x, x_mask, WORDS)
            if BLOCK_M > 2:
                a2 += _word_row_products(v0, v1, v2, v3, x_ptr, 2, M, stride_xm, k0, offs_x, x_mask, WORDS)
                a3 += _word_row_products(v0, v1, v2, v3, x_ptr, 3, M, stride_xm, k0, offs_x, x_mask, WORDS)
        return tl.sum(a0, 1), tl.sum(a1, 1), tl.sum(a2, 1), tl.sum(a3, 1)

    @triton.jit
    def _row_products(w, x_ptr, m, M, stride_xm, k0, offs_k, k_mask):
        """Row ``m`` of x against a decoded ``[BLOCK_N, BLOCK_K]`` step: the products (summed after the loop)."""
        xm = tl.load(x_ptr + m * stride_xm + k0 + offs_k, mask=k_mask & (offs_k * 0 + m < M), other=0.0)
        return w * xm.to(tl.float32)[None, :]

    @triton.jit
    def _dense_rows(
        w_ptrs, n_mask, x_ptr, M, stride_xm,
        K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
        NUM_STAGES: tl.constexpr,
    ):  # fmt: skip
        """Dense rows (``w_ptrs [BLOCK_N, BLOCK_K]`` at k = 0) times rows 0..3 of x: four ``[BLOCK_N]`` sums (zeros
        for rows past ``BLOCK_M``)."""
        offs_k = tl.arange(0, BLOCK_K)
        a0 = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
        a1 = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
        a2 = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
        a3 = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
        for k0 in tl.range(0, K, BLOCK_K, num_stages=NUM_STAGES):
            k_mask = (k0 + offs_k) < K
            w = tl.load(w_ptrs + k0, mask=n_mask[:, None] & k_mask[None, :], other=0.0).to(tl.float32)
            a0 += _row_products(w, x_ptr, 0, M, stride_xm, k0, offs_k, k_mask)
            if BLOCK_M > 1:
                a1 += _row_products(w, x_ptr, 1, M, stride_xm, k0, offs_k, k_mask)
            if BLOCK_M > 2:
                a2 += _row_products(w, x_ptr, 2, M, stride_xm, k0, offs_k, k_mask)
                a3 += _row_products(w, x_ptr, 3, M, stride_xm, k0, offs_k, k_mask)
        return tl.sum(a0, 1), tl.sum(a1, 1), tl.sum(a2, 1), tl.sum(a3, 1)

    @triton.jit
    def _nvfp4_rows(
        w_ptrs, s_ptrs, n_mask, x_ptr, M, stride_xm,
        K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
        NUM_STAGES: tl.constexpr,
    ):  # fmt: skip
        """NVFP4 rows (``w_ptrs [BLOCK_N, BLOCK_K / 8]`` words, ``s_ptrs [BLOCK_N, BLOCK_K / 16]`` scale bytes, at
        k = 0) times rows 0..3 of x: four ``[BLOCK_N]`` sums of ``e2m1 * block scale * x``. The decode is
        ``nvfp4_tiles``' (the W4A16 GEMV's), shared by the rows of x."""
        BW: tl.constexpr = BLOCK_K // 8
        NB: tl.constexpr = BLOCK_K // 16
        offs_w = tl.arange(0, BW)
        offs_s = tl.arange(0, NB)
        offs_x = tl.arange(0, BLOCK_K)
        b0 = tl.zeros((BLOCK_N, NB), dtype=tl.float32)
        b1 = tl.zeros((BLOCK_N, NB), dtype=tl.float32)
        b2 = tl.zeros((BLOCK_N, NB), dtype=tl.float32)
        b3 = tl.zeros((BLOCK_N, NB), dtype=tl.float32)
        for k0 in tl.range(0, K, BLOCK_K, num_stages=NUM_STAGES):
            w_mask = n_mask[:, None] & ((k0 // 8 + offs_w) < K // 8)[None, :]
            s_mask = n_mask[:, None] & ((k0 // 16 + offs_s) < K // 16)[None, :]
            w = tl.load(w_ptrs + k0 // 8, mask=w_mask, other=0).to(tl.int32)  # (a no-op; see the dummies)
            scale = block_scale(tl.load(s_ptrs + k0 // 16, mask=s_mask, other=0))
            x_mask = (k0 + offs_x) < K
            v0, v1, v2, v3, v4, v5, v6, v7 = e2m1_word(w)
            b0 += gemv_row(
                v0, v1, v2, v3, v4, v5, v6, v7, scale, x_ptr, 0, M, stride_xm, k0, x_mask, offs_x, BLOCK_N, BW
            )
            if BLOCK_M > 1:
                b1 += gemv_row(
                    v0, v1, v2, v3, v4, v5, v6, v7, scale, x_ptr, 1, M, stride_xm, k0, x_mask, offs_x, BLOCK_N, BW
                )
            if BLOCK_M > 2:
                b2 += gemv_row(
                    v0, v1, v2, v3, v4, v5, v6, v7, scale, x_ptr, 2, M, stride_xm, k0, x_mask, offs_x, BLOCK_N, BW
                )
                b3 += gemv_row(
                    v0, v1, v2, v3, v4, v5, v6, v7, scale, x_ptr, 3, M, stride_xm, k0, x_mask, offs_x, BLOCK_N, BW
                )
        return tl.sum(b0, 1), tl.sum(b1, 1), tl.sum(b2, 1), tl.sum(b3, 1)

    @triton.jit
    def _store_row(y, m, M, out_ptr, stride_om, col, offs_n, n_mask):
        mask = n_mask & (offs_n * 0 + m < M)
        tl.store(out_ptr + m * stride_om + col + offs_n, y.to(out_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def program_format(pid, d_progs, f_progs, HAS_DENSE: tl.constexpr, HAS_FP8: tl.constexpr, HAS_NVFP4: tl.constexpr):
        """``(dense, fp8)``: whether program ``pid`` takes dense rows, else FP8 rows, else NVFP4 rows (the mixed
        kernels' programs map to the row blocks in that order). A format the projection lacks (``format_flags``) is
        False when the kernel compiles, so its branch is not compiled."""
        ONLY_DENSE: tl.constexpr = not HAS_FP8 and not HAS_NVFP4
        dense = HAS_DENSE and (ONLY_DENSE or pid < d_progs)
        fp8 = HAS_FP8 and (not HAS_NVFP4 or pid < d_progs + f_progs)
        return dense, fp8

    @triton.jit
    def prefetch_program_rows(
        pid, d_progs, f_progs, d_ptr, f_ptr, n_ptr, ns_ptr, Nd, Nf, Nn, stride_d, stride_f, stride_n, stride_ns, K,
        BLOCK_N: tl.constexpr, PDL: tl.constexpr, HAS_DENSE: tl.constexpr, HAS_FP8: tl.constexpr,
        HAS_NVFP4: tl.constexpr,
    ):  # fmt: skip
        """``FREETOKEN_PDL=prefetch`` (``kernels/pdl.py``), before the wait: the first lines of this program's rows
        of one format (and of their NVFP4 block scales) into L2; this kernel's and ``mixed_dot``'s programs map to
        the formats alike (``format_flags``)."""
        if PDL == 2:
            offs_b = tl.arange(0, BLOCK_N)
            dense, fp8 = program_format(pid, d_progs, f_progs, HAS_DENSE, HAS_FP8, HAS_NVFP4)
            if dense:
                pdl_prefetch_rows(d_ptr, pid * BLOCK_N + offs_b, stride_d, Nd, 0, K, 2, PDL)
            elif fp8:
                f_len = K * 8 // f_ptr.dtype.element_ty.primitive_bitwidth  # fp8 rows as bytes or as words
                pdl_prefetch_rows(f_ptr, (pid - d_progs) * BLOCK_N + offs_b, stride_f, Nf, 0, f_len, 2, PDL)
            else:
                rows = (pid - d_progs - f_progs) * BLOCK_N + offs_b
                pdl_prefetch_rows(n_ptr, rows, stride_n, Nn, 0, K // 8, 2, PDL)
                pdl_prefetch_rows(ns_ptr, rows, stride_ns, Nn, 0, K // 16, 1, PDL)

    @triton.jit
    def _mixed_gemv_kernel(
        x_ptr,  # [M, K]
        out_ptr,  # [M, >= every block's columns]
        d_ptr,  # dense [Nd, K]
        f_ptr,  # fp8 bytes [Nf, K]
        fs_ptr,  # fp32 per-row scale [Nf] (stride_fs 0: one scale)
        n_ptr,  # nvfp4 int32 words [Nn, K/8]
        ns_ptr,  # nvfp4 block scale bytes [Nn, K/16]
        ng_ptr,  # fp32 per-row global scale [Nn] (stride_ng 0: one)
        M,
        Nd,
        Nf,
        Nn,
        d_progs,  # programs of the dense rows, then of the fp8 rows; the rest take the nvfp4 rows
        f_progs,
        d_col,
        f_col,
        n_col,
        stride_xm,
        stride_om,
        stride_d,
        stride_f,
        stride_fs,
        stride_n,
        stride_ns,
        stride_ng,
        K: tl.constexpr,
        BLOCK_M: tl.constexpr,  # 1, 2 or 4 rows of x
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
        NUM_STAGES: tl.constexpr,
        PDL: tl.constexpr = False,  # kernels/pdl.py
        HAS_DENSE: tl.constexpr = True,  # which formats the projection has (``format_flags``)
        HAS_FP8: tl.constexpr = True,
        HAS_NVFP4: tl.constexpr = True,
    ):
        prefetch_program_rows(
            tl.program_id(0), d_progs, f_progs, d_ptr, f_ptr, n_ptr, ns_ptr, Nd, Nf, Nn, stride_d, stride_f, stride_n,
            stride_ns, K, BLOCK_N, PDL, HAS_DENSE, HAS_FP8, HAS_NVFP4,
        )  # fmt: skip
        pdl_wait_then_release(PDL)
        pid = tl.program_id(0)
        offs_b = tl.arange(0, BLOCK_N)
        # each branch: its rows, their sums against rows 0..3 of x, the per-row scale, the first output column; a
        # format the projection lacks has no branch compiled (``program_format``)
        dense, fp8 = program_format(pid, d_progs, f_progs, HAS_DENSE, HAS_FP8, HAS_NVFP4)
        if dense:
            offs_n = pid * BLOCK_N + offs_b
            n_mask = offs_n < Nd
            d_ptrs = d_ptr + offs_n[:, None].to(tl.int64) * stride_d + tl.arange(0, BLOCK_K)[None, :]
            y0, y1, y2, y3 = _dense_rows(d_ptrs, n_mask, x_ptr, M, stride_xm, K, BLOCK_M, BLOCK_N, BLOCK_K, NUM_STAGES)
            row_scale = tl.full((BLOCK_N,), 1.0, tl.float32)
            col = d_col
        elif fp8:
            offs_n = (pid - d_progs) * BLOCK_N + offs_b
            n_mask = offs_n < Nf
            f_ptrs = f_ptr + offs_n[:, None].to(tl.int64) * stride_f + tl.arange(0, BLOCK_K // 4)[None, :]
            y0, y1, y2, y3 = _fp8_rows(f_ptrs, n_mask, x_ptr, M, stride_xm, K, BLOCK_M, BLOCK_N, BLOCK_K, NUM_STAGES)
            row_scale = (
                tl.load(fs_ptr + offs_n * stride_fs, mask=n_mask, other=0.0).to(tl.float32) * 256.0
            )  # undoes the 2^-8
            col = f_col
        else:
            offs_n = (pid - d_progs - f_progs) * BLOCK_N + offs_b
            n_mask = offs_n < Nn
            rows = offs_n[:, None].to(tl.int64)
            n_ptrs = n_ptr + rows * stride_n + tl.arange(0, BLOCK_K // 8)[None, :]
            ns_ptrs = ns_ptr + rows * stride_ns + tl.arange(0, BLOCK_K // 16)[None, :]
            y0, y1, y2, y3 = _nvfp4_rows(
                n_ptrs, ns_ptrs, n_mask, x_ptr, M, stride_xm, K, BLOCK_M, BLOCK_N, BLOCK_K, NUM_STAGES
            )
            row_scale = tl.load(ng_ptr + offs_n * stride_ng, mask=n_mask, other=0.0).to(tl.float32)
            col = n_col
        _store_row(y0 * row_scale, 0, M, out_ptr, stride_om, col, offs_n, n_mask)
        if BLOCK_M > 1:
            _store_row(y1 * row_scale, 1, M, out_ptr, stride_om, col, offs_n, n_mask)
        if BLOCK_M > 2:
            _store_row(y2 * row_scale, 2, M, out_ptr, stride_om, col, offs_n, n_mask)
            _store_row(y3 * row_scale, 3, M, out_ptr, stride_om, col, offs_n, n_mask)


def _block_n(rows: tuple[int, int, int]) -> int:
    """Rows a program: 32 down to 4 until the grid has about ``_TARGET_PROGRAMS`` programs."""
    bn, target = 32, scaled(_TARGET_PROGRAMS)
    while bn > 4 and sum(triton.cdiv(r, bn) for r in rows) < target:
        bn //= 2
    return bn


def _block_k(block_n: int) -> int:
    """Weights of a row per K step for programs of ``block_n`` rows (``_BLOCK_K_FEW_ROWS`` says why)."""
    return _BLOCK_K_FEW_ROWS if block_n <= 8 else _BLOCK_K


def supports(rows: MixedRows) -> bool:
    """The kernel's shape rules: K a multiple of 16 (the NVFP4 block; every row 16-byte aligned for wide loads)."""
    return rows.K % 16 == 0


# where the kernel runs: auto (CUDA, small M), on (also on CPU: tests under the Triton interpreter), off
MODES = ("auto", "on", "off")


def use_mixed_gemv(x: torch.Tensor, rows: Optional[MixedRows], mode: str = "auto") -> bool:
    """Whether ``x`` takes the kernel over ``rows``: at most ``rows.max_m`` rows (4; 2 with FP8 rows), shapes the
    kernel takes, CUDA (``auto``) or anywhere (``on``). The one dispatch rule of the fused projections and the lone
    quantized Linears."""
    return 0 < candidate_rows(x, rows, mode) <= rows.max_m


def candidate_rows(x: torch.Tensor, rows: Optional[MixedRows], mode: str = "auto") -> int:
    """The rows of ``x`` where a mixed kernel may take it over ``rows`` at all (shapes the kernels take; CUDA under
    ``auto``, anywhere under ``on``), else 0; the mixed kernels' dispatch rules add their row bounds."""
    if mode not in MODES:
        raise ValueError(f"unknown mixed GEMV mode {mode!r} (one of {', '.join(MODES)})")
    if rows is None or mode == "off" or x.numel() == 0 or not supports(rows) or not (mode == "on" or x.is_cuda):
        return 0
    return x.numel() // x.shape[-1]


def flat_rows(x: torch.Tensor, rows: MixedRows) -> tuple[torch.Tensor, torch.Tensor]:
    """x as ``[M, K]`` with contiguous rows, and the ``[M, out_features]`` output the mixed kernels write."""
    x2 = x.reshape(-1, rows.K)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    return x2, torch.empty(x2.shape[0], rows.out_features, dtype=x.dtype, device=x.device)


def launch_args(rows: MixedRows, x2: torch.Tensor, out: torch.Tensor, block_n: int, fp8_view: torch.dtype):
    """``(programs, args)``: the grid size and the leading arguments (``x_ptr`` .. ``stride_ng``) the mixed kernels
    share, for programs of ``block_n`` rows; FP8 weights viewed as ``fp8_view`` (int32 words, or bytes). A block with
    no rows has no programs and its pointers are never read, but a kernel compiles its branch for the pointer types:
    an empty tensor (no allocation) of the type that branch decodes stands in."""
    nd, nf, nn_ = rows.rows
    d_progs, f_progs, n_progs = (triton.cdiv(r, block_n) for r in rows.rows)

    def stand_in(dtype):
        return torch.empty(0, dtype=dtype, device=x2.device)

    dense = rows.dense if nd else stand_in(x2.dtype)
    f_w = rows.fp8_weight.view(fp8_view) if nf else stand_in(fp8_view)
    f_s = rows.fp8_scale if nf else stand_in(torch.float32)
    n_w = rows.nvfp4_weight.view(torch.int32) if nn_ else stand_in(torch.int32)
    n_s = rows.nvfp4_scale.view(torch.uint8) if nn_ else stand_in(torch.uint8)
    n_g = rows.nvfp4_global if nn_ else stand_in(torch.float32)
    args = (
        x2, out, dense, f_w, f_s, n_w, n_s, n_g, x2.shape[0], nd, nf, nn_, d_progs, f_progs,
        rows.dense_col, rows.fp8_col, rows.nvfp4_col, x2.stride(0), out.stride(0),
        dense.stride(0) if nd else 0, f_w.stride(0) if nf else 0, f_s.stride(0) if nf and f_s.dim() else 0,
        n_w.stride(0) if nn_ else 0, n_s.stride(0) if nn_ else 0, n_g.stride(0) if nn_ and n_g.dim() else 0,
    )  # fmt: skip
    return d_progs + f_progs + n_progs, args


def format_flags(rows: MixedRows) -> dict:
    """The mixed kernels' ``HAS_DENSE`` / ``HAS_FP8`` / ``HAS_NVFP4``: which row formats ``rows`` has. A kernel
    compiles only those branches, and its registers are those of its hungriest branch: GDN in_proj (BF16 + FP8 rows)
    through ``mixed_dot`` took 238 a thread for the NVFP4 branch it never runs, 138 without it (sm_90, 32-row
    programs, 256-weight K steps). Fixed per projection, so each projection compiles one variant."""
    nd, nf, nn_ = rows.rows
    return {"HAS_DENSE": nd > 0, "HAS_FP8": nf > 0, "HAS_NVFP4": nn_ > 0}


def mixed_gemv_triton(x: torch.Tensor, rows: MixedRows) -> torch.Tensor:
    """``mixed_gemv_torch``'s contract for ``x [..., K]`` with at most ``MAX_M`` rows; CUDA, or CPU under
    TRITON_INTERPRET=1."""
    assert triton is not None, "triton is not installed"
    x2, out = flat_rows(x, rows)
    M = x2.shape[0]
    assert M <= MAX_M and supports(rows), (M, rows.K)
    if M == 0 or sum(rows.rows) == 0:
        return out.view(*x.shape[:-1], rows.out_features)
    bn = _block_n(rows.rows)
    programs, args = launch_args(rows, x2, out, bn, torch.int32)  # FP8 as words of four bytes
    _mixed_gemv_kernel[(programs,)](
        *args, K=rows.K, BLOCK_M=triton.next_power_of_2(M), BLOCK_N=bn, BLOCK_K=_block_k(bn), NUM_STAGES=_NUM_STAGES,
        num_warps=4, **format_flags(rows),
        **pdl_launch(x2),
    )  # fmt: skip
    return out.view(*x.shape[:-1], rows.out_features)
