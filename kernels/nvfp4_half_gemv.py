"""The building blocks of the NVFP4 GEMV in packed half precision, ~40 % fewer instructions a weight than the fp32
GEMV: ``half_pairs`` (x packed), ``half_decode`` and ``half_row`` (a step), used under a ``HALF`` constexpr by
``nvfp4_linear``'s GEMV (decode-sized steps on large weights, the lm_head, with 16-bit x) and by the MoE decode
GEMVs of batched steps (``nvfp4_moe``).

Why: the fp32 GEMV (``nvfp4_linear._nvfp4_gemv_kernel``) is bound by its instructions, not by HBM (~5.8 a weight at
one row of x, sm_90 SASS: four bit operations place a pair of codes as two fp16 bit patterns, then per weight a
half -> float conversion and an fp32 multiply-add). Here the placed pair is used as it is, as the left operand of
one ``fma.rn.f16x2`` (two multiply-adds in one instruction) whose right operand holds the two matching activations
in fp16: per weight the placement's two operations and half a multiply-add a row of x, and per 16-weight block (one
E4M3 scale) one conversion of the two running half sums to fp32, where the scale and the block's sum into the row's
fp32 accumulator are applied (~3.6 a weight at one row).

Numbers, exact where they can be:
- Codes placed as fp16 are ``e2m1 * 2^-14`` exactly (``nvfp4_tiles.e2m1_pairs``).
- Activations: each row of x is scaled by a power of two ``2^s`` chosen from its largest magnitude (``2^12 <=
  max|x| * 2^s < 2^13``; ``_half_pairs_kernel``, one small launch before the GEMV), so the fp16 copy of a bf16
  activation is exact (bf16's 8 significant bits fit fp16's 11 wherever the value stays in fp16's normal range,
  i.e. above ``2^-26`` of the row's largest) and no product or block sum can overflow: a product is at most
  ``6 * 2^-14 * 2^13 = 3``, a lane's block sum of 8 products at most 24.
- What is not exact: each of the two fp16 lanes sums 8 products with fp16 rounding (2^-11 relative a step) before
  the block leaves for fp32. That is below bf16's own rounding of x (2^-9), so the path is used for bf16 and fp16
  activations only; fp32 activations keep the fp32 GEMV.

``half2_dot8`` is the instruction sequence (inline PTX on CUDA); under the CPU interpreter, which runs no PTX, it
is emulated with the same fp16 roundings (``ASM=False``), so the interpreter tests check the same arithmetic.
"""

from __future__ import annotations

import torch

try:  # keep the package importable without triton
    import triton
    import triton.language as tl

    from .nvfp4_tiles import e2m1_pairs, f16_bits, half_tile_columns, load8, pair_bits
    from .pdl import pdl_launch, pdl_wait_then_release
except Exception:  # pragma: no cover
    triton = None
    tl = None

# A row's scale puts its largest |x| in [2^12, 2^13) (see the module docstring's bounds)
_TOP_EXPONENT = 12

