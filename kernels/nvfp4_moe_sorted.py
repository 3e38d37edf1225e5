"""The NVFP4 MoE decode gate|up GEMV with the pairs grouped by expert: each expert's weights decoded once for all the
tokens routed to it (up to ``BLOCK_M`` a program), for steps of tens to hundreds of (token, expert) pairs.

Why: the decode GEMVs (``nvfp4_moe.py``) run one program per (token, expert) pair, so an expert that two tokens of the
step route to is read and decoded twice. Decoding is what bounds them (~6 instructions a weight against ~1 for each
row's multiply-add, ``nvfp4_tiles.py``), so at 32 decode streams (256 pairs over ~163 distinct experts of 256) a
third of the work is repeated; the grouped tensor-core kernel avoids the repeats but decodes into ``tl.dot`` tiles
at half the GEMV's rate and runs 16-row tiles for one or two tokens. Here the pairs are sorted by expert and padded
to ``BLOCK_M`` (``moe_align_block_size``, two launches, capturable); a program takes one block of one expert and a
block of its gate and up rows, decodes each weight word once and multiplies it into the ``BLOCK_M`` rows of x.

The output is the decode down kernel's input (``inter``, fp32, ``[T*k, 8, I/8]``, rounded as the per-pair kernel
rounds: gate, up, SiLU and the product each in x's dtype), so ``nvfp4_moe_decode_triton`` runs the same down kernel
after either. Pairs whose id is outside the bank (offload misses, graph padding) go to a dummy expert whose blocks
do nothing: the down kernel does not read their rows.
"""

from __future__ import annotations

import torch

try:  # keep the module importable without triton
    import triton
    import triton.language as tl

    from .fused_moe import moe_align_block_size
    from .nvfp4_tiles import block_scale, e2m1_word, split8, word_block_dot
except Exception:  # pragma: no cover
    triton = None
    tl = None

