"""Paged attention over the KV pool (``freetoken.cache.kv_pool.KVCachePool``), Triton kernels beside torch references.

Pool layout: ``k_cache [slots, nkv, D]``, ``v_cache [slots, nkv, Dv]``, ``req_to_token [rows, max_ctx]`` (int32 slot of
each position of each request row). The new tokens' K/V are stored in the pool *before* these kernels run, so every
key a query sees (cached prefix and new tokens alike) is read through ``req_to_token``.

- ``extend``: varlen new tokens (``cu_seqlens``) of each sequence attend causally to its whole context: new token i
  of sequence b sits at position ``prefix_lens[b] + i`` and sees keys ``0 .. prefix_lens[b] + i``. Serves prefill
  (prefix 0), chunked prefill / prefix-cache hits (prefix > 0) and mixed batches (decode rows are extend len 1).
  A short chunk after a long prefix has few, long programs: their keys are split (``pick_extend_splits``) and the
  partials merged by the decode's merge kernel.
- ``decode``: one query per sequence over ``context_lens[b]`` keys, split-K over the context (stage 1: each split
  writes a partial output and its log-sum-exp; stage 2 merges the splits). A whole GQA group of q heads shares each
  K/V tile load. An optional output gate (gated attention: ``out * sigmoid(gate)``, rounded as those two torch ops
  round) is applied by stage 2, saving the gated layer its sigmoid, its multiply and the copy of its strided gate.

GQA: kv head j serves q heads ``j·G … (j+1)·G−1`` (G = nh / nkv). Head dims up to 256; bf16 / fp16 / fp32 (fp32 runs
the dots in IEEE precision, never TF32). Accumulation is fp32; outputs are in q's dtype.

``TritonAttention`` wraps both as an ``AttentionBackend``; importing this module registers it as ``"triton"``.
"""

from __future__ import annotations

import math

import torch

from freetoken.layers.attention import AttentionBackend, gate_output, register_attention_backend
from freetoken.tuning_env import choice_from_env, switch_from_env

from .attention_cudnn import extend_attention_cudnn, use_cudnn_extend
from .device_sms import sm_count

try:
    import triton
    import triton.language as tl

    from .pdl import pdl_launch, pdl_wait_then_release
except Exception:  # pragma: no cover
    triton = None
    tl = None


# ----------------------------------------------------------------------------------------------------------------------
# torch references
# ----------------------------------------------------------------------------------------------------------------------