if triton is not None:
    # eight f16x2 multiply-adds (the first a multiply), then the two lanes added in fp32: $0 = out, $1..$8 the weight
    # pairs, $9..$16 the activation pairs
    _HALF2_DOT8 = tl.constexpr(
        """
        {
        .reg .b32 acc;
        .reg .b16 lo, hi;
        .reg .f32 flo, fhi;
        mul.rn.f16x2 acc, $1, $9;
        fma.rn.f16x2 acc, $2, $10, acc;
        fma.rn.f16x2 acc, $3, $11, acc;
        fma.rn.f16x2 acc, $4, $12, acc;
        fma.rn.f16x2 acc, $5, $13, acc;
        fma.rn.f16x2 acc, $6, $14, acc;
        fma.rn.f16x2 acc, $7, $15, acc;
        fma.rn.f16x2 acc, $8, $16, acc;
        mov.b32 {lo, hi}, acc;
        cvt.f32.f16 flo, lo;
        cvt.f32.f16 fhi, hi;
        add.f32 $0, flo, fhi;
        }
        """
    )
    _HALF2_DOT8_REGS = tl.constexpr("=f," + ",".join(["r"] * 16))  # out: an fp32 register; in: 16 x 32 bits

    @triton.jit
    def _lane(r, HIGH: tl.constexpr):
        """One fp16 lane of uint32 pairs, as fp32 (the interpreter's emulation)."""
        return f16_bits((r >> 16) if HIGH else r).to(tl.float32)

    @triton.jit
    def _fma2(a, b, lo, hi):
        """``fma.rn.f16x2`` emulated lane by lane: uint32 fp16 pairs ``a``, ``b`` and the running lane sums ``lo``,
        ``hi`` (fp32 holding fp16 values) -> the new sums, each rounded to fp16. The product of two fp16 is exact in
        fp32; the add rounds in fp32 before the fp16 rounding, equal to the fused result but for rare ties."""
        a = a.to(tl.uint32, bitcast=True)
        b = b.to(tl.uint32, bitcast=True)
        lo = (_lane(a, False) * _lane(b, False) + lo).to(tl.float16).to(tl.float32)
        hi = (_lane(a, True) * _lane(b, True) + hi).to(tl.float16).to(tl.float32)
        return lo, hi

    @triton.jit
    def half2_dot8(a0, a1, a2, a3, a4, a5, a6, a7, b0, b1, b2, b3, b4, b5, b6, b7, ASM: tl.constexpr):
        """``sum_q a_q . b_q`` over eight uint32 tensors of fp16 pairs each side (broadcast to one shape): both lanes
        accumulate in fp16 (``fma.rn.f16x2``), then the two lane sums are added in fp32. ``ASM``: inline PTX (CUDA);
        otherwise the same roundings emulated lane by lane (the CPU interpreter)."""
        if ASM:
            return tl.inline_asm_elementwise(
                _HALF2_DOT8,
                _HALF2_DOT8_REGS,
                [a0, a1, a2, a3, a4, a5, a6, a7, b0, b1, b2, b3, b4, b5, b6, b7],
                dtype=tl.float32,
                is_pure=True,
                pack=1,
            )
        else:
            lo, hi = _fma2(a0, b0, 0.0, 0.0)
            lo, hi = _fma2(a1, b1, lo, hi)
            lo, hi = _fma2(a2, b2, lo, hi)
            lo, hi = _fma2(a3, b3, lo, hi)
            lo, hi = _fma2(a4, b4, lo, hi)
            lo, hi = _fma2(a5, b5, lo, hi)
            lo, hi = _fma2(a6, b6, lo, hi)
            lo, hi = _fma2(a7, b7, lo, hi)
            return lo + hi

    @triton.jit
    def _pow2(e):
        """``2.0 ** e`` for int32 ``e`` in [-126, 127], exactly (the fp32 exponent field)."""
        return ((e + 127) << 23).to(tl.float32, bitcast=True)

    @triton.jit
    def _row_exponent(row, K, TOP: tl.constexpr, BLOCK: tl.constexpr):
        """The ``s`` that puts the largest |x| of the row at ``row`` (``K`` values) in [2^TOP, 2^(TOP+1)) once
        scaled by ``2^s`` (clamped to [-100, 100]: a zero row gets a finite factor)."""
        offs = tl.arange(0, BLOCK)
        amax = tl.zeros((BLOCK,), dtype=tl.float32)
        for k0 in range(0, K, BLOCK):
            amax = tl.maximum(amax, tl.abs(tl.load(row + k0 + offs, mask=k0 + offs < K, other=0.0).to(tl.float32)))
        top = tl.max(amax, 0)
        e = ((top.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127  # top in [2^e, 2^(e+1)) (e = -127: zero row)
        return tl.minimum(tl.maximum(TOP - e, -100), 100)

    @triton.jit
    def _half_rows_kernel(
        x_ptr,  # [M, K]
        xh_ptr,  # fp16 [M, K]: row m scaled by 2^s, columns in ``dequant_tile_half``'s order
        xf_ptr,  # fp32 [M]: 2^-s, undoing the row's scale
        K,
        stride_xm,
        stride_hm,
        TOP: tl.constexpr,
        BLOCK: tl.constexpr,
        PDL: tl.constexpr = False,  # kernels/pdl.py
    ):
        pdl_wait_then_release(PDL)
        m = tl.program_id(0)
        offs = tl.arange(0, BLOCK)
        dst = xh_ptr + m.to(tl.int64) * stride_hm
        row = x_ptr + m.to(tl.int64) * stride_xm
        s = _row_exponent(row, K, TOP, BLOCK)
        tl.store(xf_ptr + m, _pow2(-s))
        up = _pow2(s)
        cols = half_tile_columns(offs)  # column c of the fp16 tile holds weight cols[c]
        for k0 in range(0, K, BLOCK):
            v = tl.load(row + k0 + cols, mask=k0 + cols < K, other=0.0).to(tl.float32) * up
            tl.store(dst + k0 + offs, v.to(tl.float16), mask=k0 + offs < K)

    @triton.jit
    def _half_pairs_kernel(
        x_ptr,  # [M, K]
        xp_ptr,  # int32 [M, 8, K/16]: block b's fp16 pairs, q < 4: (x[16b + q], x[16b + q + 4]), q >= 4: +8
        xf_ptr,  # fp32 [M]: 2^-s, undoing the row's scale
        K,
        stride_xm,
        stride_pm,
        TOP: tl.constexpr,
        BLOCK_B: tl.constexpr,  # scale blocks (16 activations) a step
        PDL: tl.constexpr = False,  # kernels/pdl.py
    ):
        pdl_wait_then_release(PDL)
        m = tl.program_id(0).to(tl.int64)
        row = x_ptr + m * stride_xm
        s = _row_exponent(row, K, TOP, 16 * BLOCK_B)
        up = _pow2(s)
        tl.store(xf_ptr + m, _pow2(-s))
        q = tl.arange(0, 8)
        col = (q // 4) * 8 + q % 4  # the pair's low activation within its block
        offs_b = tl.arange(0, BLOCK_B)
        for b0 in range(0, K // 16, BLOCK_B):
            b = b0 + offs_b
            mask = (b < K // 16)[:, None]
            src = row + b[:, None] * 16 + col[None, :]
            lo = (tl.load(src, mask=mask, other=0.0).to(tl.float32) * up).to(tl.float16)
            hi = (tl.load(src + 4, mask=mask, other=0.0).to(tl.float32) * up).to(tl.float16)
            tl.store(xp_ptr + m * stride_pm + q[None, :] * (K // 16) + b[:, None], pair_bits(lo, hi), mask=mask)

    @triton.jit
    def half_decode(w, BLOCK_N: tl.constexpr, NB: tl.constexpr):
        """``[BLOCK_N, 2 * NB]`` int32 words -> ``d0..d7``, each block's eight code pairs (``e2m1_pairs`` of its two
        words), ``[BLOCK_N, NB]`` uint32: ``half_row``'s left operands."""
        w_even, w_odd = tl.split(tl.reshape(w, (BLOCK_N, NB, 2)))  # a block's two words
        d0, d1, d2, d3 = e2m1_pairs(w_even)
        d4, d5, d6, d7 = e2m1_pairs(w_odd)
        return d0, d1, d2, d3, d4, d5, d6, d7

    @triton.jit
    def half_row(d0, d1, d2, d3, d4, d5, d6, d7, scale, xp_ptr, m, M, stride_pm, KB, kb0, b_mask, NB, ASM):
        """Row ``m`` of x (its pairs at block ``kb0``; zeros past ``b_mask`` or for ``m >= M``) against a decoded
        step: the ``[rows, NB]`` scaled block sums. Each pair position is its own load of ``[NB]`` contiguous
        words, so it is loaded straight into the layout the broadcast over the rows wants: one ``[NB, 8]`` load
        split eight ways cost a layout conversion through shared memory per position, row and step."""
        ptrs = xp_ptr + m * stride_pm + kb0 + tl.arange(0, NB)
        x0, x1, x2, x3, x4, x5, x6, x7 = load8(ptrs, KB, b_mask & (tl.arange(0, NB) * 0 + m < M))
        d = half2_dot8(
            d0, d1, d2, d3, d4, d5, d6, d7,
            x0[None, :], x1[None, :], x2[None, :], x3[None, :], x4[None, :], x5[None, :], x6[None, :], x7[None, :],
            ASM,
        )  # fmt: skip
        return d * scale


HALF_MAX_M = 4  # rows of x a program of the GEMV carries (``nvfp4_linear._nvfp4_gemv_kernel`` with HALF: a0..a3)


def half_pairs(x2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x2 [M, K]`` (16-bit, K a multiple of 16) -> its fp16 pairs ``int32 [M, 8, K/16]`` scaled by a power of
    two per row, and ``2^-s [M]`` (fp32) that undoes it: the GEMV's right operands, one launch."""
    M, K = x2.shape
    xp = torch.empty(M, 8, K // 16, dtype=torch.int32, device=x2.device)
    xf = torch.empty(M, dtype=torch.float32, device=x2.device)
    if M > 0:
        block_b = max(1, min(64, triton.next_power_of_2(K // 16)))
        _half_pairs_kernel[(M,)](
            x2,
            xp,
            xf,
            K,
            x2.stride(0),
            xp.stride(0),
            TOP=_TOP_EXPONENT,
            BLOCK_B=block_b,
            num_warps=4,
            **pdl_launch(x2),
        )
    return xp, xf


def half_rows(x2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x2 [M, K]`` (16-bit, K a multiple of 8) -> its rows in fp16, each scaled by ``half_pairs``' power of two
    (so the copy is exact), with the columns of each 8 in ``dequant_tile_half``'s order (``half_tile_columns``), and
    ``2^-s [M]`` (fp32) that undoes the scale: the x of the fp16 tensor-core tiles (``nvfp4_linear``'s ``half_dot``,
    the grouped NVFP4 MoE), one launch. The kernels mask a tile's rows past M (no padding rows here)."""
    M, K = x2.shape
    xh = torch.empty(M, K, dtype=torch.float16, device=x2.device)
    xf = torch.empty(M, dtype=torch.float32, device=x2.device)
    if M > 0:
        block = max(16, min(2048, triton.next_power_of_2(K)))
        _half_rows_kernel[(M,)](
            x2, xh, xf, K, x2.stride(0), xh.stride(0), TOP=_TOP_EXPONENT, BLOCK=block, num_warps=4, **pdl_launch(x2)
        )
    return xh, xf
