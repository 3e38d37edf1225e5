"""Prefill-sized NVFP4 MoE steps as FP8 (W8A8) grouped GEMMs on Hopper, beside the torch reference they are tested
against: issue 11's "FP8 conversion for prefill on Hopper", an opt-in (``FREETOKEN_NVFP4_FP8_PREFILL``).

Why: at 8,192 tokens every expert of a layer gets ~256 rows, so the grouped NVFP4 kernel is bound by decoding each
weight tile on the CUDA cores once per block of rows (0.68x our BF16 kernel on the H200, docs/nvfp4.md). Here each
weight is decoded once a step, into E4M3, and the GEMMs run on the FP8 tensor cores (twice BF16's rate) through
torch's grouped FP8 GEMM (``torch._scaled_grouped_mm``, CUTLASS on sm_90) with a scale per row of x and per output
row of the bank.

    bank -> FP8:   Wq[s, n, k] = e4m3(e2m1(code) * scale[s, n, k // 16] * f[s, n])     (one rounding: RNE)
                   f[s, n] = the largest power of two keeping 6 * max_k scale[s, n, :] * f <= 448
                   w_scale[s, n] = global[s, n] / f[s, n]          so  W = Wq * w_scale  up to Wq's rounding
    rows -> FP8:   xq[t] = e4m3(x[t] * 448 / amax_t),  x_scale[t] = amax_t / 448                  (per row)
    step:          h = (xq[order] @ Wq13ᵀ) * x_scale * w13_scale  (bf16), inter = silu(h_gate) * h_up,
                   rows = (q(inter) @ Wq2ᵀ) * inter_scale * w2_scale, out = the combine of ``moe_grouped_mm``

Numerics: not the W4A16 path's. A code times its E4M3 block scale has five significant bits and E4M3 keeps four
(half a step of four bits: a relative error up to 2^-4 on those weights), and x and the intermediate rows are
rounded to E4M3 per row (the same bound). That is W8A8 FP8 with per-row scales, what FP8 checkpoints serve; decode steps never come here, so a
conversation's tokens after its prompt are computed as before. Tests hold the path to the plain NVFP4 reference
within FP8's error and the conversion bit for bit to its torch reference (the kernels round to the E4M3 grid
themselves before the cast, ``kernels/e4m3.py``, so the interpreter agrees too).

Cost a step: the bank converted (read 0.45 GB, write 0.8 GB for a Qwen3.6-35B-A3B layer), x and the intermediate
rows quantized (one pass each), the pair sort, gather and combine of ``moe_grouped_mm``. Ids outside the bank
(graph padding, offload slots past the pool) weigh 0 on row 0 of the bank, as ``nvfp4_dequant_moe`` does.
"""

from __future__ import annotations

import torch

from .moe_combine import moe_combine_torch, moe_combine_triton
from .moe_grouped_mm import sort_pairs_by_expert
from .nvfp4_dequant import nvfp4_dequantize_torch

try:  # keep the reference importable without triton
    import triton
    import triton.language as tl

    from .e4m3 import round_to_e4m3
    from .nvfp4_tiles import dequant_tile_words
    from .pdl import pdl_launch, pdl_wait_then_release
except Exception:  # pragma: no cover
    triton = None
    tl = None

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
_E2M1_MAX = 6.0
_AMAX_FLOOR = 1e-12  # an all-zero row: any scale gives zeros, but not 0/0


def fp8_prefill_supported(x: torch.Tensor) -> bool:
    """Where this path runs: CUDA on sm_90 (torch's grouped FP8 GEMM; the CUTLASS kernel it ships for Hopper)."""
    if not (x.is_cuda and hasattr(torch, "_scaled_grouped_mm") and triton is not None):
        return False
    return torch.cuda.get_device_capability(x.device)[0] == 9


