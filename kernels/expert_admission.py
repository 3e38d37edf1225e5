"""Admission of one MoE layer's routed experts into the device expert cache (the bookkeeping half of
``DeviceExpertCache.ensure``), with no host sync and shapes that depend only on the routing's ``[T, k]``.

State (device tensors, updated in place; see ``freetoken.moe.device_slot_cache``): ``slot_of [L*E + 1] int32``
(flat id ``layer*E + expert`` -> slot, -1 = not resident), ``owner [S + 1] int32`` (slot -> flat id, -1 = empty),
``stamp [S + 1] int64`` (the call that last used the slot, -1 = empty), ``clock [1] int64``, ``counts [2] int64``
(hits, misses; a third entry, if any, is not touched here), ``freq [L*E + 1] int32`` (how often each expert was routed to, resident or not, halved every
``age_every`` calls). The last entries of ``slot_of``, ``owner``, ``stamp`` and ``freq`` are trash: the torch
version sends masked-out updates there.

One call, exactly like the host ``ExpertSlotCache.lookup``: the clock ticks (and every ``age_every``-th tick halves
``freq``); each distinct expert of the valid rows (rows before ``num_valid_tokens``) counts once in ``freq`` and is
a hit (its slot is stamped with the clock) or a miss; the missing experts, in ascending expert id, take the slots
of smallest eviction key in ascending (key, slot index) order. The key is the slot's stamp (``lru``) or its
owner's ``freq`` (``lfu``; -1 for an empty slot), and a slot this call uses is never a victim (newest stamp;
excluded under ``lfu``). ``fetch_cap`` (the hybrid backend, ``moe/fetch_cap.FetchCap``; None: no cap) admits at
most ``fetch_cap.of(misses, valid tokens)`` of this call's misses, the most routed first (``freq`` after this call's
count; ties: lowest expert id); the others stay out of the cache, their pairs get slot id -1 (the host computes
them) and ``spilled [1] int64`` counts them (among the misses too). The kernel takes the cap's three numbers as
``max_fetch``, ``fetch_share`` and ``one_token_fetch`` (-1: none) and computes the rule from them on the device.
token. Returns ``(slot_ids [T, k] int64`` (0 on padding rows),
``job_src [P]``, ``job_dst [P]``, ``num_jobs``): miss r copies bank row ``job_src[r]`` into slot ``job_dst[r]`` for
``r < num_jobs`` (``kernels/expert_gather.py``). Entries past ``num_jobs`` are unspecified.

``admit_experts_torch``: the reference, in plain torch ops (a pairwise P x P compare for first occurrences and
miss ranks, ``topk`` over ``(key + 1) * S + slot`` for the P first victims, scatters redirected to the trash
entries). About 45 small kernels on CUDA. ``admit_experts_triton``: the same in one single-program kernel
launch, for the decode step's CUDA graph.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

import torch

if TYPE_CHECKING:
    from freetoken.moe.fetch_cap import FetchCap

try:  # triton is a hard dependency on GPU machines; keep the reference importable without it
    import triton
    import triton.language as tl

    from .pdl import pdl_launch, pdl_wait_then_release
except Exception:  # pragma: no cover
    triton = None
    tl = None


# an eviction key no victim search takes (the current call's slots under lfu)
NEVER_EVICT = 1 << 40

# the pool's stamps are scanned in blocks of SLOT_BLOCK, the pairwise compares run in tiles of PAIR_TILE columns
# (the interpreter test lowers both to cover several blocks and tiles)
SLOT_BLOCK = 1024
PAIR_TILE = 32


def _empty_result(T: int, k: int, device):
    empty = torch.zeros(0, dtype=torch.int64, device=device)
    return empty.view(T, k), empty, empty, torch.zeros((), dtype=torch.int64, device=device)


def age_frequencies_torch(freq, clock, age_every: int) -> None:
    """Every ``age_every``-th call halves the routing counts (fixed shape: no sync), so the cache follows a
    changing workload."""
    freq.copy_(torch.where(clock % age_every == 0, freq // 2, freq))


def admit_experts_torch(
    slot_of,
    owner,
    stamp,
    clock,
    counts,
    freq,
    topk_ids: torch.Tensor,
    layer: int,
    num_experts: int,
    num_valid_tokens: Optional[torch.Tensor] = None,
    lfu: bool = True,
    age_every: int = 1 << 20,
    fetch_cap: Optional[FetchCap] = None,
    spilled: Optional[torch.Tensor] = None,
):
    """Reference admission; see the module docstring."""
    T, k = topk_ids.shape
    P, S, E, dev = T * k, owner.numel() - 1, num_experts, slot_of.device
    trash_id = slot_of.numel() - 1
    clock += 1
    age_frequencies_torch(freq, clock, age_every)
    if P == 0:
        return _empty_result(T, k, dev)
    expert = topk_ids.reshape(-1).to(device=dev, dtype=torch.int64)
    position = torch.arange(P, device=dev)
    if num_valid_tokens is None:
        valid = torch.ones(P, dtype=torch.bool, device=dev)
    else:
        valid = position // k < num_valid_tokens.reshape(()).to(dev)
    flat = torch.where(valid, expert + layer * E, trash_id)

    # the first occurrence of each expert counts (the host looks at the unique ids)
    earlier = torch.ones(P, P, dtype=torch.bool, device=dev).tril(-1)  # [i, j]: j < i
    first = valid & ~((flat[:, None] == flat[None, :]) & earlier).any(1)
    current = slot_of[flat].long()
    hit = first & (current >= 0)
    miss = first & (current < 0)
    counts[:2] += torch.stack((hit.sum(), miss.sum()))
    freq.index_add_(0, torch.where(first, flat, trash_id), torch.ones(P, dtype=freq.dtype, device=dev))
    stamp.index_put_((torch.where(hit, current, S),), clock)
    if fetch_cap is not None:
        cap = torch.clamp((fetch_cap.share * miss.sum() + 999) // 1000, min=fetch_cap.floor)
        if fetch_cap.one_token is not None:
            tokens = torch.as_tensor(T if num_valid_tokens is None else num_valid_tokens.reshape(()), device=dev)
            cap = torch.where(tokens == 1, fetch_cap.one_token, cap)
        miss = _fetched_misses(miss, expert, freq[flat].long(), cap, spilled)

    # missing expert of rank r (ascending expert id) takes the r-th slot in ascending (eviction key, slot) order
    rank = (miss[None, :] & (expert[None, :] < expert[:, None])).sum(1)
    candidates = min(P, S)
    if lfu:
        own = owner[:S].long()
        score = torch.where(own >= 0, freq[own.clamp(min=0)].long(), -1)
        score = torch.where(stamp[:S] == clock, NEVER_EVICT, score)
    else:
        score = stamp[:S]
    key = (score + 1) * S + torch.arange(S, device=dev)
    victims = torch.topk(key, candidates, largest=False, sorted=True).indices
    victim = victims[rank.clamp(max=candidates - 1)]
    evicted = owner[victim].long()
    slot_of.index_fill_(0, torch.where(miss & (evicted >= 0), evicted, trash_id), -1)
    slot_of.index_put_((torch.where(miss, flat, trash_id),), victim.to(torch.int32))
    taken = torch.where(miss, victim, S)
    owner.index_put_((taken,), flat.to(torch.int32))
    stamp.index_put_((taken,), clock)

    job_src = torch.zeros(P + 1, dtype=torch.int64, device=dev)
    job_src.index_put_((torch.where(miss, rank, P),), expert)
    job_dst = victims[position.clamp(max=candidates - 1)]
    slot_ids = torch.where(valid, slot_of[flat].long(), 0).view(T, k)
    return slot_ids, job_src[:P], job_dst, miss.sum()


def _fetched_misses(miss, expert, routed, cap, spilled) -> torch.Tensor:
    """The misses ``cap`` (a device scalar) admits: a miss is ranked by the misses routed more often, or as often
    with a lower expert id (the host reference's lexsort); ranks from ``cap`` on spill to the host."""
    ahead = (routed[None, :] > routed[:, None]) | (
        (routed[None, :] == routed[:, None]) & (expert[None, :] < expert[:, None])
    )
    priority = (miss[None, :] & ahead).sum(1)
    spill = miss & (priority >= cap)
    if spilled is not None:
        spilled += spill.sum()
    return miss & ~spill


if triton is not None:
    _NEVER_EVICT = tl.constexpr(NEVER_EVICT)

    @triton.jit
    def _admit_kernel(
        ids_ptr,
        num_valid_ptr,  # [P] routed expert ids (row-major [T, k]); [1] valid rows (if HAS_VALID)
        slot_of_ptr,
        owner_ptr,
        stamp_ptr,
        clock_ptr,
        counts_ptr,
        freq_ptr,  # cache state, updated in place
        slot_ids_ptr,
        job_src_ptr,
        job_dst_ptr,
        num_jobs_ptr,  # outputs
        miss_expert_ptr,  # [P] scratch: the expert of each first-occurrence miss (fetched ones, with CAP), -1 elsewhere
        spilled_ptr,  # [1] misses left to the host (CAP)
        layer_base,
        P,
        S,
        num_flat,
        age_every,
        max_fetch,  # CAP: misses admitted at most (at least, with a share)
        fetch_share,  # CAP: per mille of the call's misses admitted, if more than max_fetch
        one_token_fetch,  # CAP: the cap of a call with one valid token instead (-1: none)
        K: tl.constexpr,
        LFU: tl.constexpr,
        HAS_VALID: tl.constexpr,
        PB: tl.constexpr,
        JB: tl.constexpr,
        SB: tl.constexpr,
        CAP: tl.constexpr = False,  # max_fetch applies (the hybrid backend)
        PDL: tl.constexpr = False,  # kernels/pdl.py
    ):
        pdl_wait_then_release(PDL)
        # One program: every decision depends on all P pairs and on the whole pool's stamps. The pairwise compares
        # run in [PB, JB] tiles (columns reloaded from memory) to bound registers. tl.debug_barrier (bar.sync)
        # orders this program's global reads and writes of the same addresses across its warps.
        offs = tl.arange(0, PB)
        in_range = offs < P
        if HAS_VALID:
            num_valid = tl.load(num_valid_ptr)
        else:
            num_valid = P
        valid = in_range & (offs // K < num_valid)
        expert = tl.load(ids_ptr + offs, mask=in_range, other=0).to(tl.int32)
        flat = tl.where(valid, expert + layer_base, -1)

        repeated = tl.zeros([PB], dtype=tl.int32)
        for j0 in range(0, P, JB):
            oj = j0 + tl.arange(0, JB)
            vj = (oj < P) & (oj // K < num_valid)
            fj = tl.where(vj, tl.load(ids_ptr + oj, mask=oj < P, other=0).to(tl.int32) + layer_base, -2)
            same = (fj[None, :] == flat[:, None]) & (oj[None, :] < offs[:, None])
            repeated = tl.maximum(repeated, tl.max(same.to(tl.int32), axis=1))
        first = valid & (repeated == 0)
        current = tl.load(slot_of_ptr + flat, mask=first, other=0)
        hit = first & (current >= 0)
        miss = first & (current < 0)
        num_hits = tl.sum(hit.to(tl.int64), axis=0)
        num_misses = tl.sum(miss.to(tl.int64), axis=0)
        clock = tl.load(clock_ptr) + 1
        hits_before = tl.load(counts_ptr)
        misses_before = tl.load(counts_ptr + 1)
        spilled_before = tl.load(spilled_ptr) if CAP else 0
        # warps run unsynchronised and replicate scalars: all must read before one of them writes
        tl.debug_barrier()
        tl.store(clock_ptr, clock)
        tl.store(counts_ptr, hits_before + num_hits)
        tl.store(counts_ptr + 1, misses_before + num_misses)
        tl.store(stamp_ptr + current, clock, mask=hit)  # before the search below: a hit is never a victim
        tl.store(miss_expert_ptr + offs, tl.where(miss, expert, -1), mask=in_range)
        if clock % age_every == 0:
            for f0 in range(0, num_flat, SB):
                fo = f0 + tl.arange(0, SB)
                tl.store(freq_ptr + fo, tl.load(freq_ptr + fo, mask=fo < num_flat) // 2, mask=fo < num_flat)
            tl.debug_barrier()
        routed = tl.load(freq_ptr + flat, mask=first, other=0)
        tl.debug_barrier()  # every copy of a count is read before one is written (the first occurrences differ)
        tl.store(freq_ptr + flat, routed + 1, mask=first)
        tl.debug_barrier()
        if CAP:
            # a miss's priority: the misses routed more often, or as often with a lower expert id, ahead of it
            mine = routed + 1
            priority = tl.zeros([PB], dtype=tl.int32)
            for j0 in range(0, P, JB):
                oj = j0 + tl.arange(0, JB)
                mj = tl.load(miss_expert_ptr + oj, mask=oj < P, other=-1)
                rj = tl.load(freq_ptr + layer_base + mj, mask=mj >= 0, other=0)
                ahead = (rj[None, :] > mine[:, None]) | (
                    (rj[None, :] == mine[:, None]) & (mj[None, :] < expert[:, None])
                )
                priority += tl.sum(((mj[None, :] >= 0) & ahead).to(tl.int32), axis=1)
            share_cap = (fetch_share * num_misses + 999) // 1000
            cap = tl.where(share_cap > max_fetch, share_cap, max_fetch)
            one_token = (one_token_fetch >= 0) & (tl.minimum(num_valid, P // K) == 1)
            cap = tl.where(one_token, one_token_fetch, cap)
            spill = miss & (priority >= cap)
            miss = miss & ~spill
            tl.debug_barrier()  # every warp has read the miss list before it shrinks to the fetched misses
            tl.store(miss_expert_ptr + offs, tl.where(miss, expert, -1), mask=in_range)
            tl.store(spilled_ptr, spilled_before + tl.sum(spill.to(tl.int64), axis=0))
            tl.debug_barrier()
        num_fetched = tl.sum(miss.to(tl.int64), axis=0)
        tl.store(num_jobs_ptr, num_fetched)

        rank = tl.zeros([PB], dtype=tl.int32)
        for j0 in range(0, P, JB):
            oj = j0 + tl.arange(0, JB)
            mj = tl.load(miss_expert_ptr + oj, mask=oj < P, other=-1)
            rank += tl.sum(((mj[None, :] >= 0) & (mj[None, :] < expert[:, None])).to(tl.int32), axis=1)

        # the r-th victim for r < num_misses: the smallest key (score + 1) * S + slot above the previous one (keys
        # are distinct). One pass over the pool per miss; a decode step misses a few experts per layer.
        never = 0x7FFFFFFFFFFFFFFF
        previous = tl.full([], -1, dtype=tl.int64)
        for r in range(num_fetched.to(tl.int32)):
            best = tl.full([], never, dtype=tl.int64)
            for s0 in range(0, S, SB):
                slots = s0 + tl.arange(0, SB)
                used = tl.load(stamp_ptr + slots, mask=slots < S, other=0)
                if LFU:
                    own = tl.load(owner_ptr + slots, mask=slots < S, other=-1)
                    score = tl.load(freq_ptr + own, mask=own >= 0, other=-1).to(tl.int64)
                    score = tl.where(used == clock, _NEVER_EVICT, score)
                else:
                    score = used
                key = (score + 1) * S + slots
                key = tl.where((slots < S) & (key > previous), key, never)
                best = tl.minimum(best, tl.min(key, axis=0))
            tl.store(job_dst_ptr + r, best % S)
            previous = best
        tl.debug_barrier()

        victim = tl.load(job_dst_ptr + rank, mask=miss, other=0)
        evicted = tl.load(owner_ptr + victim, mask=miss, other=-1)
        tl.debug_barrier()  # the old owners are read (in every warp holding a copy) before they change
        tl.store(slot_of_ptr + evicted, -1, mask=miss & (evicted >= 0))
        tl.store(slot_of_ptr + flat, victim, mask=miss)
        tl.store(owner_ptr + victim, flat, mask=miss)
        tl.store(stamp_ptr + victim, clock, mask=miss)
        tl.store(job_src_ptr + rank, expert.to(tl.int64), mask=miss)
        tl.debug_barrier()
        slot = tl.load(slot_of_ptr + flat, mask=valid, other=0)
        tl.store(slot_ids_ptr + offs, tl.where(valid, slot, 0).to(tl.int64), mask=in_range)


def admit_experts_triton(
    slot_of,
    owner,
    stamp,
    clock,
    counts,
    freq,
    topk_ids: torch.Tensor,
    layer: int,
    num_experts: int,
    num_valid_tokens: Optional[torch.Tensor] = None,
    lfu: bool = True,
    age_every: int = 1 << 20,
    fetch_cap: Optional[FetchCap] = None,
    spilled: Optional[torch.Tensor] = None,
):
    """Same contract as ``admit_experts_torch``, one kernel launch. Works on CUDA, or on CPU under
    TRITON_INTERPRET=1."""
    assert triton is not None, "triton is not installed"
    T, k = topk_ids.shape
    P, S, dev = T * k, owner.numel() - 1, slot_of.device
    if P == 0:
        clock += 1
        age_frequencies_torch(freq, clock, age_every)
        return _empty_result(T, k, dev)
    ids = topk_ids.reshape(-1)
    if not ids.is_contiguous():
        ids = ids.contiguous()
    slot_ids = torch.empty(P, dtype=torch.int64, device=dev)
    job_src = torch.empty(P, dtype=torch.int64, device=dev)
    job_dst = torch.empty(P, dtype=torch.int64, device=dev)
    num_jobs = torch.empty((), dtype=torch.int64, device=dev)
    miss_expert = torch.empty(P, dtype=torch.int32, device=dev)
    pb = triton.next_power_of_2(P)
    _admit_kernel[(1,)](
        ids,
        num_valid_tokens if num_valid_tokens is not None else ids,
        slot_of,
        owner,
        stamp,
        clock,
        counts,
        freq,
        slot_ids,
        job_src,
        job_dst,
        num_jobs,
        miss_expert,
        spilled if spilled is not None else torch.zeros(1, dtype=torch.int64, device=dev),
        layer * num_experts,
        P,
        S,
        freq.numel() - 1,
        age_every,
        P if fetch_cap is None else fetch_cap.floor,
        0 if fetch_cap is None else fetch_cap.share,
        -1 if fetch_cap is None or fetch_cap.one_token is None else fetch_cap.one_token,
        K=k,
        LFU=lfu,
        HAS_VALID=num_valid_tokens is not None,
        PB=pb,
        JB=min(pb, PAIR_TILE),
        SB=SLOT_BLOCK,
        CAP=fetch_cap is not None,
        num_warps=4,
        **pdl_launch(ids),
    )
    return slot_ids.view(T, k), job_src, job_dst, num_jobs
