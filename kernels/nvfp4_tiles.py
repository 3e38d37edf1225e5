"""Triton building blocks that decode NVFP4 weights inside a kernel (layout: ``quant/nvfp4.py``), shared by the W4A16
linear (``nvfp4_linear.py``) and the NVFP4 MoE kernels (``nvfp4_moe.py``).

Weights are read as int32 words (the packed uint8 rows viewed as int32: word j holds weights 8j..8j+7, weight 8j+p
in bits 4p..4p+3) with 16-byte loads, and the E4M3 block scales as raw bytes (one per 16 weights = two words).
Nothing here uses Triton's fp8 types, so the same code runs on sm_80 (no FP8 conversions), sm_89/90, and under the
CPU interpreter.

Why bit placement instead of a 16-entry lookup table: the GPU has no cheap per-lane table lookup (a gather from
memory costs a load instruction per weight; REFERENCES §3.8 measured a LUT at 36 % of the roofline). An E2M1 code
placed into the fp16 bit pattern is already a float::

    code  s e1 e0 m   ->   fp16 bits  s 000 e1 e0 m 000000000   =  e2m1(code) * 2^-14   (exact, subnormals included)

and an E4M3 scale likewise: ``(byte & 0x7F) << 7`` as fp16 is ``e4m3(byte) * 2^-8``. Weights p and p+4 of a word
sit 16 bits apart, so one shift-and-mask places both, as an fp16 pair in one register, and the GPU's half -> float
conversion reads either half of a register for free: per weight about one logic op, one shift, one conversion and
the multiply-add it feeds (``e2m1_word``). The powers of two are folded into the block scale once per 16 weights
(``block_scale``). Every step is exact, and so is ``e2m1 * e4m3`` (at most 6 significant bits) in fp32, bf16 and
fp16: a decoded tile equals ``e2m1 * float(scale)``; the per-tensor / per-row global scale is applied once, in a
kernel's epilogue.

Measured statically (Triton 3.9 compiling for sm_90, SASS of the inner loops; tools in the GPU session's bench): a
GEMV row costs ~6 instructions per weight, a ``tl.dot`` tile (``dequant_tile_words``) ~7; decoding bytes one nibble
at a time instead took ~10.

The block scales are assumed non-negative (both producers write ``amax``-derived scales; the sign bit is dropped).
"""

from __future__ import annotations

import torch

try:  # keep the package importable without triton
    import triton
    import triton.language as tl
except Exception:  # pragma: no cover
    triton = None
    tl = None

# x's dtype as a kernel constexpr (a rounding or a tile dtype chosen by the launcher)
TL_DTYPES = {torch.float32: tl.float32, torch.float16: tl.float16, torch.bfloat16: tl.bfloat16} if tl else {}