def extend_attention_torch(q, k_cache, v_cache, req_to_token, rows, cu_seqlens, prefix_lens, scale):
    """``q [T, nh, D]`` → ``[T, nh, Dv]``. Lengths may be tensors or lists (read on the host)."""
    cu = [int(x) for x in cu_seqlens.tolist()] if torch.is_tensor(cu_seqlens) else list(cu_seqlens)
    pre = [int(x) for x in prefix_lens.tolist()] if torch.is_tensor(prefix_lens) else list(prefix_lens)
    rows = [int(x) for x in rows.tolist()] if torch.is_tensor(rows) else list(rows)
    nh, nkv = q.shape[1], k_cache.shape[1]
    out = torch.empty(q.shape[0], nh, v_cache.shape[2], dtype=q.dtype, device=q.device)
    for b in range(len(rows)):
        s, e = cu[b], cu[b + 1]
        n, ctx = e - s, pre[b] + e - s
        slots = req_to_token[rows[b], :ctx].to(torch.int64)
        keys = k_cache[slots].float().repeat_interleave(nh // nkv, dim=1)
        vals = v_cache[slots].float().repeat_interleave(nh // nkv, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q[s:e].float(), keys) * scale
        qpos = torch.arange(ctx - n, ctx, device=q.device)[:, None]
        kpos = torch.arange(ctx, device=q.device)[None, :]
        probs = torch.softmax(scores.masked_fill(kpos > qpos, float("-inf")), dim=-1)
        out[s:e] = torch.einsum("hqk,khd->qhd", probs, vals).to(q.dtype)
    return out


def decode_attention_torch(q, k_cache, v_cache, req_to_token, rows, context_lens, scale, gate=None):
    """``q [B, nh, D]`` (one new token per sequence, already stored in the pool) → ``[B, nh, Dv]``, times
    ``sigmoid(gate [B, nh, Dv])`` when a gate is given."""
    ctx = [int(x) for x in context_lens.tolist()] if torch.is_tensor(context_lens) else list(context_lens)
    cu = list(range(len(ctx) + 1))
    out = extend_attention_torch(q, k_cache, v_cache, req_to_token, rows, cu, [c - 1 for c in ctx], scale)
    return gate_output(out, gate)


# ----------------------------------------------------------------------------------------------------------------------
# Triton kernels
# ----------------------------------------------------------------------------------------------------------------------

_LOG2E = 1.4426950408889634

if triton is not None:

    @triton.jit
    def _extend_tiles(
        q, K, V, slot_row, key_head_k, key_head_v, stride_kt, stride_vt, offs_d, offs_dv, d_mask, dv_mask, qpos,
        lo, hi, mask_from, m_i, l_i, acc, qk_scale,
        BLOCK_N: tl.constexpr, PREC: tl.constexpr, SLOT32: tl.constexpr, RESCALE_AT: tl.constexpr,
        ROW_RESCALE: tl.constexpr,
    ):  # fmt: skip
        """Keys ``[lo, hi)`` into the running softmax, every tile in one loop: the tiles every query of the block
        sees in full (before ``mask_from``, most tiles of a chunk after a long prefix) skip the causal mask, the
        others mask their scores. The running max moves (and the ``[BLOCK_M, Dv]`` accumulator is rescaled) only
        when some row's max grows by more than ``RESCALE_AT`` (log2 units): FlashAttention-4's lazy rescaling at 8
        (``exp2(s - m_i)`` stays <= 256: 5-9 % at head dim 256 on the H200), every growth at 0. ``acc / l_i`` and the
        log-sum-exp ``m_i + log2(l_i)`` carry the same max either way; rows without a visible key keep ``-inf``.
        One loop, not an unmasked loop and a masked one: ptxas serializes every wgmma of a kernel whose accumulators
        pass from one key loop into a second (C7515 in its ``-v`` output); here the 16 wgmmas of ``q·k`` issue back to
        back with one wait and the 4 of ``p·v`` stay in flight into the next tile (sm_90 SASS, triton 3.6). On the
        H200 that was worth 4-5 % on 8,192-token chunks and nothing at the agent turn (2026-12-05). A
        software-pipelined form (the next tile's ``q·k`` issued before this tile's ``p·v``, as FlashAttention-3
        overlaps a warpgroup) needs dots before and after the loop, which ptxas serializes again.
        ``ROW_RESCALE``: each row decides alone, without a branch (its alpha is 1 where its max stays): no max over
        the block's rows, whose two block-wide barriers a tile hold both warpgroups in step, for a multiply of the
        whole accumulator every tile (the default where the keys are split: ``row_rescale``)."""
        for start in range(lo, hi, BLOCK_N):
            offs_n = start + tl.arange(0, BLOCK_N)
            # keys past hi (the last tile's) read key hi - 1 again, unmasked: the score mask drops them (such a
            # tile is at or past mask_from), and a real key's finite V times p = 0 adds nothing
            slot = tl.load(slot_row + tl.minimum(offs_n, hi - 1))
            if not SLOT32:
                slot = slot.to(tl.int64)
            k = tl.load(K + slot[None, :] * stride_kt + key_head_k + offs_d[:, None], mask=d_mask[:, None], other=0.0)
            s = tl.dot(q, k, input_precision=PREC) * qk_scale
            if start + BLOCK_N > mask_from:  # a tile some query of the block must not see in full
                s = tl.where((offs_n[None, :] <= qpos[:, None]) & (offs_n < hi)[None, :], s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            if ROW_RESCALE:  # rows whose max stays keep alpha = 1 (-inf rows: 0, their acc and l_i are 0 anyway)
                m_new = tl.where(m_new > m_i + RESCALE_AT, m_new, m_i)
                alpha = tl.exp2(m_i - tl.where(m_new == float("-inf"), 0.0, m_new))
                acc = acc * alpha[:, None]
                l_i = l_i * alpha
                m_i = m_new
            elif tl.max((m_new > m_i + RESCALE_AT).to(tl.int32), 0) > 0:  # the first tile too (m_i = -inf)
                alpha = tl.exp2(m_i - tl.where(m_new == float("-inf"), 0.0, m_new))
                acc = acc * alpha[:, None]
                l_i = l_i * alpha
                m_i = m_new
            p = tl.exp2(s - tl.where(m_i == float("-inf"), 0.0, m_i)[:, None])  # rows without a visible key: 0
            l_i += tl.sum(p, 1)
            v = tl.load(V + slot[:, None] * stride_vt + key_head_v + offs_dv[None, :], mask=dv_mask[None, :], other=0.0)
            acc = tl.dot(p.to(v.dtype), v, acc, input_precision=PREC)
        return m_i, l_i, acc

    @triton.jit
    def _extend_kernel(
        Q,
        K,
        V,
        O,
        MidO,
        MidL,
        req_to_token,
        rows_ptr,
        cu_ptr,
        prefix_ptr,
        sm_scale,
        stride_qt,
        stride_qh,
        stride_kt,
        stride_kh,
        stride_vt,
        stride_vh,
        stride_ot,
        stride_oh,
        stride_rt,
        stride_mot,
        stride_moh,
        stride_mos,
        stride_mlt,
        stride_mlh,
        D,
        DV,
        NUM_SPLITS,
        GROUP: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_D: tl.constexpr,
        BLOCK_DV: tl.constexpr,
        PREC: tl.constexpr,
        SPLIT: tl.constexpr,  # NUM_SPLITS > 1: partial outputs and log-sum-exps into MidO / MidL, merged after
        LAZY: tl.constexpr,  # the running softmax rescales lazily (``_extend_tiles``)
        ROW_RESCALE: tl.constexpr,  # LAZY decided per row, without a branch (``_extend_tiles``)
        SLOT32: tl.constexpr,  # key offsets in int32: every K/V element offset fits (fewer address operations)
        PDL: tl.constexpr = False,  # kernels/pdl.py
    ):
        pdl_wait_then_release(PDL)
        pid_m = tl.program_id(0) // NUM_SPLITS
        split = tl.program_id(0) % NUM_SPLITS
        b = tl.program_id(1)
        h = tl.program_id(2)
        q_start = tl.load(cu_ptr + b)
        n = tl.load(cu_ptr + b + 1) - q_start
        if pid_m * BLOCK_M < n:
            prefix = tl.load(prefix_ptr + b)
            row = tl.load(rows_ptr + b).to(tl.int64)
            kvh = h // GROUP
            offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
            m_mask = offs_m < n
            qpos = prefix + offs_m
            offs_d = tl.arange(0, BLOCK_D)
            offs_dv = tl.arange(0, BLOCK_DV)
            d_mask = offs_d < D
            dv_mask = offs_dv < DV
            q_ptrs = Q + (q_start + offs_m)[:, None].to(tl.int64) * stride_qt + h * stride_qh + offs_d[None, :]
            q = tl.load(q_ptrs, mask=m_mask[:, None] & d_mask[None, :], other=0.0).to(K.dtype.element_ty)
            qk_scale = sm_scale * 1.4426950408889634
            m_i = tl.full((BLOCK_M,), float("-inf"), dtype=tl.float32)
            l_i = tl.zeros((BLOCK_M,), dtype=tl.float32)
            acc = tl.zeros((BLOCK_M, BLOCK_DV), dtype=tl.float32)
            end = prefix + tl.minimum((pid_m + 1) * BLOCK_M, n)  # keys past the block's last query are masked anyway
            # this split's keys: whole BLOCK_N tiles of [0, end), split 0 first (every query sees key 0)
            per_split = tl.cdiv(tl.cdiv(end, NUM_SPLITS), BLOCK_N) * BLOCK_N
            lo = split * per_split
            hi = tl.minimum(lo + per_split, end)
            slot_row = req_to_token + row * stride_rt
            # tiles every query of the block sees (keys up to its first query's position) skip the masks
            full = tl.maximum(tl.minimum(hi, prefix + pid_m * BLOCK_M + 1) - lo, 0) // BLOCK_N * BLOCK_N
            m_i, l_i, acc = _extend_tiles(
                q, K, V, slot_row, kvh * stride_kh, kvh * stride_vh, stride_kt, stride_vt, offs_d, offs_dv, d_mask,
                dv_mask, qpos, lo, hi, lo + full, m_i, l_i, acc, qk_scale, BLOCK_N, PREC, SLOT32, 8.0 if LAZY else 0.0,
                ROW_RESCALE,
            )  # fmt: skip
            l_safe = tl.where(l_i == 0.0, 1.0, l_i)
            out = acc / l_safe[:, None]
            tok = (q_start + offs_m).to(tl.int64)
            if SPLIT:  # as the decode splits: the partial output and its base-2 lse (-inf for no visible key)
                lse = tl.where(l_i == 0.0, float("-inf"), m_i + tl.log2(l_safe))
                mo_ptrs = MidO + tok[:, None] * stride_mot + h * stride_moh + split * stride_mos + offs_dv[None, :]
                tl.store(mo_ptrs, out, mask=m_mask[:, None] & dv_mask[None, :])
                tl.store(MidL + tok * stride_mlt + h * stride_mlh + split, lse, mask=m_mask)
            else:
                o_ptrs = O + tok[:, None] * stride_ot + h * stride_oh + offs_dv[None, :]
                tl.store(o_ptrs, out.to(O.dtype.element_ty), mask=m_mask[:, None] & dv_mask[None, :])

    @triton.jit
    def _decode_stage1_kernel(
        Q,
        K,
        V,
        MidO,
        MidL,
        req_to_token,
        rows_ptr,
        ctx_ptr,
        sm_scale,
        stride_qb,
        stride_qh,
        stride_kt,
        stride_kh,
        stride_vt,
        stride_vh,
        stride_mob,
        stride_moh,
        stride_mos,
        stride_mlb,
        stride_mlh,
        stride_rt,
        D,
        DV,
        NUM_SPLITS,
        GROUP: tl.constexpr,
        BLOCK_H: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_D: tl.constexpr,
        BLOCK_DV: tl.constexpr,
        PREC: tl.constexpr,
        PDL: tl.constexpr = False,  # kernels/pdl.py
    ):
        pdl_wait_then_release(PDL)
        b = tl.program_id(0)
        kvh = tl.program_id(1)
        split = tl.program_id(2)
        ctx = tl.load(ctx_ptr + b)
        row = tl.load(rows_ptr + b).to(tl.int64)
        chunk = tl.cdiv(ctx, NUM_SPLITS)
        lo = split * chunk
        hi = tl.minimum(lo + chunk, ctx)
        offs_g = tl.arange(0, BLOCK_H)
        g_mask = offs_g < GROUP
        heads = kvh * GROUP + offs_g
        offs_d = tl.arange(0, BLOCK_D)
        offs_dv = tl.arange(0, BLOCK_DV)
        d_mask = offs_d < D
        dv_mask = offs_dv < DV
        q = tl.load(
            Q + b * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
            mask=g_mask[:, None] & d_mask[None, :],
            other=0.0,
        ).to(K.dtype.element_ty)
        qk_scale = sm_scale * 1.4426950408889634
        m_i = tl.full((BLOCK_H,), float("-inf"), dtype=tl.float32)
        l_i = tl.zeros((BLOCK_H,), dtype=tl.float32)
        acc = tl.zeros((BLOCK_H, BLOCK_DV), dtype=tl.float32)
        for start in range(lo, hi, BLOCK_N):
            offs_n = start + tl.arange(0, BLOCK_N)
            n_mask = offs_n < hi
            slot = tl.load(req_to_token + row * stride_rt + offs_n, mask=n_mask, other=0).to(tl.int64)
            k = tl.load(
                K + slot[None, :] * stride_kt + kvh * stride_kh + offs_d[:, None],
                mask=n_mask[None, :] & d_mask[:, None],
                other=0.0,
            )
            s = tl.dot(q, k, input_precision=PREC) * qk_scale
            s = tl.where(n_mask[None, :], s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            p = tl.exp2(s - m_safe[:, None])
            alpha = tl.exp2(m_i - m_safe)
            l_i = l_i * alpha + tl.sum(p, 1)
            v = tl.load(
                V + slot[:, None] * stride_vt + kvh * stride_vh + offs_dv[None, :],
                mask=n_mask[:, None] & dv_mask[None, :],
                other=0.0,
            )
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PREC)
            m_i = m_new
        # empty split (hi <= lo): l = 0, lse = -inf, merged with weight 0
        l_safe = tl.where(l_i == 0.0, 1.0, l_i)
        lse = tl.where(l_i == 0.0, float("-inf"), m_i + tl.log2(l_safe))  # base-2 lse
        mo_ptrs = MidO + b * stride_mob + heads[:, None] * stride_moh + split * stride_mos + offs_dv[None, :]
        tl.store(mo_ptrs, acc / l_safe[:, None], mask=g_mask[:, None] & dv_mask[None, :])
        tl.store(MidL + b * stride_mlb + heads * stride_mlh + split, lse, mask=g_mask)

    @triton.jit(do_not_specialize=["stride_mlb", "stride_mlh", "NUM_SPLITS"])  # one kernel for 2-8 splits
    def _decode_stage2_kernel(
        MidO,
        MidL,
        O,
        Gate,
        stride_mob,
        stride_moh,
        stride_mos,
        stride_mlb,
        stride_mlh,
        stride_ob,
        stride_oh,
        stride_gb,
        stride_gh,
        DV,
        NUM_SPLITS,
        BLOCK_S: tl.constexpr,
        BLOCK_DV: tl.constexpr,
        HAS_GATE: tl.constexpr,
        PDL: tl.constexpr = False,  # kernels/pdl.py
    ):
        pdl_wait_then_release(PDL)
        b = tl.program_id(0)
        h = tl.program_id(1)
        offs_s = tl.arange(0, BLOCK_S)
        s_mask = offs_s < NUM_SPLITS
        offs_dv = tl.arange(0, BLOCK_DV)
        dv_mask = offs_dv < DV
        lse = tl.load(MidL + b * stride_mlb + h * stride_mlh + offs_s, mask=s_mask, other=float("-inf"))
        m = tl.max(lse, 0)
        w = tl.exp2(lse - m)
        w = tl.where(s_mask, w, 0.0)
        o = tl.load(
            MidO + b * stride_mob + h * stride_moh + offs_s[:, None] * stride_mos + offs_dv[None, :],
            mask=s_mask[:, None] & dv_mask[None, :],
            other=0.0,
        )
        out = tl.sum(o * w[:, None], 0) / tl.sum(w, 0)
        if HAS_GATE:
            # ``out * torch.sigmoid(gate)`` in the output dtype: the output, the sigmoid and the product each rounded
            dt = O.dtype.element_ty
            g = tl.load(Gate + b * stride_gb + h * stride_gh + offs_dv, mask=dv_mask, other=0.0).to(tl.float32)
            sg = (1.0 / (1.0 + tl.exp(-g))).to(dt).to(tl.float32)
            out = out.to(dt).to(tl.float32) * sg
        tl.store(O + b * stride_ob + h * stride_oh + offs_dv, out.to(O.dtype.element_ty), mask=dv_mask)


def lazy_rescale() -> str:
    """How the extend kernel's running softmax rescales (``_extend_tiles``), from ``FREETOKEN_EXTEND_LAZY_RESCALE``:
    ``auto`` (the default) as ``row`` where a launch splits its keys, else as ``1``; ``1`` lazily, decided for the
    whole block; ``row`` lazily, decided per row without a branch; ``0`` at every growth of a row's max."""
    return choice_from_env("FREETOKEN_EXTEND_LAZY_RESCALE", "auto", ("auto", "1", "row", "0"))


def row_rescale(mode: str, splits: int) -> bool:
    """Whether a launch of ``splits`` key splits decides the lazy rescale per row (``lazy_rescale``'s ``mode``). H100,
    Qwen3.6's attention shape, two runs each way (bench/results/2026-12-05-h100-qwen3.6-35b-a3b-extend-attention-
    rescale-row.txt): per row won the agent turn's split launch (2,184 new after 27,816, three splits: 2.59-2.60 ms a
    layer against 2.75-2.83) and lost unsplit ones (8,192 after 21,808: 7.79-7.83 against 7.08-7.31)."""
    return mode == "row" or (mode == "auto" and splits > 1)


def int32_key_offsets(k_cache, v_cache) -> bool:
    """Every element offset of the K and V pools fits int32, so the extend kernel forms its gathered key addresses
    from int32 offsets (one wide multiply-add an element instead of 64-bit arithmetic), unless
    ``FREETOKEN_EXTEND_SLOT_INT32=0`` (A/B runs)."""
    if not switch_from_env("FREETOKEN_EXTEND_SLOT_INT32"):
        return False

    def last_offset(t) -> int:
        return sum((n - 1) * st for n, st in zip(t.shape, t.stride()))

    return max(last_offset(k_cache), last_offset(v_cache)) < 2**31 - 1


def _prec(dtype: torch.dtype) -> str:
    return "ieee" if dtype == torch.float32 else "tf32"  # fp32 must not silently drop to tf32


def _extend_config(q, k_cache, bd: int, bdv: int, max_extend_len: int) -> tuple[int, int, int, int]:
    """``(BLOCK_M, BLOCK_N, num_warps, num_stages)`` of the extend kernel. Head dims above 128 (Qwen3.5/3.6: 256)
    in 16-bit take 128 x 64 tiles where shared memory holds two stages of the K and V tiles beside the Q tile
    (sm_90: 228 KB per SM). Measured on the H200 at Qwen3.6's shape (bench/extend_attention_bench.py,
    2026-12-01): 2.4-3.2x the 32 x 32 tiles (a 2,184-token chunk after 27,816 cached: 4.6 ms a layer instead of
    10.9; 8,192 after 21,808: 9.1 ms instead of 28.8, 381 TFLOP/s) and 1.5-2x 64 x 64. sm_80/86/89 (100-164 KB)
    keep 32 x 32."""
    big = max(bd, bdv) > 128 or k_cache.dtype == torch.float32
    wide_smem = 2 * 2 * 64 * (bd + bdv) + 2 * 128 * bd  # bytes: two stages of 64-key K and V tiles, the Q tile
    if not big:
        cfg = (64, 64, 4, 2)
    elif k_cache.dtype != torch.float32 and q.is_cuda and _smem_per_block(q.device) >= wide_smem:
        cfg = (128, 64, 8, 2)
    else:
        cfg = (32, 32, 4, 2)
    if max_extend_len <= 16:  # a few new tokens (short prompts, mixed steps): 16-row tiles, as before
        cfg = (16, 32 if big else 64, 4, 2)
    return cfg


def _smem_per_block(device) -> int:
    props = torch.cuda.get_device_properties(device)
    return int(getattr(props, "shared_memory_per_block_optin", 0) or 0)


def pick_extend_splits(programs: int, max_context: int, slots_per_wave: int) -> int:
    """Key splits for the extend kernel's big tiles (one program per SM). A chunk of a couple of thousand tokens
    after a long cached prefix has few, long programs (Qwen3.6's 2,184 after 27,816: 18 query blocks x 16 heads =
    288 on 132 SMs, three waves of which the last is 18 % full: 73 % of the machine); splitting every program's
    keys S ways fills the waves (S = 3: 864 programs, 94 %) for one merge pass over ``[T, heads, S, Dv]`` fp32
    partials. The smallest S (up to 8, each split at least 2,048 keys) whose waves are >= 90 % full; 1 when the
    grid is already that full, so a long fresh prefill (its causal programs have uneven lengths anyway) never splits
    and the partials stay below ~8 waves' worth of query blocks (~140 MB at Qwen3.6's shape)."""

    def fill(p: int) -> float:
        return p / (math.ceil(p / slots_per_wave) * slots_per_wave)

    best = 1
    for s in range(1, 9):
        if s > 1 and max_context / s < 2048:
            break
        if fill(programs * s) > fill(programs * best) + 1e-9:
            best = s
        if fill(programs * s) >= 0.9:
            return s
    return best


def extend_launch(q, k_cache, v_cache, max_extend_len: int, batch: int, max_context: int, config=None, num_splits=0):
    """``((BLOCK_M, BLOCK_N, num_warps, num_stages), key splits)`` the extend launcher runs (``config`` and
    ``num_splits`` > 0 pin them): ``_extend_config``'s tiles, and ``pick_extend_splits`` for the big tiles."""
    bd, bdv = triton.next_power_of_2(q.shape[2]), triton.next_power_of_2(v_cache.shape[2])
    cfg = config or _extend_config(q, k_cache, bd, bdv, max_extend_len)
    if num_splits > 0:
        return cfg, num_splits
    if cfg[0] != 128:
        return cfg, 1
    programs = triton.cdiv(max_extend_len, cfg[0]) * batch * q.shape[1]
    return cfg, pick_extend_splits(programs, max_context, sm_count(q.device))


def extend_attention_triton(
    q,
    k_cache,
    v_cache,
    req_to_token,
    rows,
    cu_seqlens,
    prefix_lens,
    scale,
    max_extend_len: int,
    out=None,
    config=None,
    max_context: int = 0,
    num_splits: int = 0,
    gate=None,
):
    """Triton ``extend``; same contract as ``extend_attention_torch``, times ``sigmoid(gate [T, nh, Dv])`` when a
    gate is given (gated attention: in the key splits' merge when the keys are split, saving two elementwise
    launches, else by the layer's ``gate_output``). ``cu_seqlens``/``prefix_lens``/``rows`` are
    device int tensors; ``max_extend_len`` is a host int (sizes the grid without a sync). ``config``: pins
    ``(BLOCK_M, BLOCK_N, num_warps, num_stages)`` (tests and benchmarks), else ``_extend_config``. ``max_context``
    (host int, the longest sequence's prefix + new tokens) lets the big tiles split each program's keys
    (``pick_extend_splits``); ``num_splits`` pins the split count (tests, benchmarks)."""
    T, nh, D = q.shape
    nkv, DV = k_cache.shape[1], v_cache.shape[2]
    B = rows.numel()
    if out is None:
        out = torch.empty(T, nh, DV, dtype=q.dtype, device=q.device)
    if T == 0:
        return out
    assert k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1 and q.stride(-1) == 1
    bd, bdv = triton.next_power_of_2(D), triton.next_power_of_2(DV)
    rescale = lazy_rescale()
    (block_m, block_n, warps, stages), S = extend_launch(
        q, k_cache, v_cache, max_extend_len, B, max_context, config, num_splits
    )
    m_blocks = triton.cdiv(max_extend_len, block_m)
    mid_o = mid_l = out  # placeholders the kernel never touches without SPLIT
    if S > 1:
        mid_o = torch.empty(T, nh, S, DV, dtype=torch.float32, device=q.device)
        mid_l = torch.empty(T, nh, S, dtype=torch.float32, device=q.device)
    grid = (m_blocks * S, B, nh)
    _extend_kernel[grid](
        q,
        k_cache,
        v_cache,
        out,
        mid_o,
        mid_l,
        req_to_token,
        rows,
        cu_seqlens,
        prefix_lens,
        float(scale),
        q.stride(0),
        q.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        v_cache.stride(0),
        v_cache.stride(1),
        out.stride(0),
        out.stride(1),
        req_to_token.stride(0),
        *(mid_o.stride()[:3] if S > 1 else (0, 0, 0)),
        *(mid_l.stride()[:2] if S > 1 else (0, 0)),
        D,
        DV,
        S,
        GROUP=nh // nkv,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_D=bd,
        BLOCK_DV=bdv,
        PREC=_prec(k_cache.dtype),
        SPLIT=S > 1,
        LAZY=rescale != "0",
        ROW_RESCALE=row_rescale(rescale, S),
        # int32 offsets measured 9-11 % faster unsplit (8,192-token chunks, fresh and after 21,808) but 8 % slower
        # with the keys split (2,184 after 27,816, S = 3) on the H200 (2026-12-04): unsplit launches only
        SLOT32=S == 1 and int32_key_offsets(k_cache, v_cache),
        num_warps=warps,
        num_stages=stages,
        **pdl_launch(q),
    )
    if S > 1:
        if gate is not None and gate.stride(-1) != 1:
            gate = gate.contiguous()
        _combine_splits(mid_o, mid_l, out, gate)  # the decode merge: tokens as its batch rows
        return out
    return gate_output(out, gate)


def pick_num_kv_splits(batch_size: int, num_kv_heads: int, max_context: int) -> int:
    """Enough programs to fill the GPU (~132 SMs on H100/H200, two waves), splits of at least 256 keys, a power of
    two (the split count is a runtime argument; only the merge kernel's block size depends on it)."""
    by_len = max(1, math.ceil(max_context / 256))
    by_occupancy = max(1, math.ceil(264 / max(1, batch_size * num_kv_heads)))
    s = int(min(64, by_len, by_occupancy))
    return 1 << (s.bit_length() - 1)


def decode_attention_triton(
    q, k_cache, v_cache, req_to_token, rows, context_lens, scale, num_kv_splits: int = 8, out=None, gate=None,
    config: dict | None = None,
):  # fmt: skip
    """Triton split-K ``decode``; same contract as ``decode_attention_torch``. ``gate`` may be a strided view (its
    last dim contiguous), e.g. the gate half of a ``[B, nh, 2D]`` projection. ``config`` overrides stage 1's launch
    settings (``block_n``, ``warps``, ``stages``; benchmarks)."""
    B, nh, D = q.shape
    nkv, DV = k_cache.shape[1], v_cache.shape[2]
    if out is None:
        out = torch.empty(B, nh, DV, dtype=q.dtype, device=q.device)
    if B == 0:
        return out
    assert k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1 and q.stride(-1) == 1
    G = nh // nkv
    S = max(1, int(num_kv_splits))
    mid_o = torch.empty(B, nh, S, DV, dtype=torch.float32, device=q.device)
    mid_l = torch.empty(B, nh, S, dtype=torch.float32, device=q.device)
    bd, bdv = triton.next_power_of_2(D), triton.next_power_of_2(DV)
    cfg = dict(block_n=32 if max(bd, bdv) > 128 or k_cache.dtype == torch.float32 else 64, warps=4, stages=2)
    if set(config or {}) - set(cfg):
        raise ValueError(f"unknown decode attention launch settings {sorted(set(config) - set(cfg))}")
    cfg.update(config or {})
    _decode_stage1_kernel[(B, nkv, S)](
        q,
        k_cache,
        v_cache,
        mid_o,
        mid_l,
        req_to_token,
        rows,
        context_lens,
        float(scale),
        *q.stride()[:2],
        *k_cache.stride()[:2],
        *v_cache.stride()[:2],
        *mid_o.stride()[:3],
        *mid_l.stride()[:2],
        req_to_token.stride(0),
        D,
        DV,
        S,
        GROUP=G,
        BLOCK_H=max(16, triton.next_power_of_2(G)),
        BLOCK_N=cfg["block_n"],
        BLOCK_D=bd,
        BLOCK_DV=bdv,
        PREC=_prec(k_cache.dtype),
        num_warps=cfg["warps"],
        num_stages=cfg["stages"],
        **pdl_launch(q),
    )
    _combine_splits(mid_o, mid_l, out, gate)
    return out


def _combine_splits(mid_o, mid_l, out, gate) -> None:
    """Stage 2: each head's split partials merged by their log-sum-exp into ``out`` (times sigmoid(gate) if given)."""
    B, nh, S, DV = mid_o.shape
    if gate is not None:
        assert gate.shape == out.shape and gate.stride(-1) == 1, "the gate is [B, nh, Dv] with a contiguous last dim"
    g = out if gate is None else gate  # a placeholder the kernel never reads without HAS_GATE
    _decode_stage2_kernel[(B, nh)](
        mid_o,
        mid_l,
        out,
        g,
        *mid_o.stride()[:3],
        *mid_l.stride()[:2],
        *out.stride()[:2],
        *g.stride()[:2],
        DV,
        S,
        BLOCK_S=max(8, triton.next_power_of_2(S)),  # the extend's 2-8 key splits share one specialization
        BLOCK_DV=triton.next_power_of_2(DV),
        HAS_GATE=gate is not None,
        **pdl_launch(mid_o),
    )


# ----------------------------------------------------------------------------------------------------------------------
# backend
# ----------------------------------------------------------------------------------------------------------------------


class TritonAttention(AttentionBackend):
    """Paged attention with the Triton kernels: ``decode`` when every sequence has one new token over a cached
    prefix, ``extend`` otherwise (prefill, chunked prefill, mixed batches); with ``FREETOKEN_EXTEND_ATTENTION=cudnn``
    one long 16-bit chunk's ``extend`` on sm_90 goes through cuDNN instead (``attention_cudnn.py``)."""

    name = "triton"

    def __init__(self, num_kv_splits: int | None = None):
        self.num_kv_splits = num_kv_splits  # None: pick per step from the batch shape

    def forward(self, q, k, v, kv_layer, batch, scale, gate=None):
        self.store_kv(k, v, kv_layer, batch)
        kc, vc = batch.kv.k[kv_layer], batch.kv.v[kv_layer]
        q = q.contiguous()
        if batch.is_decode:
            S = (
                self.num_kv_splits
                or batch.num_kv_splits
                or pick_num_kv_splits(batch.num_seqs, kc.shape[1], max(batch.context_lens_cpu, default=1))
            )
            if gate is not None and gate.stride(-1) != 1:
                gate = gate.contiguous()
            return decode_attention_triton(
                q, kc, vc, batch.kv.req_to_token, batch.rows, batch.context_lens, scale, num_kv_splits=S, gate=gate
            )
        if use_cudnn_extend(q, kc, batch.num_seqs, batch.extend_lens_cpu[0]):
            ctx, prefix = batch.context_lens_cpu[0], batch.prefix_lens_cpu[0]
            slots = batch.kv.req_to_token.index_select(0, batch.rows[:1])[0, :ctx]  # device row index: no sync
            return gate_output(extend_attention_cudnn(q, kc, vc, slots, prefix, scale), gate)
        return extend_attention_triton(
            q,
            kc,
            vc,
            batch.kv.req_to_token,
            batch.rows,
            batch.cu_seqlens,
            batch.prefix_lens,
            scale,
            max_extend_len=max(batch.extend_lens_cpu, default=1),
            max_context=max(batch.context_lens_cpu, default=1),
            gate=gate,
        )


register_attention_backend("triton", TritonAttention)
