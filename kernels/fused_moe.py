"""Grouped MoE over all-resident fused experts.

Weights are laid out like transformers 5.x: ``w13 = experts.gate_up_proj [E, 2I, H]`` (rows ``[gate(I) | up(I)]``) and
``w2 = experts.down_proj [E, H, I]``. Routing comes in as ``topk_ids [T, k]`` (int) and ``topk_weights [T, k]``
(already renormalised, in x's dtype, as HF does). Output ``[T, H]`` in x's dtype:

    y[t] = sum_j w[t, j] * down_e( silu(gate_e x_t) * up_e x_t ),  e = topk_ids[t, j]

``fused_moe_torch`` is the reference (a loop over the experts that were hit, exactly HF's ``Qwen3_5MoeExperts``).
``fused_moe_triton`` sorts the (token, expert) pairs by expert, pads each expert's group to the block size, and runs two
grouped GEMMs: ``[E, 2I, H]`` with SiLU-and-mul fused into its epilogue, then ``[E, H, I]`` storing each row rounded to
the activation dtype; ``moe_combine.py`` applies the routing weights and sums the k rows of each token in fp32.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..tuning_env import int_from_env, with_overrides
from .device_sms import scaled
from .moe_combine import moe_combine_triton

try:  # triton is a hard dependency on GPU machines; keep the reference importable without it
    import triton
    import triton.language as tl

    from .pdl import pdl_launch, pdl_wait_then_release
except Exception:  # pragma: no cover
    triton = None
    tl = None


# decode-sized steps (at most this many (token, expert) pairs) gather their experts' weights instead of looping
_GATHER_PAIRS = 64


def fused_moe_torch(
    x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor
) -> torch.Tensor:
    """Reference: loop over the experts hit (HF ``Qwen3_5MoeExperts.forward``); a decode-sized step gathers the
    weights of its pairs instead (fixed shapes, no host sync: what a CPU stand-in for a CUDA graph can run)."""
    T, H = x.shape
    E = w13.shape[0]
    out = torch.zeros_like(x)
    if T == 0:
        return out
    if T * topk_ids.shape[1] <= _GATHER_PAIRS:
        return _moe_gather_torch(x, w13, w2, topk_ids, topk_weights)
    flat = topk_ids.reshape(-1).to(torch.int64)
    hit = torch.unique(flat).tolist()
    k = topk_ids.shape[1]
    for e in hit:
        if e < 0 or e >= E:
            continue
        pos = (flat == e).nonzero(as_tuple=True)[0]
        tok, slot = pos // k, pos % k
        gate, up = F.linear(x[tok], w13[e]).chunk(2, dim=-1)
        h = F.linear(F.silu(gate) * up, w2[e])
        h = h * topk_weights[tok, slot, None]
        out.index_add_(0, tok, h.to(out.dtype))
    return out


def _moe_gather_torch(x, w13, w2, topk_ids, topk_weights) -> torch.Tensor:
    """Each (token, expert) pair with its own copy of the expert's weights: ``[T*k, ...]`` batched matmuls, rounded
    where the loop rounds. Ids outside ``[0, E)`` contribute nothing."""
    T, k = topk_ids.shape
    E = w13.shape[0]
    ids = topk_ids.reshape(-1).to(torch.int64)
    valid = (ids >= 0) & (ids < E)
    ids = ids.clamp(0, E - 1)
    xs = x.repeat_interleave(k, dim=0)[:, :, None]  # [P, H, 1]
    gate, up = torch.bmm(w13[ids], xs)[..., 0].chunk(2, dim=-1)
    h = torch.bmm(w2[ids], (F.silu(gate) * up)[:, :, None])[..., 0]  # [P, H]
    # where, not a product: an invalid pair's clamped weights may be unwritten memory (a slot nothing was fetched
    # into, the hybrid backend's host pairs), and NaN * 0 is NaN
    h = torch.where(valid[:, None], h * topk_weights.reshape(-1, 1), 0)
    return h.view(T, k, -1).sum(dim=1).to(x.dtype)


# ----------------------------------------------------------------------------------------------------------------------
# Triton
# ----------------------------------------------------------------------------------------------------------------------


def moe_align_block_size_torch(topk_ids: torch.Tensor, num_experts: int, block_m: int):
    """Reference for ``moe_align_block_size``. Sort the T*k (token, slot) pairs by expert and pad each expert's run to a multiple of ``block_m``.

    Returns ``sorted_ids [P]`` (flat pair index ``t*k + j``; padding = T*k), ``block_expert [P // block_m]`` (-1 for blocks
    past the last real one). ``P`` is an upper bound computed from shapes only. Pairs whose id lies outside
    ``[0, num_experts)`` are dropped (in no block: the padding rows of a MoE prefill graph). Nothing here syncs the
    host."""
    dev = topk_ids.device
    flat = topk_ids.reshape(-1).to(torch.int64)
    n = flat.numel()
    max_blocks = (n + min(num_experts, n) * (block_m - 1) + block_m - 1) // block_m
    P = max_blocks * block_m
    valid = (flat >= 0) & (flat < num_experts)
    binned = torch.where(valid, flat, num_experts)  # one bin past the experts for dropped pairs
    # scatter_add, not bincount: bincount syncs the host on CUDA (and so cannot be captured in a CUDA graph)
    counts = torch.zeros(num_experts + 1, dtype=torch.int64, device=dev).scatter_add_(0, binned, valid.long())
    padded = (counts + block_m - 1) // block_m * block_m
    pad_end = torch.cumsum(padded, 0)
    pad_start = pad_end - padded
    start = torch.cumsum(counts, 0) - counts
    order = torch.argsort(binned, stable=True)  # dropped pairs sort last, past every expert's run
    sorted_e = binned[order]
    dest = pad_start[sorted_e] + torch.arange(n, device=dev) - start[sorted_e]
    dest = torch.where(sorted_e < num_experts, dest, P)  # dropped pairs land in a spare entry, cut off below
    sorted_ids = torch.full((P + 1,), n, dtype=torch.int64, device=dev)
    sorted_ids[dest] = order
    sorted_ids = sorted_ids[:P]
    pad_end = pad_end[:num_experts]
    block_start = torch.arange(max_blocks, device=dev) * block_m
    block_expert = torch.searchsorted(pad_end, block_start, right=True)
    block_expert = torch.where(block_expert >= num_experts, -1, block_expert)
    return sorted_ids.to(torch.int32), block_expert.to(torch.int32)


if triton is not None:
    # Pair and block counts are not specialized: Triton would compile another kernel for a count divisible by 16
    # (any chunk of an even number of tokens, top-8), on the request path of the first such chunk (~0.9 s on the H200
    # at 2,048 tokens, 2026-12-03); the counts only bound loops and masks.
    #
    # A block is BLOCK_M rows, plus TAIL rows (a second, smaller row tile) when TAIL > 0: an expert whose run is a
    # little longer than BLOCK_M (68 pairs an expert at Qwen3.6's 2,184-token agent turn) then takes one program per
    # weight tile, which reads the tile once for both row tiles, where 64-row blocks give it two programs reading
    # the same weights (the second from L2, for its 4 rows) and 128-row blocks multiply 60 rows of padding. A tail
    # that holds only padding (its first row is padding: each run's padding comes last) is skipped. The tail's dots
    # run transposed (weight tileᵀ · tail rowsᵀ: the weight tile as wgmma's 64-row A operand, the 16-32 tail rows as
    # its N): as rows·tile, ptxas serialized every wgmma of the kernel (its C7515 advisory, triton 3.6 for sm_90),
    # the block's own dots included; transposed they all stay asynchronous (tests/test_sm90_compile.py).

    @triton.jit
    def _block_rows(sorted_ids_ptr, first, num_pairs, ROWS: tl.constexpr):
        """The pair of each of ``ROWS`` sorted rows from ``first``, and which are real (not padding)."""
        pair = tl.load(sorted_ids_ptr + first + tl.arange(0, ROWS))
        return pair, pair < num_pairs

    # A kernel with TAIL > 0 takes its block's tail rows from ``_tail_rows``, one without from ``_no_tail_rows``, as
    #     has_tail = False
    #     if TAIL > 0: pair_t, t_mask, has_tail = _tail_rows(...)
    #     else: pair_t, t_mask = _no_tail_rows(...)
    # so that without a tail ``if has_tail:`` is decided at compile time (no tail loop compiled). Shared with the
    # grouped NVFP4 kernels (``nvfp4_moe.py``).

    @triton.jit
    def _tail_rows(sorted_ids_ptr, first, num_pairs, BLOCK_M: tl.constexpr, TAIL_ROWS: tl.constexpr):
        """The tail of the block from sorted row ``first``: its pairs, which are real, and whether it holds any (its
        first row says: each expert's padding comes last)."""
        pair_t, t_mask = _block_rows(sorted_ids_ptr, first + BLOCK_M, num_pairs, TAIL_ROWS)
        return pair_t, t_mask, tl.load(sorted_ids_ptr + first + BLOCK_M) < num_pairs

    @triton.jit
    def _no_tail_rows(num_pairs, TAIL_ROWS: tl.constexpr):
        """Tail shapes for a kernel without a tail (never loaded, never computed)."""
        pair_t = tl.zeros((TAIL_ROWS,), dtype=tl.int32) + num_pairs
        return pair_t, pair_t < num_pairs

    @triton.jit
    def _silu_mul_store(acc_g, acc_u, out_ptr, pair, m_mask, offs_n, n_mask, stride_ot):
        # match the reference's rounding: gate/up are rounded to the activation dtype before SiLU-and-mul
        gq = acc_g.to(out_ptr.dtype.element_ty).to(tl.float32)
        uq = acc_u.to(out_ptr.dtype.element_ty).to(tl.float32)
        h = gq / (1.0 + tl.exp(-gq)) * uq
        o_ptrs = out_ptr + pair[:, None].to(tl.int64) * stride_ot + offs_n[None, :]
        tl.store(o_ptrs, h.to(out_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])

    @triton.jit
    def _gate_up_tiles(
        x_ptr, stride_xt, tok, m_mask, tok_t, t_mask, g_ptrs, u_ptrs, n_mask, H,
        BLOCK_M: tl.constexpr, TAIL_ROWS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
        DOT_PREC: tl.constexpr, WITH_TAIL: tl.constexpr,
    ):  # fmt: skip
        """gate and up of the block's rows (and of its tail rows, ``WITH_TAIL``), each weight tile loaded once."""
        offs_k = tl.arange(0, BLOCK_K)
        a_ptrs = x_ptr + tok[:, None].to(tl.int64) * stride_xt + offs_k[None, :]
        t_ptrs = x_ptr + tok_t[:, None].to(tl.int64) * stride_xt + offs_k[None, :]
        acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        tail_g = tl.zeros((BLOCK_N, TAIL_ROWS), dtype=tl.float32)
        tail_u = tl.zeros((BLOCK_N, TAIL_ROWS), dtype=tl.float32)
        for k0 in range(0, H, BLOCK_K):
            k_mask = (offs_k + k0) < H
            a = tl.load(a_ptrs, mask=m_mask[:, None] & k_mask[None, :], other=0.0)
            g = tl.load(g_ptrs, mask=k_mask[:, None] & n_mask[None, :], other=0.0)
            u = tl.load(u_ptrs, mask=k_mask[:, None] & n_mask[None, :], other=0.0)
            acc_g = tl.dot(a, g, acc_g, input_precision=DOT_PREC)
            acc_u = tl.dot(a, u, acc_u, input_precision=DOT_PREC)
            if WITH_TAIL:
                at = tl.load(t_ptrs, mask=t_mask[:, None] & k_mask[None, :], other=0.0)
                tail_g = tl.dot(tl.trans(g), tl.trans(at), tail_g, input_precision=DOT_PREC)
                tail_u = tl.dot(tl.trans(u), tl.trans(at), tail_u, input_precision=DOT_PREC)
                t_ptrs += BLOCK_K
            a_ptrs += BLOCK_K
            g_ptrs += BLOCK_K
            u_ptrs += BLOCK_K
        return acc_g, acc_u, tl.trans(tail_g), tl.trans(tail_u)

    @triton.jit(do_not_specialize=["num_pairs"])
    def _moe_gate_up_kernel(
        x_ptr,  # [T, H]
        w_ptr,  # [E, 2I, H]
        out_ptr,  # [T*k, I]
        sorted_ids_ptr,
        block_expert_ptr,
        num_pairs,
        H,
        I,
        stride_xt,
        stride_we,
        stride_wn,
        stride_ot,
        TOPK: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
        DOT_PREC: tl.constexpr,
        TAIL: tl.constexpr = 0,  # tail rows a block (0: none), see above
        TAIL_ROWS: tl.constexpr = 16,  # the tail tile's rows: TAIL, or a shape when there is none (never computed)
        PDL: tl.constexpr = False,  # kernels/pdl.py
    ):
        pdl_wait_then_release(PDL)
        pid_m = tl.program_id(0)
        pid_n = tl.program_id(1)
        e = tl.load(block_expert_ptr + pid_m)
        if e >= 0:
            first = pid_m * (BLOCK_M + TAIL)
            pair, m_mask = _block_rows(sorted_ids_ptr, first, num_pairs, BLOCK_M)
            offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
            n_mask = offs_n < I
            offs_k = tl.arange(0, BLOCK_K)
            w_base = w_ptr + e.to(tl.int64) * stride_we
            g_ptrs = w_base + offs_n[None, :].to(tl.int64) * stride_wn + offs_k[:, None]
            u_ptrs = w_base + (offs_n[None, :] + I).to(tl.int64) * stride_wn + offs_k[:, None]
            has_tail = False
            if TAIL > 0:
                pair_t, t_mask, has_tail = _tail_rows(sorted_ids_ptr, first, num_pairs, BLOCK_M, TAIL_ROWS)
            else:
                pair_t, t_mask = _no_tail_rows(num_pairs, TAIL_ROWS)
            if has_tail:
                acc_g, acc_u, tail_g, tail_u = _gate_up_tiles(
                    x_ptr, stride_xt, pair // TOPK, m_mask, pair_t // TOPK, t_mask, g_ptrs, u_ptrs, n_mask, H,
                    BLOCK_M, TAIL_ROWS, BLOCK_N, BLOCK_K, DOT_PREC, True,
                )  # fmt: skip
                _silu_mul_store(acc_g, acc_u, out_ptr, pair, m_mask, offs_n, n_mask, stride_ot)
                _silu_mul_store(tail_g, tail_u, out_ptr, pair_t, t_mask, offs_n, n_mask, stride_ot)
            else:
                acc_g, acc_u, _, _ = _gate_up_tiles(
                    x_ptr, stride_xt, pair // TOPK, m_mask, pair_t // TOPK, t_mask, g_ptrs, u_ptrs, n_mask, H,
                    BLOCK_M, TAIL_ROWS, BLOCK_N, BLOCK_K, DOT_PREC, False,
                )  # fmt: skip
                _silu_mul_store(acc_g, acc_u, out_ptr, pair, m_mask, offs_n, n_mask, stride_ot)

    @triton.jit
    def _down_k_step(a_ptrs, m_mask, w_ptrs, n_mask, k_mask, acc, DOT_PREC: tl.constexpr):
        """One K step of a down tile: the block's rows' K slice times the weight tile's (returned for a tail)."""
        a = tl.load(a_ptrs, mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        w = tl.load(w_ptrs, mask=k_mask[:, None] & n_mask[None, :], other=0.0)
        return tl.dot(a, w, acc, input_precision=DOT_PREC), w

    @triton.jit
    def _down_tiles(
        h_ptr, stride_ht, pair, m_mask, pair_t, t_mask, w_ptrs, n_mask, I,
        BLOCK_M: tl.constexpr, TAIL_ROWS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
        DOT_PREC: tl.constexpr, WITH_TAIL: tl.constexpr,
    ):  # fmt: skip
        """The down projection of the block's rows (and of its tail rows, ``WITH_TAIL``), each weight tile loaded
        once."""
        offs_k = tl.arange(0, BLOCK_K)
        a_ptrs = h_ptr + pair[:, None].to(tl.int64) * stride_ht + offs_k[None, :]
        t_ptrs = h_ptr + pair_t[:, None].to(tl.int64) * stride_ht + offs_k[None, :]
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        tail = tl.zeros((BLOCK_N, TAIL_ROWS), dtype=tl.float32)
        for k0 in range(0, I, BLOCK_K):
            k_mask = (offs_k + k0) < I
            acc, w = _down_k_step(a_ptrs, m_mask, w_ptrs, n_mask, k_mask, acc, DOT_PREC)
            if WITH_TAIL:
                at = tl.load(t_ptrs, mask=t_mask[:, None] & k_mask[None, :], other=0.0)
                tail = tl.dot(tl.trans(w), tl.trans(at), tail, input_precision=DOT_PREC)
                t_ptrs += BLOCK_K
            a_ptrs += BLOCK_K
            w_ptrs += BLOCK_K
        return acc, tl.trans(tail)

    @triton.jit
    def _rows_store(acc, out_ptr, pair, m_mask, offs_n, n_mask, stride_ot):
        # the reference rounds the down projection to the activation dtype (the combine then scales it by the
        # routing weight in fp32): stored rounded, half the bytes of an fp32 row and nothing lost
        o_ptrs = out_ptr + pair[:, None].to(tl.int64) * stride_ot + offs_n[None, :]
        tl.store(o_ptrs, acc.to(out_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])

    # The down projection's K is the expert's intermediate size (512 for Qwen3.6: 8 steps of 64), so each one-tile
    # program of the down kernel fills its pipeline, runs a few steps and drains it to store its tile; it streamed its
    # weights at ~59 % of HBM where gate|up (32 steps) reached ~78 % (H200, the agent turn's 2,184 tokens). With
    # WALK > 1 a program walks that many consecutive N tiles of its block in one flattened loop, storing each tile at
    # its last K step: the next tile's loads are already in flight while this one's rows are stored (the block's
    # rows are read again for every tile, from L2). No tail tile (``grouped_bf16_config`` drops the walk for one).

    @triton.jit
    def _down_walk_rows(
        h_ptr, stride_ht, pair, m_mask, w_expert, stride_wn, out_ptr, stride_ot, first_n, H, I,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT_PREC: tl.constexpr,
        WALK: tl.constexpr,
    ):  # fmt: skip
        """The block's down projection rows over ``WALK`` N tiles from column ``first_n``, each stored when done."""
        offs_k = tl.arange(0, BLOCK_K)
        offs_tile = tl.arange(0, BLOCK_N)
        a_rows = h_ptr + pair[:, None].to(tl.int64) * stride_ht
        k_steps = tl.cdiv(I, BLOCK_K)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for step in range(0, WALK * k_steps):
            tile = step // k_steps
            k0 = (step - tile * k_steps) * BLOCK_K
            offs_n = first_n + tile * BLOCK_N + offs_tile
            n_mask = offs_n < H
            k_mask = (offs_k + k0) < I
            w_ptrs = w_expert + offs_n[None, :].to(tl.int64) * stride_wn + (offs_k + k0)[:, None]
            acc, _ = _down_k_step(a_rows + (offs_k + k0)[None, :], m_mask, w_ptrs, n_mask, k_mask, acc, DOT_PREC)
            if k0 + BLOCK_K >= I:  # the tile's last K step: its rows are done
                _rows_store(acc, out_ptr, pair, m_mask, offs_n, n_mask, stride_ot)
                acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)

    @triton.jit(do_not_specialize=["num_pairs"])
    def _moe_down_kernel(
        h_ptr,  # [T*k, I]
        w_ptr,  # [E, H, I]
        out_ptr,  # [T*k, H] in h's dtype
        sorted_ids_ptr,
        block_expert_ptr,
        num_pairs,
        H,
        I,
        stride_ht,
        stride_we,
        stride_wn,
        stride_ot,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
        DOT_PREC: tl.constexpr,
        TAIL: tl.constexpr = 0,  # tail rows a block (0: none), as the gate|up kernel's
        TAIL_ROWS: tl.constexpr = 16,
        WALK: tl.constexpr = 1,  # N tiles a program (``_down_walk_rows``, without a tail; 1: one tile)
        PDL: tl.constexpr = False,  # kernels/pdl.py
    ):
        pdl_wait_then_release(PDL)
        pid_m = tl.program_id(0)
        pid_n = tl.program_id(1)
        e = tl.load(block_expert_ptr + pid_m)
        if WALK > 1:  # decided at compile time: the one-tile kernel below compiles as it did without the walk
            if e >= 0:
                pair, m_mask = _block_rows(sorted_ids_ptr, pid_m * BLOCK_M, num_pairs, BLOCK_M)
                w_expert = w_ptr + e.to(tl.int64) * stride_we
                _down_walk_rows(
                    h_ptr, stride_ht, pair, m_mask, w_expert, stride_wn, out_ptr, stride_ot, pid_n * WALK * BLOCK_N,
                    H, I, BLOCK_M, BLOCK_N, BLOCK_K, DOT_PREC, WALK,
                )  # fmt: skip
        elif e >= 0:
            first = pid_m * (BLOCK_M + TAIL)
            pair, m_mask = _block_rows(sorted_ids_ptr, first, num_pairs, BLOCK_M)
            offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
            n_mask = offs_n < H
            offs_k = tl.arange(0, BLOCK_K)
            w_ptrs = w_ptr + e.to(tl.int64) * stride_we + offs_n[None, :].to(tl.int64) * stride_wn + offs_k[:, None]
            has_tail = False
            if TAIL > 0:
                pair_t, t_mask, has_tail = _tail_rows(sorted_ids_ptr, first, num_pairs, BLOCK_M, TAIL_ROWS)
            else:
                pair_t, t_mask = _no_tail_rows(num_pairs, TAIL_ROWS)
            if has_tail:
                acc, tail = _down_tiles(
                    h_ptr, stride_ht, pair, m_mask, pair_t, t_mask, w_ptrs, n_mask, I,
                    BLOCK_M, TAIL_ROWS, BLOCK_N, BLOCK_K, DOT_PREC, True,
                )  # fmt: skip
                _rows_store(acc, out_ptr, pair, m_mask, offs_n, n_mask, stride_ot)
                _rows_store(tail, out_ptr, pair_t, t_mask, offs_n, n_mask, stride_ot)
            else:
                acc, _ = _down_tiles(
                    h_ptr, stride_ht, pair, m_mask, pair_t, t_mask, w_ptrs, n_mask, I,
                    BLOCK_M, TAIL_ROWS, BLOCK_N, BLOCK_K, DOT_PREC, False,
                )  # fmt: skip
                _rows_store(acc, out_ptr, pair, m_mask, offs_n, n_mask, stride_ot)


if triton is not None:

    @triton.jit
    def _max_combine(a, b):
        return tl.maximum(a, b)

    @triton.jit
    def _chunk_histogram(ids_ptr, start, n, num_experts, E_BINS: tl.constexpr, CHUNK: tl.constexpr):
        """Experts' counts among ids ``[start, start + CHUNK)`` (past ``n`` and outside ``[0, num_experts)``: a
        dummy bin, E_BINS > num_experts, which callers drop)."""
        offs = start + tl.arange(0, CHUNK)
        e = tl.load(ids_ptr + offs, mask=offs < n, other=0).to(tl.int32)
        e = tl.where((offs < n) & (e >= 0) & (e < num_experts), e, E_BINS - 1)
        return tl.histogram(e, E_BINS)

    @triton.jit(do_not_specialize=["n"])
    def _moe_align_count_kernel(
        ids_ptr, counts_ptr, n, num_experts, E_BINS: tl.constexpr, CHUNK: tl.constexpr, PDL: tl.constexpr = False
    ):
        # one chunk of ids a program, its counts added into the zeroed per-expert counts: the plan's histogram of a
        # prefill-sized step (17,472 ids at Qwen3.6's 2,184-token agent turn) in parallel, not in one program
        pdl_wait_then_release(PDL)  # kernels/pdl.py
        h = _chunk_histogram(ids_ptr, tl.program_id(0) * CHUNK, n, num_experts, E_BINS, CHUNK)
        bins = tl.arange(0, E_BINS)
        tl.atomic_add(counts_ptr + bins, h, mask=(bins < num_experts) & (h > 0), sem="relaxed")

    @triton.jit(do_not_specialize=["n", "max_blocks", "P"])
    def _moe_align_plan_kernel(
        ids_ptr,
        cursor_ptr,
        block_expert_ptr,
        sorted_ids_ptr,
        n,
        num_experts,
        max_blocks,
        P,
        BLOCK_M: tl.constexpr,
        E_BINS: tl.constexpr,
        CHUNK: tl.constexpr,
        BLOCK_B: tl.constexpr,
        COUNTED: tl.constexpr,  # cursor already holds the per-expert counts (``_moe_align_count_kernel``)
        PDL: tl.constexpr = False,  # kernels/pdl.py
    ):
        pdl_wait_then_release(PDL)
        # program 0: per-expert counts -> padded offsets (cursor), expert of every block; the others fill sorted_ids
        # with n, CHUNK entries each, beside it (in program 0 that fill was a third of the kernel's serial loop)
        pid = tl.program_id(0)
        if pid > 0:
            op = (pid - 1) * CHUNK + tl.arange(0, CHUNK)
            tl.store(sorted_ids_ptr + op, tl.zeros((CHUNK,), dtype=tl.int32) + n, mask=op < P)
            return
        bins = tl.arange(0, E_BINS)
        if COUNTED:
            counts = tl.load(cursor_ptr + bins, mask=bins < num_experts, other=0)
            tl.debug_barrier()  # every thread has read the counts before cursor is overwritten below
        else:
            counts = tl.zeros((E_BINS,), dtype=tl.int32)
            for start in range(0, n, CHUNK):
                counts += _chunk_histogram(ids_ptr, start, n, num_experts, E_BINS, CHUNK)
        counts = tl.where(bins < num_experts, counts, 0)
        padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
        pad_end = tl.cumsum(padded, 0)
        start = pad_end - padded
        tl.store(cursor_ptr + bins, start, mask=bins < num_experts)
        total = tl.sum(padded, 0)
        # expert of every block: -1 everywhere, each non-empty expert's id at its first block (distinct blocks, ids
        # rising with them), then a running max carries each id over the rest of its run. (Counting, per block, the
        # experts that end before it took a [blocks, E_BINS] comparison: most of this kernel's time.)
        for b0 in range(0, max_blocks, BLOCK_B):
            ob = b0 + tl.arange(0, BLOCK_B)
            tl.store(block_expert_ptr + ob, tl.full((BLOCK_B,), -1, tl.int32), mask=ob < max_blocks)
        tl.debug_barrier()  # the stores above land before the scatter below (other threads of this program)
        tl.store(block_expert_ptr + start // BLOCK_M, bins, mask=(bins < num_experts) & (padded > 0))
        tl.debug_barrier()
        carry = tl.full((), -1, tl.int32)
        for b0 in range(0, max_blocks, BLOCK_B):
            ob = b0 + tl.arange(0, BLOCK_B)
            ex = tl.load(block_expert_ptr + ob, mask=ob < max_blocks, other=-1)
            ex = tl.maximum(tl.associative_scan(ex, 0, _max_combine), carry)
            carry = tl.max(ex, 0)
            tl.store(block_expert_ptr + ob, tl.where(ob * BLOCK_M < total, ex, -1), mask=ob < max_blocks)

    @triton.jit(do_not_specialize=["n"])
    def _moe_align_scatter_kernel(
        ids_ptr, cursor_ptr, sorted_ids_ptr, n, num_experts, CHUNK: tl.constexpr, PDL: tl.constexpr = False
    ):
        pdl_wait_then_release(PDL)  # kernels/pdl.py
        offs = tl.program_id(0) * CHUNK + tl.arange(0, CHUNK)
        e = tl.load(ids_ptr + offs, mask=offs < n, other=0).to(tl.int32)
        mask = (offs < n) & (e >= 0) & (e < num_experts)  # the plan counted no others: dropped
        # order inside an expert's run is arbitrary: rows of a GEMM block are independent, so results are not
        pos = tl.atomic_add(cursor_ptr + e, 1, mask=mask)
        tl.store(sorted_ids_ptr + pos, offs.to(tl.int32), mask=mask)


# ids the plan kernel counts in its one program; more are counted by ``_moe_align_count_kernel`` first
_SERIAL_COUNT_IDS = 2048


def moe_align_block_size(topk_ids: torch.Tensor, num_experts: int, block_m: int):
    """Group the T*k (token, slot) pairs by expert, each expert's run padded to a multiple of ``block_m``.

    Returns ``sorted_ids [P]`` int32 (flat pair index ``t*k + j``; padding = T*k) and ``block_expert [P // block_m]``
    int32 (-1 for blocks past the last real one). ``P`` is an upper bound from shapes only: no host sync, CUDA-graph
    capturable. Pairs whose id lies outside ``[0, num_experts)`` are dropped (no block holds them). Two Triton launches (the plan, one program, with the padding fill in programs beside it; then an
    atomic scatter), and for more than ``_SERIAL_COUNT_IDS`` ids a parallel count before them (into a zeroed
    cursor); pairs inside one expert's run come in arbitrary order. ``moe_align_block_size_torch`` is the
    (stable) reference."""
    dev = topk_ids.device
    flat = topk_ids.reshape(-1)
    if not flat.is_contiguous():
        flat = flat.contiguous()
    n = flat.numel()
    max_blocks = (n + min(num_experts, n) * (block_m - 1) + block_m - 1) // block_m
    P = max_blocks * block_m
    # a step of more than a few chunks counts its ids in parallel first (one serial program took ~30 us of the
    # ~35 a layer at 17,472 ids); a decode-sized one keeps the single launch
    counted = n > _SERIAL_COUNT_IDS
    cursor = (torch.zeros if counted else torch.empty)(num_experts, dtype=torch.int32, device=dev)
    block_expert = torch.empty(max_blocks, dtype=torch.int32, device=dev)
    sorted_ids = torch.empty(P, dtype=torch.int32, device=dev)
    e_bins = triton.next_power_of_2(num_experts + 1)
    if counted:
        _moe_align_count_kernel[(triton.cdiv(n, 1024),)](
            flat, cursor, n, num_experts, E_BINS=e_bins, CHUNK=1024, **pdl_launch(flat)
        )
    _moe_align_plan_kernel[(1 + triton.cdiv(P, 1024),)](
        flat,
        cursor,
        block_expert,
        sorted_ids,
        n,
        num_experts,
        max_blocks,
        P,
        BLOCK_M=block_m,
        E_BINS=e_bins,
        CHUNK=1024,
        BLOCK_B=1024,
        COUNTED=counted,
        num_warps=4,  # 16 measured slower on the H200 (2.0 vs 1.5 ms for the agent turn's 40 layers, 2026-12-03)
        **pdl_launch(flat),
    )
    _moe_align_scatter_kernel[(triton.cdiv(n, 1024),)](
        flat,
        cursor,
        sorted_ids,
        n,
        num_experts,
        CHUNK=1024,
        num_warps=4,
        **pdl_launch(flat),
    )
    return sorted_ids, block_expert


# a weight-streaming kernel needs about two programs per SM (264 on the H200's 132; ``device_sms.scaled``) to reach
# HBM bandwidth
_MIN_PROGRAMS = 264


def _pick_block_m(num_pairs: int, num_experts: int) -> int:
    per_expert = num_pairs / max(1, min(num_experts, num_pairs))
    if per_expert <= 16:
        return 16
    if per_expert <= 64:
        return 32
    return 64


# the down walk of prefill-sized blocks (64 rows and more) by default: off, see grouped_bf16_config
_DOWN_WALK_PREFILL = 1


def grouped_bf16_config(num_pairs: int, E: int, block_m: int | None = None, tune=None) -> dict:
    """Launch settings of the grouped kernels: rows per block (``_pick_block_m``), the gate|up and down tiles
    (gate|up's BLOCK_N narrows in ``_launch_gate_up`` until the grid fills the machine), warps and pipeline stages
    (None: Triton's defaults); ``tune`` overrides any of them (benchmarks, tests)."""
    bm = block_m or _pick_block_m(num_pairs, E)
    # N tiles a down program walks in one pipelined loop (``_down_walk_rows``; 1: one tile a program), with 4
    # pipeline stages when it walks (unless ``tune`` sets ``down_stages``). Walking 4 on blocks of 64 rows and more
    # measured 1.03x / 1.04x of one tile a program at 2,184 tokens and 1.08x / 1.02x at 8,192 (H100, uniform / Zipf
    # routing; bench/results/2026-12-05-h100-qwen3.6-35b-a3b-moe-down-walk.txt) and its GPU tests pass with it on
    # everywhere, but the served agent session did not move (turn 10 at 20k: 63.6 / 64.0 ms walking, 63.4 not;
    # ...-2026-12-06-h100-...-20k-down-walk.txt), so it stays off (``_DOWN_WALK_PREFILL``).
    # FREETOKEN_BF16_MOE_DOWN_WALK sets it (an end-to-end A/B)
    walk = int_from_env("FREETOKEN_BF16_MOE_DOWN_WALK", _DOWN_WALK_PREFILL if bm >= 64 else 1, "tiles")
    cfg = {
        "block_m": bm,
        "gu_block_n": 64,
        "gu_block_k": 64,
        # 128: 2-3 % faster than 64 at the agent turn's 2,184 tokens under uniform and Zipf routing alike (H200,
        # 2026-12-04, bench/results/2026-12-04-h200-qwen3.6-35b-a3b-bf16-moe-sweep-down.txt)
        "down_block_n": 128,
        "down_block_k": 64,
        "warps": None,
        "stages": None,
        # the down kernel's own warps and stages (None: ``warps`` / ``stages``): its K (the expert's intermediate
        # size, 512 for Qwen3.6) is a quarter of gate|up's, so its programs are short
        "down_warps": None,
        "down_stages": None,  # 4 when the down programs walk (set below, after ``tune``)
        # rows of a block's tail tile (0, 16, 32 or 64): a block is block_m + tail rows, the tail computed only when
        # it holds a pair (see the kernels); 0: on an H100 at the agent turn's 2,184 tokens tails of 16 or 32 ran
        # 1.00-1.02x of none, uniform and Zipf (bench/results/2026-12-05-h100-qwen3.6-35b-a3b-bf16-moe-tails.txt).
        # FREETOKEN_BF16_MOE_TAIL sets it for an end-to-end A/B (read at each launch; a graph keeps its capture's)
        "tail": int_from_env("FREETOKEN_BF16_MOE_TAIL", 0, "rows"),
        "down_walk": walk,
    }
    cfg = with_overrides(cfg, tune, "grouped BF16")
    if cfg["tail"] not in (0, 16, 32, 64):
        raise ValueError(f"grouped BF16 tail {cfg['tail']}: expected 0, 16, 32 or 64 rows")
    if cfg["down_walk"] < 1:
        raise ValueError(f"grouped BF16 down_walk {cfg['down_walk']}: expected 1 or more tiles")
    if cfg["tail"]:  # the walking programs have no tail tile: a tail takes precedence, one N tile a program
        cfg["down_walk"] = 1
    if cfg["down_walk"] > 1 and "down_stages" not in (tune or {}):
        cfg["down_stages"] = 4
    return cfg


def fused_moe_triton(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    block_m: int | None = None,
    block_n: int | None = None,
    block_k: int | None = None,
    shared: torch.Tensor | None = None,
    shared_gate: torch.Tensor | None = None,
    tune: dict | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Grouped Triton MoE; same contract as ``fused_moe_torch``, plus ``sigmoid(shared_gate) * shared`` when given
    (``moe_combine.py``: the sum over k and the shared term in one launch). ``block_m``/``block_n``/``block_k`` pin
    the tiles (tests), ``tune`` any of ``grouped_bf16_config``'s settings; ``out [T, H]``: where the result is
    written (the combine writes it there). Works on CUDA, or on CPU under TRITON_INTERPRET=1."""
    assert triton is not None, "triton is not installed"
    T, H = x.shape
    E = w13.shape[0]
    k = topk_ids.shape[1]
    if T == 0:
        return torch.zeros_like(x) if out is None else out.zero_()
    x = x.contiguous()
    w13 = w13 if w13.stride(-1) == 1 else w13.contiguous()
    w2 = w2 if w2.stride(-1) == 1 else w2.contiguous()
    n = T * k
    tiles = {}  # block_n / block_k pin both kernels' tiles (tests); else grouped_bf16_config's
    if block_n is not None:
        tiles.update(gu_block_n=block_n, down_block_n=block_n)
    if block_k is not None:
        tiles.update(gu_block_k=block_k, down_block_k=block_k)
    cfg = grouped_bf16_config(n, E, block_m, {**tiles, **(tune or {})})
    sorted_ids, block_expert = moe_align_block_size(topk_ids, E, cfg["block_m"] + cfg["tail"])
    prec = "ieee" if x.dtype == torch.float32 else "tf32"  # fp32 must not silently drop to tf32
    inter = _launch_gate_up(x, w13, sorted_ids, block_expert, k, cfg, prec)
    partial = _launch_down(inter, w2, sorted_ids, block_expert, H, cfg, prec)
    return moe_combine_triton(partial, k, x.dtype, shared, shared_gate, weights=topk_weights, out=out)


def _launch_options(cfg: dict, kernel: str = "") -> dict:
    """``num_warps``/``num_stages`` for a launch, only where ``cfg`` sets them (else Triton's defaults);
    ``kernel="down_"`` prefers the down kernel's own settings."""
    opts = {}
    for key, name in (("num_warps", "warps"), ("num_stages", "stages")):
        value = cfg.get(kernel + name) or cfg[name]
        if value:
            opts[key] = value
    return opts


def _launch_gate_up(x, w13, sorted_ids, block_expert, k, cfg: dict, prec) -> torch.Tensor:
    """SiLU(gate) * up of every sorted (token, expert) row, block by expert block: ``[T * k, I]``."""
    n, H, I = x.shape[0] * k, x.shape[1], w13.shape[1] // 2
    nblocks = block_expert.numel()
    inter = torch.empty(n, I, dtype=x.dtype, device=x.device)
    bk1 = min(cfg["gu_block_k"], max(16, triton.next_power_of_2(H)))
    bn1, target = min(cfg["gu_block_n"], max(16, triton.next_power_of_2(I))), scaled(_MIN_PROGRAMS)
    while bn1 > 16 and nblocks * triton.cdiv(I, bn1) < target:  # decode: few blocks, spread over N
        bn1 //= 2
    _moe_gate_up_kernel[(nblocks, triton.cdiv(I, bn1))](
        x,
        w13,
        inter,
        sorted_ids,
        block_expert,
        n,
        H,
        I,
        x.stride(0),
        w13.stride(0),
        w13.stride(1),
        inter.stride(0),
        TOPK=k,
        BLOCK_M=cfg["block_m"],
        BLOCK_N=bn1,
        BLOCK_K=bk1,
        DOT_PREC=prec,
        TAIL=cfg["tail"],
        TAIL_ROWS=max(cfg["tail"], 16),
        **_launch_options(cfg),
        **pdl_launch(x),
    )
    return inter


def _launch_down(inter, w2, sorted_ids, block_expert, H, cfg: dict, prec) -> torch.Tensor:
    """Each row's down projection in the activation dtype: ``[T * k, H]`` (weighted and summed over k by the
    combine)."""
    n, I = inter.shape
    nblocks = block_expert.numel()
    partial = torch.empty(n, H, dtype=inter.dtype, device=inter.device)
    bk2 = min(cfg["down_block_k"], max(16, triton.next_power_of_2(I)))
    bn2 = min(cfg["down_block_n"], max(16, triton.next_power_of_2(H)))
    walk = min(cfg["down_walk"], triton.cdiv(H, bn2))
    _moe_down_kernel[(nblocks, triton.cdiv(H, bn2 * walk))](
        inter,
        w2,
        partial,
        sorted_ids,
        block_expert,
        n,
        H,
        I,
        inter.stride(0),
        w2.stride(0),
        w2.stride(1),
        partial.stride(0),
        BLOCK_M=cfg["block_m"],
        BLOCK_N=bn2,
        BLOCK_K=bk2,
        DOT_PREC=prec,
        TAIL=cfg["tail"],
        TAIL_ROWS=max(cfg["tail"], 16),
        WALK=walk,
        **_launch_options(cfg, "down_"),
        **pdl_launch(inter),
    )
    return partial
