"""NVFP4 expert banks dequantized to x's dtype on the device, for prefill-sized MoE steps, beside the torch reference
(``quant/nvfp4.dequantize``, ModelOpt's ``NVFP4QTensor.dequantize``) they are tested against.

    packed uint8 [S, N, K/2]   scale e4m3 [S, N, K/16]   glob fp32 [S, N]   ->   W [S, N, K] in dtype
    W[s, n, k] = e2m1(code) * float(scale[s, n, k // 16]) * glob[s, n], in fp32, rounded once (as the reference)

Why: a prefill chunk routes its tokens to every expert of a layer (8,192 tokens x top-8 = 256 rows per expert), so
the grouped GEMM is bound by the tensor cores, not by the weight bytes. ``nvfp4_fused_moe_triton`` decodes each
weight tile in registers for every block of rows that uses it; here each weight is decoded once per step (one pass:
0.45 GB read, 1.6 GB written for a Qwen3.6-35B-A3B layer, ~0.5 ms at HBM speed), and the BF16 grouped kernel
(``fused_moe.fused_moe_triton``) runs at its own speed. The scratch is transient (one layer's experts in x's
dtype: 1.5 GiB for Qwen3.6 in bf16); the memory plan's dry prefill step measures it. Decode steps never come here.

The bank tensors may be strided views (the offload prefill stream's rows, ``moe/nvfp4_rows.py``): every stride is
passed, only the last dimension must be contiguous. ``nvfp4_dequant_moe`` is the whole path: dequantize both parts,
then the BF16 grouped kernel over expert (or slot) ids.
"""

from __future__ import annotations

import torch

from ..quant import nvfp4

try:  # keep the reference importable without triton
    import triton
    import triton.language as tl

    from .nvfp4_tiles import dequant_tile_words
    from .pdl import pdl_launch, pdl_wait_then_release
except Exception:  # pragma: no cover
    triton = None
    tl = None

_ROWS = 16  # rows of W per program
_WORDS = 32  # words (8 weights each) of a row per step: 256 weights


def nvfp4_dequantize_torch(packed, scale, glob, dtype: torch.dtype) -> torch.Tensor:
    """The reference: ``[S, N, K/2]`` bytes, ``[S, N, K/16]`` scales, ``[S, N]`` globals -> ``[S, N, K]``."""
    return nvfp4.dequantize(packed, scale, glob, dtype)


if triton is not None:

    @triton.jit
    def _nvfp4_dequant_kernel(
        w_ptr,  # int32 words [S, N, K/8]
        s_ptr,  # uint8 (e4m3 bits) [S, N, K/16]
        g_ptr,  # fp32 [S, N]
        out_ptr,  # [S, N, K]
        N,
        KW,  # words per row
        stride_ws,
        stride_wn,
        stride_ss,
        stride_sn,
        stride_gs,
        stride_gn,
        stride_os,
        stride_on,
        ROWS: tl.constexpr,
        WORDS: tl.constexpr,
        PDL: tl.constexpr = False,  # kernels/pdl.py
    ):
        pdl_wait_then_release(PDL)
        e = tl.program_id(0).to(tl.int64)
        offs_n = tl.program_id(1) * ROWS + tl.arange(0, ROWS)
        n_mask = offs_n < N
        offs_w = tl.arange(0, WORDS)
        offs_s = tl.arange(0, WORDS // 2)
        offs_k = tl.arange(0, 8 * WORDS)
        g = tl.load(g_ptr + e * stride_gs + offs_n * stride_gn, mask=n_mask, other=0.0)
        w_row = w_ptr + e * stride_ws + offs_n[:, None].to(tl.int64) * stride_wn
        s_row = s_ptr + e * stride_ss + offs_n[:, None].to(tl.int64) * stride_sn
        o_row = out_ptr + e * stride_os + offs_n[:, None].to(tl.int64) * stride_on
        for kw0 in range(0, KW, WORDS):
            w_mask = n_mask[:, None] & ((kw0 + offs_w) < KW)[None, :]
            s_mask = n_mask[:, None] & ((kw0 // 2 + offs_s) < KW // 2)[None, :]
            w = tl.load(w_row + kw0 + offs_w[None, :], mask=w_mask, other=0)
            s = tl.load(s_row + kw0 // 2 + offs_s[None, :], mask=s_mask, other=0)
            tile = dequant_tile_words(w, s, ROWS, WORDS, tl.float32) * g[:, None]  # code * scale exact in fp32
            k_mask = n_mask[:, None] & ((8 * kw0 + offs_k) < 8 * KW)[None, :]
            tl.store(o_row + 8 * kw0 + offs_k[None, :], tile.to(out_ptr.dtype.element_ty), mask=k_mask)


def nvfp4_dequantize_triton(packed, scale, glob, dtype: torch.dtype, out=None) -> torch.Tensor:
    """Same contract as ``nvfp4_dequantize_torch``; CUDA, or CPU under TRITON_INTERPRET=1. K a multiple of 16."""
    assert triton is not None, "triton is not installed"
    S, N, half = packed.shape
    K = 2 * half
    assert K % nvfp4.BLOCK == 0 and scale.shape == (S, N, K // nvfp4.BLOCK) and glob.shape == (S, N)
    assert packed.stride(-1) == 1 and scale.stride(-1) == 1, "rows must be contiguous"
    if out is None:
        out = torch.empty(S, N, K, dtype=dtype, device=packed.device)
    if S == 0 or N == 0:
        return out
    words = packed.view(torch.int32)  # [S, N, K/8]
    sbytes = scale.view(torch.uint8)
    _nvfp4_dequant_kernel[(S, triton.cdiv(N, _ROWS))](
        words, sbytes, glob, out, N, K // 8,
        words.stride(0), words.stride(1), sbytes.stride(0), sbytes.stride(1), glob.stride(0), glob.stride(1),
        out.stride(0), out.stride(1), ROWS=_ROWS, WORDS=_WORDS, num_warps=4,
        **pdl_launch(words),
    )  # fmt: skip
    return out


def nvfp4_dequant_moe(
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
):
    """The routed experts of a prefill-sized step: the bank dequantized to x's dtype, then the BF16 grouped kernel
    (``fused_moe_triton``) over ``topk_ids`` (expert or slot ids; ids outside the bank add nothing). Same contract
    as ``nvfp4_moe_torch``, whose rounding it follows (it dequantizes the same way, then runs the same grouped
    math), plus the shared term when given, as ``fused_moe_triton`` adds it."""
    from .fused_moe import fused_moe_triton

    S = w13.shape[0]
    valid = (topk_ids >= 0) & (topk_ids < S)  # the BF16 kernel takes bank ids only: others weigh 0 on expert 0
    ids = torch.where(valid, topk_ids, 0)
    weights = torch.where(valid, topk_weights, 0)
    g13 = nvfp4_dequantize_triton(w13, w13_scale, w13_global, x.dtype)
    g2 = nvfp4_dequantize_triton(w2, w2_scale, w2_global, x.dtype)
    return fused_moe_triton(x, g13, g2, ids, weights, shared=shared, shared_gate=shared_gate, out=out)