if triton is not None:

    @triton.jit
    def _pair_row(x_ptr, sorted_ids_ptr, slot, num_pairs, stride_xt, TOPK: tl.constexpr):
        """Block slot ``slot``'s pair -> (its token's row of x, whether it is a real pair)."""
        pair = tl.load(sorted_ids_ptr + slot)
        real = pair < num_pairs
        token = tl.where(real, pair // TOPK, 0).to(tl.int64)
        return x_ptr + token * stride_xt, pair, real

    @triton.jit
    def _row_step(v0, v1, v2, v3, v4, v5, v6, v7, scale, x_row, real, k0, offs_x, x_mask, ROWS, WORDS):
        """One decoded step times one gathered row of x (zeros for a padding slot): ``[ROWS, WORDS // 2]``."""
        xm = tl.load(x_row + k0 + offs_x, mask=x_mask & (offs_x * 0 + real.to(tl.int32) > 0), other=0.0)
        x0, x1, x2, x3, x4, x5, x6, x7 = split8(xm, WORDS)
        return word_block_dot(v0, v1, v2, v3, v4, v5, v6, v7, x0, x1, x2, x3, x4, x5, x6, x7, scale, ROWS, WORDS)

    @triton.jit
    def _store_inter(acc_g, acc_u, glob_g, glob_u, pair, real, inter_ptr, offs_n, n_mask, I: tl.constexpr, dt):
        """The per-pair kernel's epilogue for one row: gate, up, SiLU, product, each rounded to ``dt``; stored in the
        down kernel's order (column n at ``[n % 8, n // 8]``)."""
        gate = (tl.sum(acc_g, 1) * glob_g).to(dt).to(tl.float32)
        up = (tl.sum(acc_u, 1) * glob_u).to(dt).to(tl.float32)
        act = (gate / (1.0 + tl.exp(-gate))).to(dt).to(tl.float32)
        h = (act * up).to(dt).to(tl.float32)
        dst = inter_ptr + pair.to(tl.int64) * I + (offs_n % 8) * (I // 8) + offs_n // 8
        tl.store(dst, h, mask=n_mask & (offs_n * 0 + real.to(tl.int32) > 0))

    @triton.jit
    def _nvfp4_sorted_gate_up_kernel(
        x_ptr,  # [T, H]
        w_ptr,  # int32 words [S, 2I, H/8]
        s_ptr,  # uint8 e4m3 bits [S, 2I, H/16]
        g_ptr,  # fp32 [S, 2I]
        sorted_ids_ptr,  # [blocks * BLOCK_M] pair ids by expert (num_pairs = padding)
        block_expert_ptr,  # [blocks] the block's expert (num_slots or -1: nothing to do)
        inter_ptr,  # fp32 [T*k, 8, I/8]
        num_pairs,
        num_slots,
        stride_xt,
        stride_we,
        stride_wn,
        stride_se,
        stride_sn,
        stride_ge,
        H: tl.constexpr,
        I: tl.constexpr,
        TOPK: tl.constexpr,
        BLOCK_M: tl.constexpr,  # 1, 2 or 4 rows of x a program
        BLOCK_N: tl.constexpr,
        BLOCK_W: tl.constexpr,
        NUM_STAGES: tl.constexpr,
    ):
        dt = x_ptr.dtype.element_ty
        NB: tl.constexpr = BLOCK_W // 2
        blk = tl.program_id(0)
        e = tl.load(block_expert_ptr + blk)
        if (e >= 0) & (e < num_slots):
            e64 = e.to(tl.int64)
            offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
            n_mask = offs_n < I
            offs_w = tl.arange(0, BLOCK_W)
            offs_s = tl.arange(0, NB)
            offs_x = tl.arange(0, 8 * BLOCK_W)
            rows = offs_n[:, None].to(tl.int64)
            gw = w_ptr + e64 * stride_we + rows * stride_wn + offs_w[None, :]
            gs = s_ptr + e64 * stride_se + rows * stride_sn + offs_s[None, :]
            first = blk * BLOCK_M
            x0_row, p0, r0 = _pair_row(x_ptr, sorted_ids_ptr, first, num_pairs, stride_xt, TOPK)
            x1_row, p1, r1 = _pair_row(x_ptr, sorted_ids_ptr, first + (1 % BLOCK_M), num_pairs, stride_xt, TOPK)
            x2_row, p2, r2 = _pair_row(x_ptr, sorted_ids_ptr, first + (2 % BLOCK_M), num_pairs, stride_xt, TOPK)
            x3_row, p3, r3 = _pair_row(x_ptr, sorted_ids_ptr, first + (3 % BLOCK_M), num_pairs, stride_xt, TOPK)
            g0 = tl.zeros((BLOCK_N, NB), dtype=tl.float32)
            u0 = tl.zeros((BLOCK_N, NB), dtype=tl.float32)
            g1 = tl.zeros((BLOCK_N, NB), dtype=tl.float32)
            u1 = tl.zeros((BLOCK_N, NB), dtype=tl.float32)
            g2 = tl.zeros((BLOCK_N, NB), dtype=tl.float32)
            u2 = tl.zeros((BLOCK_N, NB), dtype=tl.float32)
            g3 = tl.zeros((BLOCK_N, NB), dtype=tl.float32)
            u3 = tl.zeros((BLOCK_N, NB), dtype=tl.float32)
            for kw0 in tl.range(0, H // 8, BLOCK_W, num_stages=NUM_STAGES):
                w_mask = n_mask[:, None] & ((kw0 + offs_w) < H // 8)[None, :]
                s_mask = n_mask[:, None] & ((kw0 // 2 + offs_s) < H // 16)[None, :]
                x_mask = (8 * kw0 + offs_x) < H
                k0 = 8 * kw0
                # gate rows: decoded once, used by every row of x
                a0, a1, a2, a3, a4, a5, a6, a7 = e2m1_word(tl.load(gw + kw0, mask=w_mask, other=0))
                sc = block_scale(tl.load(gs + kw0 // 2, mask=s_mask, other=0))
                g0 += _row_step(a0, a1, a2, a3, a4, a5, a6, a7, sc, x0_row, r0, k0, offs_x, x_mask, BLOCK_N, BLOCK_W)
                if BLOCK_M > 1:
                    g1 += _row_step(
                        a0, a1, a2, a3, a4, a5, a6, a7, sc, x1_row, r1, k0, offs_x, x_mask, BLOCK_N, BLOCK_W
                    )
                if BLOCK_M > 2:
                    g2 += _row_step(
                        a0, a1, a2, a3, a4, a5, a6, a7, sc, x2_row, r2, k0, offs_x, x_mask, BLOCK_N, BLOCK_W
                    )
                    g3 += _row_step(
                        a0, a1, a2, a3, a4, a5, a6, a7, sc, x3_row, r3, k0, offs_x, x_mask, BLOCK_N, BLOCK_W
                    )
                # up rows (I rows further down the bank)
                b0, b1, b2, b3, b4, b5, b6, b7 = e2m1_word(tl.load(gw + I * stride_wn + kw0, mask=w_mask, other=0))
                su = block_scale(tl.load(gs + I * stride_sn + kw0 // 2, mask=s_mask, other=0))
                u0 += _row_step(b0, b1, b2, b3, b4, b5, b6, b7, su, x0_row, r0, k0, offs_x, x_mask, BLOCK_N, BLOCK_W)
                if BLOCK_M > 1:
                    u1 += _row_step(
                        b0, b1, b2, b3, b4, b5, b6, b7, su, x1_row, r1, k0, offs_x, x_mask, BLOCK_N, BLOCK_W
                    )
                if BLOCK_M > 2:
                    u2 += _row_step(
                        b0, b1, b2, b3, b4, b5, b6, b7, su, x2_row, r2, k0, offs_x, x_mask, BLOCK_N, BLOCK_W
                    )
                    u3 += _row_step(
                        b0, b1, b2, b3, b4, b5, b6, b7, su, x3_row, r3, k0, offs_x, x_mask, BLOCK_N, BLOCK_W
                    )
            glob = g_ptr + e64 * stride_ge + offs_n
            glob_g = tl.load(glob, mask=n_mask, other=0.0)
            glob_u = tl.load(glob + I, mask=n_mask, other=0.0)
            _store_inter(g0, u0, glob_g, glob_u, p0, r0, inter_ptr, offs_n, n_mask, I, dt)
            if BLOCK_M > 1:
                _store_inter(g1, u1, glob_g, glob_u, p1, r1, inter_ptr, offs_n, n_mask, I, dt)
            if BLOCK_M > 2:
                _store_inter(g2, u2, glob_g, glob_u, p2, r2, inter_ptr, offs_n, n_mask, I, dt)
                _store_inter(g3, u3, glob_g, glob_u, p3, r3, inter_ptr, offs_n, n_mask, I, dt)


# Launch settings by rows of x a program (measured on the H200 at Qwen3.6's shapes, bench/nvfp4_kernel_bench.py
# --groups moe): (BLOCK_N, BLOCK_W)
_BLOCKS = {1: (16, 64), 2: (16, 64), 4: (16, 32)}


def nvfp4_sorted_gate_up(x, w13, w13_scale, w13_global, topk_ids, block_m: int, tune: dict | None = None):
    """``inter [T*k, I]`` (fp32, the decode down kernel's layout) for ``x [T, H]`` through the gate|up rows of the
    experts ``topk_ids [T, k]`` name (ids outside the bank's ``S`` leave their rows unwritten), ``block_m`` (1, 2, 4)
    rows of x a program. ``tune``: ``block_n`` / ``block_w`` / ``stages`` (benchmarks). CUDA, or CPU under
    TRITON_INTERPRET=1."""
    from .nvfp4_moe import _NUM_STAGES, _scale_bytes, _words

    assert triton is not None, "triton is not installed"
    if block_m not in (1, 2, 4):
        raise ValueError(f"block_m must be 1, 2 or 4, got {block_m}")
    T, H = x.shape
    S, two_i, _ = w13.shape
    I, k = two_i // 2, topk_ids.shape[1]
    n = T * k
    inter = torch.empty(n, I, dtype=torch.float32, device=x.device)
    if n == 0:
        return inter
    x = x if x.stride(-1) == 1 else x.contiguous()
    ids = topk_ids.reshape(-1)
    ids = torch.where((ids >= 0) & (ids < S), ids, S)  # outside the bank: the dummy expert S, whose blocks skip
    sorted_ids, block_expert = moe_align_block_size(ids, S + 1, block_m)
    bn, bw = _BLOCKS[block_m]
    tune = tune or {}
    bn, bw = tune.get("block_n", bn), min(tune.get("block_w", bw), triton.next_power_of_2(H // 8))
    w, s = _words(w13), _scale_bytes(w13_scale)
    _nvfp4_sorted_gate_up_kernel[(block_expert.numel(), triton.cdiv(I, bn))](
        x, w, s, w13_global, sorted_ids, block_expert, inter, n, S, x.stride(0), w.stride(0), w.stride(1),
        s.stride(0), s.stride(1), w13_global.stride(0), H=H, I=I, TOPK=k, BLOCK_M=block_m, BLOCK_N=bn, BLOCK_W=bw,
        NUM_STAGES=tune.get("stages", _NUM_STAGES), num_warps=4,
    )  # fmt: skip
    return inter