if triton is not None:

    @triton.jit
    def block_scale(s):
        """E4M3 scale bytes -> ``float(scale) * 2^14`` in fp32: the factor that turns ``e2m1_word``'s values into
        ``e2m1 * scale``. (``* 2^8`` undoes the fp16 placement of the scale, ``* 2^14`` the codes'.)"""
        bits = (s.to(tl.int32) & 0x7F) << 7
        return bits.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32) * 4194304.0

    @triton.jit
    def f16_bits(r):
        """The low 16 bits of 32-bit ``r`` as fp16."""
        return r.to(tl.uint16).to(tl.float16, bitcast=True)

    @triton.jit
    def f16_halves(r):
        """A uint32 holding two fp16 bit patterns -> (low, high) as fp32."""
        return f16_bits(r).to(tl.float32), f16_bits(r >> 16).to(tl.float32)

    @triton.jit
    def e2m1_pairs(w):
        """int32 words of packed codes (word j = weights 8j..8j+7, weight 8j+p in bits 4p..4p+3) -> four uint32
        tensors shaped like ``w``, the fp16 pairs (weight p low, weight p+4 high) for p = 0..3, each weight as
        ``e2m1 * 2^-14``. One shift and one mask a pair, after four operations a word.

        A placed pair needs each code's sign 6 bits above its magnitude's lowest bit (fp16 bits 15 and 9..11); in
        the word it is 3 above, so the sign would need a second shift. Instead the word is copied twice with every
        sign moved 3 bits up (a rotation: code 7's sign wraps to bit 2) into the neighbouring code's top magnitude
        bit: ``even`` for codes 0, 2, 4, 6 (bits 6, 14, 22, 30), ``odd`` for 1, 3, 5, 7 (bits 10, 18, 26, 2); the
        bits overwritten belong to codes the copy is not used for. Then one shift (a rotation for p = 3) and one
        mask place a pair: 12 integer operations a word (a rotation, a xor, two selects, four shifts and four
        masks) instead of 15."""
        w = w.to(tl.uint32, bitcast=True)
        up3 = (w << 3) | (w >> 29)  # every sign 3 bits up
        even = w ^ ((w ^ up3) & 0x40404040)  # a bit select: one logic operation
        odd = w ^ ((w ^ up3) & 0x04040404)
        p0 = (even << 9) & 0x8E008E00
        p1 = (odd << 5) & 0x8E008E00
        p2 = (even << 1) & 0x8E008E00
        p3 = ((odd >> 3) | (odd << 29)) & 0x8E008E00
        return p0, p1, p2, p3

    @triton.jit
    def e2m1_word(w):
        """int32 words of packed codes -> the 8 weights ``v0..v7`` (fp32, times 2^-14), each a tensor shaped like
        ``w``: ``e2m1_pairs``, whose fp16 pairs two half -> float conversions split (the GPU reads either half of a
        register for free)."""
        p0, p1, p2, p3 = e2m1_pairs(w)
        v0, v4 = f16_halves(p0)
        v1, v5 = f16_halves(p1)
        v2, v6 = f16_halves(p2)
        v3, v7 = f16_halves(p3)
        return v0, v1, v2, v3, v4, v5, v6, v7

    @triton.jit
    def split8(x, COLS: tl.constexpr):
        """``x [8 * COLS]`` -> ``x0..x7 [COLS]`` with ``xp[c] = x[8c + p]`` (the activations matching ``e2m1_word``'s
        ``vp``), fp32. One contiguous load for the caller; the split is register renaming."""
        x = tl.reshape(x.to(tl.float32), (COLS, 2, 2, 2))  # [c, p // 4, p // 2 % 2, p % 2]
        e, o = tl.split(x)
        e0, e1 = tl.split(e)
        o0, o1 = tl.split(o)
        x0, x4 = tl.split(e0)
        x2, x6 = tl.split(e1)
        x1, x5 = tl.split(o0)
        x3, x7 = tl.split(o1)
        return x0, x1, x2, x3, x4, x5, x6, x7

    @triton.jit
    def word_block_dot(v0, v1, v2, v3, v4, v5, v6, v7, x0, x1, x2, x3, x4, x5, x6, x7, scale, ROWS, WORDS):
        """One GEMV step over ``[ROWS, WORDS]`` words: ``v0..v7`` from ``e2m1_word``, ``x0..x7 [WORDS]`` the
        matching activations (``split8``), ``scale [ROWS, WORDS // 2]`` from ``block_scale`` -> each 16-weight
        block's dot product times its scale, ``[ROWS, WORDS // 2]``. Per word a chain of multiply-adds; the scale
        costs one multiply per block."""
        d = v0 * x0[None, :]  # one chain: each line a fused multiply-add
        d += v1 * x1[None, :]
        d += v2 * x2[None, :]
        d += v3 * x3[None, :]
        d += v4 * x4[None, :]
        d += v5 * x5[None, :]
        d += v6 * x6[None, :]
        d += v7 * x7[None, :]
        return tl.sum(tl.reshape(d, (ROWS, WORDS // 2, 2)), 2) * scale

    @triton.jit
    def gemv_row(v0, v1, v2, v3, v4, v5, v6, v7, scale, x_ptr, m, M, stride_xm, k0, k_mask, offs_x, ROWS, WORDS):
        """Row ``m`` of x (``x_ptr``, rows ``stride_xm`` apart; weights ``k0 + offs_x`` under ``k_mask``, zeros for
        ``m >= M``) against a decoded step (``e2m1_word``'s ``v0..v7``, ``block_scale``'s ``scale``): the
        ``[ROWS, WORDS // 2]`` scaled block sums. A GEMV over several rows of x decodes once and calls this per row."""
        xm = tl.load(x_ptr + m * stride_xm + k0 + offs_x, mask=k_mask & (offs_x * 0 + m < M), other=0.0)
        x0, x1, x2, x3, x4, x5, x6, x7 = split8(xm, WORDS)
        return word_block_dot(v0, v1, v2, v3, v4, v5, v6, v7, x0, x1, x2, x3, x4, x5, x6, x7, scale, ROWS, WORDS)

    @triton.jit
    def gemv_step(w, s, x, ROWS: tl.constexpr, WORDS: tl.constexpr):
        """``w [ROWS, WORDS]`` int32 words, ``s [ROWS, WORDS // 2]`` scale bytes, ``x [8 * WORDS]`` activations ->
        ``[ROWS, WORDS // 2]`` scaled block sums (sum them for the step's dot products)."""
        v0, v1, v2, v3, v4, v5, v6, v7 = e2m1_word(w)
        x0, x1, x2, x3, x4, x5, x6, x7 = split8(x, WORDS)
        return word_block_dot(
            v0, v1, v2, v3, v4, v5, v6, v7, x0, x1, x2, x3, x4, x5, x6, x7, block_scale(s), ROWS, WORDS
        )

    @triton.jit
    def load8(ptrs, stride, mask):
        """Eight loads ``ptrs + p * stride`` (p = 0..7) under ``mask``, zeros outside: activations stored split by
        their position in a word (or pair), each loaded straight into the layout its use wants."""
        x0 = tl.load(ptrs, mask=mask, other=0)
        x1 = tl.load(ptrs + stride, mask=mask, other=0)
        x2 = tl.load(ptrs + 2 * stride, mask=mask, other=0)
        x3 = tl.load(ptrs + 3 * stride, mask=mask, other=0)
        x4 = tl.load(ptrs + 4 * stride, mask=mask, other=0)
        x5 = tl.load(ptrs + 5 * stride, mask=mask, other=0)
        x6 = tl.load(ptrs + 6 * stride, mask=mask, other=0)
        x7 = tl.load(ptrs + 7 * stride, mask=mask, other=0)
        return x0, x1, x2, x3, x4, x5, x6, x7

    @triton.jit
    def gemv_step_split(w, s, xs_ptr, stride_p, mask, ROWS: tl.constexpr, WORDS: tl.constexpr):
        """``gemv_step`` with the activations already split (``xs_ptr + p * stride_p`` -> ``xp [WORDS]``, fp32:
        loaded straight into the layout they are used in, with no conversion)."""
        v0, v1, v2, v3, v4, v5, v6, v7 = e2m1_word(w)
        x0, x1, x2, x3, x4, x5, x6, x7 = load8(xs_ptr, stride_p, mask)
        return word_block_dot(
            v0, v1, v2, v3, v4, v5, v6, v7, x0, x1, x2, x3, x4, x5, x6, x7, block_scale(s), ROWS, WORDS
        )

    @triton.jit
    def pair_tile_step(w, s, x0, x1, x2, x3, x4, x5, x6, x7, KP: tl.constexpr, ROWS: tl.constexpr, WORDS: tl.constexpr):
        """One step of several GEMVs at once (the MoE decode kernels' pairs): words ``w [KP, ROWS, WORDS]`` and scale
        bytes ``s [KP, ROWS, WORDS // 2]``, activations ``x0..x7`` shaped ``[KP or 1, 1, WORDS]`` (``split8``'s
        positions; one row of x for all, or one per pair) -> the ``[KP, ROWS, WORDS // 2]`` scaled block sums."""
        v0, v1, v2, v3, v4, v5, v6, v7 = e2m1_word(w)
        d = v0 * x0  # one chain: each line a fused multiply-add
        d += v1 * x1
        d += v2 * x2
        d += v3 * x3
        d += v4 * x4
        d += v5 * x5
        d += v6 * x6
        d += v7 * x7
        return tl.sum(tl.reshape(d, (KP, ROWS, WORDS // 2, 2)), 3) * block_scale(s)

    @triton.jit
    def dequant_tile_words(w, s, ROWS: tl.constexpr, WORDS: tl.constexpr, DTYPE: tl.constexpr):
        """A weight tile for ``tl.dot``: words ``w [ROWS, WORDS]`` and scale bytes ``s [ROWS, WORDS // 2]`` ->
        ``e2m1 * float(scale)`` as ``[ROWS, 8 * WORDS]`` in ``DTYPE``, columns in K order (exact in every dtype)."""
        v0, v1, v2, v3, v4, v5, v6, v7 = e2m1_word(w)
        sw = tl.reshape(tl.broadcast_to(block_scale(s)[:, :, None], (ROWS, WORDS // 2, 2)), (ROWS, WORDS))
        # weight 8j + 4a + 2b + c: join the a pairs first, c last (each join adds the fastest axis)
        a00 = tl.join((v0 * sw).to(DTYPE), (v4 * sw).to(DTYPE))
        a01 = tl.join((v1 * sw).to(DTYPE), (v5 * sw).to(DTYPE))
        a10 = tl.join((v2 * sw).to(DTYPE), (v6 * sw).to(DTYPE))
        a11 = tl.join((v3 * sw).to(DTYPE), (v7 * sw).to(DTYPE))
        t = tl.join(tl.join(a00, a10), tl.join(a01, a11))  # [ROWS, WORDS, a, b, c]
        return tl.reshape(t, (ROWS, 8 * WORDS))

    # fp16 pair products for ``dequant_tile_half``: one ``mul.rn.f16x2`` a register of two weights, then the pair
    # read as two fp16 values (the mma takes them back as one register: no repacking)
    _MUL_F16X2 = tl.constexpr("mul.rn.f16x2 $0, $1, $2;")
    _F16X2_HALVES = tl.constexpr("mov.b32 {$0, $1}, $2;")
    _TWO_POW_15_PAIR = tl.constexpr(0x78007800)  # 2^15 in both fp16 halves

    @triton.jit
    def pair_bits(lo, hi):
        """Two fp16 tensors -> int32 pairs of their bit patterns (lo in the low half)."""
        return (lo.to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF) | (
            hi.to(tl.int16, bitcast=True).to(tl.int32) << 16
        )

    @triton.jit
    def mul_pairs(a, b, ASM: tl.constexpr):
        """uint32 fp16 pairs ``a * b`` lane by lane (exact products in every use here). ``ASM``: one
        ``mul.rn.f16x2`` (CUDA); otherwise in fp32, rounded to fp16 (the CPU interpreter runs no PTX)."""
        if ASM:
            return tl.inline_asm_elementwise(_MUL_F16X2, "=r,r,r", [a, b], dtype=tl.uint32, is_pure=True, pack=1)
        else:
            a_lo, a_hi = f16_halves(a)
            b_lo, b_hi = f16_halves(b)
            return pair_bits((a_lo * b_lo).to(tl.float16), (a_hi * b_hi).to(tl.float16)).to(tl.uint32, bitcast=True)

    @triton.jit
    def pair_halves(r, ASM: tl.constexpr):
        """uint32 fp16 pairs -> (low, high) fp16 tensors (on CUDA the register's two halves, no instruction)."""
        if ASM:
            return tl.inline_asm_elementwise(
                _F16X2_HALVES, "=h,=h,r", [r], dtype=(tl.float16, tl.float16), is_pure=True, pack=1
            )
        else:
            return f16_bits(r), f16_bits(r >> 16)

    @triton.jit
    def dequant_tile_half(w, s, ROWS: tl.constexpr, WORDS: tl.constexpr, ASM: tl.constexpr):
        """A weight tile for ``tl.dot`` in fp16 with half the instructions of ``dequant_tile_words`` (sm_90 SASS of
        32 x 128 tiles, 2026-12-04: ~4.4 a weight against ~8.2): words ``w [ROWS, WORDS]``, scale bytes
        ``s [ROWS, WORDS // 2]`` -> ``e2m1 * float(scale) * 2^-7`` as ``[ROWS, 8 * WORDS]`` fp16, exact, its columns
        in PAIR order: column ``8j + 2p + lane`` holds weight ``8j + p + 4 lane`` (``half_tile_columns``), so each
        placed pair (``e2m1_pairs``: weights p and p+4) stays one register from the decode to the mma, and the
        caller's x comes in the same order. The scale: ``float(scale) * 2^7`` (the placed E4M3 ``scale * 2^-8``
        times 2^15: at most 448 * 2^7 < 65504) in both halves of a register, one ``mul.rn.f16x2`` a pair; the
        product ``e2m1 * scale * 2^-7`` has at most 6 significant bits, the last at or above 2^-22: inside fp16."""
        p0, p1, p2, p3 = e2m1_pairs(w)
        placed = (s.to(tl.uint32) & 0x7F) << 7  # E4M3 as fp16 bits: scale * 2^-8
        half_scale = mul_pairs(placed | (placed << 16), tl.full(placed.shape, _TWO_POW_15_PAIR, tl.uint32), ASM)
        pair = tl.reshape(tl.broadcast_to(half_scale[:, :, None], (ROWS, WORDS // 2, 2)), (ROWS, WORDS))
        v0, v4 = pair_halves(mul_pairs(p0, pair, ASM), ASM)
        v1, v5 = pair_halves(mul_pairs(p1, pair, ASM), ASM)
        v2, v6 = pair_halves(mul_pairs(p2, pair, ASM), ASM)
        v3, v7 = pair_halves(mul_pairs(p3, pair, ASM), ASM)
        # [ROWS, WORDS, lane, p // 2, p % 2] -> [ROWS, WORDS, p // 2, p % 2, lane]
        t = tl.join(tl.join(tl.join(v0, v4), tl.join(v2, v6)), tl.join(tl.join(v1, v5), tl.join(v3, v7)))
        return tl.reshape(tl.permute(t, (0, 1, 3, 4, 2)), (ROWS, 8 * WORDS))

    @triton.jit
    def half_tile_columns(offs):
        """Weight offsets (within the K step) of ``dequant_tile_half``'s columns ``offs``: column ``8j + 2p + lane``
        holds weight ``8j + p + 4 lane``."""
        o = offs % 8
        return offs - o + o // 2 + 4 * (o % 2)

    @triton.jit
    def tile_decode(
        w_ptrs, s_ptrs, row_mask, k0, K, offs_w, offs_s,
        ROWS: tl.constexpr, WORDS: tl.constexpr, DTYPE: tl.constexpr, HALF: tl.constexpr = False,
        ASM: tl.constexpr = False,
    ):  # fmt: skip
        """One K step's weight tile of a tensor-core NVFP4 GEMM: the ``[ROWS, WORDS]`` words and their scale bytes
        at weight ``k0`` (``w_ptrs`` / ``s_ptrs`` at the tile's first step; rows outside ``row_mask`` and weights
        past ``K`` read as zeros), decoded by ``dequant_tile_words`` (``DTYPE``), or by ``dequant_tile_half``."""
        w = tl.load(w_ptrs + k0 // 8, mask=row_mask[:, None] & ((k0 // 8 + offs_w) < K // 8)[None, :], other=0)
        s = tl.load(s_ptrs + k0 // 16, mask=row_mask[:, None] & ((k0 // 16 + offs_s) < K // 16)[None, :], other=0)
        if HALF:
            return dequant_tile_half(w, s, ROWS, WORDS, ASM)
        else:
            return dequant_tile_words(w, s, ROWS, WORDS, DTYPE)

    @triton.jit
    def tile_dot_step(
        w_ptrs, s_ptrs, row_mask, k0, K, offs_w, offs_s, xt, acc,
        ROWS: tl.constexpr, WORDS: tl.constexpr, DTYPE: tl.constexpr, DOT_PREC: tl.constexpr,
        HALF: tl.constexpr = False, ASM: tl.constexpr = False,
    ):  # fmt: skip
        """One K step of a tensor-core NVFP4 GEMM: ``tile_decode``'s tile times ``xt [8 * WORDS, M]``, added to
        ``acc``. ``HALF``: ``xt`` fp16 in ``dequant_tile_half``'s column order (e.g. ``half_rows``; the sum comes
        out times ``2^-7``)."""
        tile = tile_decode(w_ptrs, s_ptrs, row_mask, k0, K, offs_w, offs_s, ROWS, WORDS, DTYPE, HALF, ASM)
        if HALF:
            return tl.dot(tile, xt, acc)
        else:
            return tl.dot(tile, xt, acc, input_precision=DOT_PREC)