def fp8_row_factors(scale: torch.Tensor, glob: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``f [S, N]`` (powers of two: multiplying by one rounds nothing) and ``w_scale [S, N]`` fp32 for a bank part
    with block scales ``scale [S, N, K/16]`` and per-row globals ``glob [S, N]``."""
    rowmax = scale.float().amax(-1)
    room = torch.where(rowmax > 0, FP8_MAX / (_E2M1_MAX * rowmax.clamp(min=1e-30)), torch.ones_like(rowmax))
    _, exp = torch.frexp(room)  # room = m * 2**exp, m in [0.5, 1): the power of two at or below it is 2**(exp - 1)
    f = torch.ldexp(torch.ones_like(room), exp - 1)
    return f, glob.float() / f


if triton is not None:

    @triton.jit
    def _nvfp4_to_fp8_kernel(
        w_ptr,  # int32 words [S, N, K/8]
        s_ptr,  # uint8 (E4M3 bits) [S, N, K/16]
        g_ptr,  # fp32 [S, N]
        q_ptr,  # uint8 (E4M3 bits) [S, N, K], contiguous
        ws_ptr,  # fp32 [S, N], contiguous
        N,
        KW,  # words per row
        stride_ws,
        stride_wn,
        stride_ss,
        stride_sn,
        stride_gs,
        stride_gn,
        ROWS: tl.constexpr,
        WORDS: tl.constexpr,
        SCALES: tl.constexpr,  # a power of two >= K/16: the whole row's block scales in one load
        PDL: tl.constexpr = False,  # kernels/pdl.py
    ):
        pdl_wait_then_release(PDL)
        e = tl.program_id(0).to(tl.int64)
        offs_n = tl.program_id(1) * ROWS + tl.arange(0, ROWS)
        n_mask = offs_n < N
        # the rows' factors (fp8_row_factors): the power of two at or below 448 / (6 * the row's largest block scale)
        offs_all = tl.arange(0, SCALES)
        s_row = s_ptr + e * stride_ss + offs_n[:, None].to(tl.int64) * stride_sn
        all_s = tl.load(s_row + offs_all[None, :], mask=n_mask[:, None] & (offs_all < KW // 2)[None, :], other=0)
        rowmax = tl.max(all_s.to(tl.float8e4nv, bitcast=True).to(tl.float32), axis=1)
        room = 448.0 / (6.0 * tl.maximum(rowmax, 1e-30))
        f = tl.where(rowmax > 0, (room.to(tl.uint32, bitcast=True) & 0xFF800000).to(tl.float32, bitcast=True), 1.0)
        g = tl.load(g_ptr + e * stride_gs + offs_n * stride_gn, mask=n_mask, other=0.0)
        tl.store(ws_ptr + e * N + offs_n, g / f, mask=n_mask)
        offs_w = tl.arange(0, WORDS)
        offs_s = tl.arange(0, WORDS // 2)
        offs_k = tl.arange(0, 8 * WORDS)
        w_row = w_ptr + e * stride_ws + offs_n[:, None].to(tl.int64) * stride_wn
        q_row = q_ptr + e * N * KW * 8 + offs_n[:, None].to(tl.int64) * KW * 8
        for kw0 in range(0, KW, WORDS):
            w_mask = n_mask[:, None] & ((kw0 + offs_w) < KW)[None, :]
            s_mask = n_mask[:, None] & ((kw0 // 2 + offs_s) < KW // 2)[None, :]
            w = tl.load(w_row + kw0 + offs_w[None, :], mask=w_mask, other=0)
            s = tl.load(s_row + kw0 // 2 + offs_s[None, :], mask=s_mask, other=0)
            tile = dequant_tile_words(w, s, ROWS, WORDS, tl.float32) * f[:, None]  # exact: f a power of two
            q = round_to_e4m3(tile).to(tl.float8e4nv).to(tl.uint8, bitcast=True)
            k_mask = n_mask[:, None] & ((8 * kw0 + offs_k) < 8 * KW)[None, :]
            tl.store(q_row + 8 * kw0 + offs_k[None, :], q, mask=k_mask)


_ROWS = 16  # rows of a bank part per program
_WORDS = 32  # words (8 weights each) of a row per step: 256 weights


def nvfp4_to_fp8_triton(packed, scale, glob) -> tuple[torch.Tensor, torch.Tensor]:
    """``nvfp4_to_fp8``'s Triton kernel: one pass over a bank part (its rows' factors from their block scales in the
    same program). Strided bank views (the offload stream's rows) are read as they are; last dims contiguous."""
    assert triton is not None, "triton is not installed"
    S, N, half = packed.shape
    K = 2 * half
    assert K % 16 == 0 and scale.shape == (S, N, K // 16) and glob.shape == (S, N)
    assert packed.stride(-1) == 1 and scale.stride(-1) == 1, "rows must be contiguous"
    q = torch.empty(S, N, K, dtype=torch.uint8, device=packed.device)
    w_scale = torch.empty(S, N, dtype=torch.float32, device=packed.device)
    if S and N:
        words, sbytes = packed.view(torch.int32), scale.view(torch.uint8)
        _nvfp4_to_fp8_kernel[(S, triton.cdiv(N, _ROWS))](
            words, sbytes, glob, q, w_scale, N, K // 8,
            words.stride(0), words.stride(1), sbytes.stride(0), sbytes.stride(1), glob.stride(0), glob.stride(1),
            ROWS=_ROWS, WORDS=_WORDS, SCALES=triton.next_power_of_2(K // 16), num_warps=4, **pdl_launch(words),
        )  # fmt: skip
    return q.view(FP8), w_scale


def nvfp4_to_fp8(packed, scale, glob, impl: str = "auto") -> tuple[torch.Tensor, torch.Tensor]:
    """A bank part ``[S, N, K/2]`` codes, ``[S, N, K/16]`` block scales, ``[S, N]`` globals -> ``(Wq [S, N, K] E4M3,
    w_scale [S, N] fp32)``. ``impl``: ``torch`` (the reference: ``fp8_row_factors``, then the bank dequantized with
    the factors as its per-row globals, cast), ``triton`` (``nvfp4_to_fp8_triton``), ``auto`` (Triton on CUDA)."""
    if impl == "triton" or (impl == "auto" and packed.is_cuda):
        return nvfp4_to_fp8_triton(packed, scale, glob)
    f, w_scale = fp8_row_factors(scale, glob)
    return nvfp4_dequantize_torch(packed, scale, f, torch.float32).to(FP8), w_scale


def quantize_rows_fp8_torch(x: torch.Tensor, silu_mul: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [R, C]`` -> ``(xq [R, C] E4M3, x_scale [R] fp32)``, one scale a row (``amax / 448``); with ``silu_mul``,
    ``x [R, 2C]`` is a gate|up row and what is quantized is ``silu(gate) * up`` computed in fp32."""
    v = x.float()
    if silu_mul:
        c = v.shape[-1] // 2
        gate, up = v[:, :c], v[:, c:]
        v = gate / (1.0 + torch.exp(-gate)) * up
    amax = v.abs().amax(-1).clamp(min=_AMAX_FLOOR)
    q = (v * (FP8_MAX / amax)[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return q, amax / FP8_MAX


if triton is not None:

    @triton.jit
    def _quantize_rows_kernel(
        x_ptr,
        q_ptr,  # uint8 view of the E4M3 output
        s_ptr,
        C,
        stride_x,
        stride_q,
        SILU_MUL: tl.constexpr,
        BLOCK_C: tl.constexpr,
        PDL: tl.constexpr = False,  # kernels/pdl.py
    ):
        pdl_wait_then_release(PDL)
        r = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK_C)
        mask = cols < C
        v = tl.load(x_ptr + r * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
        if SILU_MUL:
            up = tl.load(x_ptr + r * stride_x + C + cols, mask=mask, other=0.0).to(tl.float32)
            v = v / (1.0 + tl.exp(-v)) * up
        amax = tl.maximum(tl.max(tl.abs(v), axis=0), 1e-12)
        q = round_to_e4m3(tl.minimum(tl.maximum(v * (448.0 / amax), -448.0), 448.0)).to(tl.float8e4nv)
        tl.store(q_ptr + r * stride_q + cols, q.to(tl.uint8, bitcast=True), mask=mask)
        tl.store(s_ptr + r, amax / 448.0)


def quantize_rows_fp8_triton(x: torch.Tensor, silu_mul: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as ``quantize_rows_fp8_torch``: one program a row (a row of Qwen3.6's widths, 2,048 or 512
    values, fits one block); CUDA, or CPU under TRITON_INTERPRET=1. Last dim contiguous."""
    assert triton is not None, "triton is not installed"
    assert x.stride(-1) == 1
    R, width = x.shape
    C = width // 2 if silu_mul else width
    q = torch.empty(R, C, dtype=torch.uint8, device=x.device)
    s = torch.empty(R, dtype=torch.float32, device=x.device)
    if R:
        block = triton.next_power_of_2(C)
        _quantize_rows_kernel[(R,)](
            x, q, s, C, x.stride(0), q.stride(0), SILU_MUL=silu_mul, BLOCK_C=block,
            num_warps=4 if block <= 1024 else 8, **pdl_launch(x),
        )  # fmt: skip
    return q.view(FP8), s


def quantize_rows_fp8(x: torch.Tensor, silu_mul: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """The Triton kernel on CUDA, the reference elsewhere."""
    if x.is_cuda and triton is not None:
        return quantize_rows_fp8_triton(x, silu_mul)
    return quantize_rows_fp8_torch(x, silu_mul)


def scaled_grouped_mm_torch(a, b_t, a_scale, b_scale, offs, out_dtype) -> torch.Tensor:
    """The reference for ``torch._scaled_grouped_mm(a, b_t, a_scale, b_scale, offs=offs)``: rows
    ``[offs[g-1], offs[g])`` of ``a [P, K]`` times ``b_t[g] [K, N]``, each output ``(row . column) * a_scale[row] *
    b_scale[g, column]`` in fp32, then ``out_dtype``; rows past the last end are zeros. Syncs (reads ``offs``)."""
    out = torch.zeros(a.shape[0], b_t.shape[2], dtype=torch.float32, device=a.device)
    start = 0
    for g, end in enumerate(offs.tolist()):
        if end > start:
            acc = a[start:end].float() @ b_t[g].float()
            out[start:end] = acc * a_scale[start:end, None] * b_scale[g][None, :]
        start = end
    return out.to(out_dtype)


def _scaled_grouped_mm(a, b_t, a_scale, b_scale, offs, out_dtype):
    if a.is_cuda:
        return torch._scaled_grouped_mm(a, b_t, a_scale, b_scale, offs=offs, out_dtype=out_dtype)
    return scaled_grouped_mm_torch(a, b_t, a_scale, b_scale, offs, out_dtype)


def _gather_rows(q: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """``q[rows]`` for an E4M3 tensor, through its bytes (index_select need not know the dtype)."""
    return q.view(torch.uint8).index_select(0, rows).view(FP8)


# Tokens a grouped GEMM call takes at most: a longer step runs in pieces of this many over the bank converted once.
# On the H100 (2026-12-06) the two FP8 GEMMs took 579 us at 4,096 tokens and 2,051 us at 8,192 (the library's tile
# choice at ~256 rows an expert), so an 8k step as two 4k pieces is the first guess.
CHUNK_TOKENS = 4096


def nvfp4_fp8_moe(
    x,
    w13,
    w13_scale,
    w13_global,
    w2,
    w2_scale,
    w2_global,
    topk_ids,
    topk_weights,
    shared=None,
    shared_gate=None,
    out=None,
    chunk_tokens: int = CHUNK_TOKENS,
):
    """The routed experts of a prefill-sized step as FP8 grouped GEMMs (the module's docstring): same contract as
    ``nvfp4_dequant_moe`` (bank in ``Nvfp4Experts``' layout, expert or slot ids, the shared term when given). The
    bank is converted once, then the tokens run ``chunk_tokens`` at a time (sort, GEMMs, combine into their rows of
    ``out``). On CUDA: the Triton conversion and quantization, ``torch._scaled_grouped_mm``, the Triton combine;
    elsewhere the torch references of each (tests)."""
    T, H = x.shape
    S, k = w13.shape[0], topk_ids.shape[1]
    out = torch.empty_like(x) if out is None else out
    if T == 0:
        return out
    valid = (topk_ids >= 0) & (topk_ids < S)
    ids = torch.where(valid, topk_ids, 0)
    weights = torch.where(valid, topk_weights, 0).to(x.dtype)
    w13_q, w13_s = nvfp4_to_fp8(w13, w13_scale, w13_global)
    w2_q, w2_s = nvfp4_to_fp8(w2, w2_scale, w2_global)
    xq, x_s = quantize_rows_fp8(x)
    for t0 in range(0, T, chunk_tokens):
        t1 = min(T, t0 + chunk_tokens)
        order, ends, position = sort_pairs_by_expert(ids[t0:t1], S)
        tokens = t0 + order // k
        a, a_s = _gather_rows(xq, tokens), x_s.index_select(0, tokens)
        h = _scaled_grouped_mm(a, w13_q.transpose(1, 2), a_s, w13_s, ends, x.dtype)
        iq, i_s = quantize_rows_fp8(h, silu_mul=True)
        rows = _scaled_grouped_mm(iq, w2_q.transpose(1, 2), i_s, w2_s, ends, x.dtype)
        sh = None if shared is None else shared[t0:t1]
        gate = None if shared_gate is None else shared_gate[t0:t1]
        if x.is_cuda:
            moe_combine_triton(rows, k, x.dtype, sh, gate, weights=weights[t0:t1], out=out[t0:t1], rows_at=position)
        else:
            out[t0:t1] = moe_combine_torch(rows[position.long()], k, x.dtype, sh, gate, weights=weights[t0:t1])
    return out
