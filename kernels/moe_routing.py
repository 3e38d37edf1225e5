"""MoE router top-k over a softmax as one Triton kernel, beside the torch reference it is tested against.

    probs = softmax(logits [T, E]) in fp32;  weights, ids = top-k(probs), largest first;
    weights /= weights.sum()   when renormalize                     -> ids int64 [T, k], weights fp32 [T, k]

The reference is ``SparseMoeBlock.route`` without the benchmark routing and without its final cast to the activation
dtype (callers cast; the fused MoE kernels take either). Logits may be bf16 / fp16 / fp32 and row-strided.

Triton: one program per row holds the whole row (E ≤ 512, padded to a power of two) and takes the maximum k times
(k ≤ 16), knocking each winner out. Ties between equal probabilities go to the lowest expert id, so ids are
deterministic; torch.topk leaves the order of ties unspecified (with real-valued logits they are measure-zero). No host
reads, sizes fixed by the shapes: CUDA-graph capturable. ``topk_softmax`` runs Triton on CUDA tensors and the reference
elsewhere.
"""

from __future__ import annotations

import torch

try:  # keep the reference importable without triton
    import triton
    import triton.language as tl

    from .pdl import pdl_launch, pdl_wait_then_release
except Exception:  # pragma: no cover
    triton = None
    tl = None

MAX_EXPERTS = 512
MAX_TOP_K = 16


def topk_softmax_torch(logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``SparseMoeBlock.route`` from the logits on: ``(ids int64 [T, k], weights fp32 [T, k])``."""
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    w, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        w = w / w.sum(dim=-1, keepdim=True)
    return ids, w


if triton is not None:

    @triton.jit
    def _topk_softmax_kernel(
        logits_ptr,
        ids_ptr,
        weights_ptr,
        E,
        stride_l,
        stride_ids,
        stride_w,
        TOP_K: tl.constexpr,
        RENORMALIZE: tl.constexpr,
        BLOCK_E: tl.constexpr,
        BLOCK_K: tl.constexpr,
        PDL: tl.constexpr = False,  # kernels/pdl.py
    ):
        pdl_wait_then_release(PDL)
        t = tl.program_id(0).to(tl.int64)
        e = tl.arange(0, BLOCK_E)
        e_mask = e < E
        logit = tl.load(logits_ptr + t * stride_l + e, mask=e_mask, other=float("-inf")).to(tl.float32)
        num = tl.exp(logit - tl.max(logit, 0))
        prob = num / tl.sum(num, 0)
        # probabilities are >= 0: -1 marks padding and experts already taken
        cand = tl.where(e_mask, prob, -1.0)
        slot = tl.arange(0, BLOCK_K)
        ids = tl.zeros((BLOCK_K,), dtype=tl.int32)
        w = tl.zeros((BLOCK_K,), dtype=tl.float32)
        for j in tl.static_range(TOP_K):
            best = tl.max(cand, 0)
            idx = tl.min(tl.where(cand == best, e, BLOCK_E), 0)  # lowest id among ties
            ids = tl.where(slot == j, idx, ids)
            w = tl.where(slot == j, best, w)
            cand = tl.where(e == idx, -1.0, cand)
        if RENORMALIZE:
            w = w / tl.sum(w, 0)  # slots >= TOP_K hold 0
        k_mask = slot < TOP_K
        tl.store(ids_ptr + t * stride_ids + slot, ids.to(tl.int64), mask=k_mask)
        tl.store(weights_ptr + t * stride_w + slot, w, mask=k_mask)


def topk_softmax_triton(logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as ``topk_softmax_torch``; CUDA, or CPU under TRITON_INTERPRET=1."""
    T, E = logits.shape
    assert E <= MAX_EXPERTS and 0 < top_k <= min(E, MAX_TOP_K), f"E={E} (max {MAX_EXPERTS}) k={top_k} (max {MAX_TOP_K})"
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    ids = torch.empty(T, top_k, dtype=torch.int64, device=logits.device)
    weights = torch.empty(T, top_k, dtype=torch.float32, device=logits.device)
    if T == 0:
        return ids, weights
    block_e = triton.next_power_of_2(E)
    _topk_softmax_kernel[(T,)](
        logits,
        ids,
        weights,
        E,
        logits.stride(0),
        ids.stride(0),
        weights.stride(0),
        TOP_K=top_k,
        RENORMALIZE=renormalize,
        BLOCK_E=block_e,
        BLOCK_K=triton.next_power_of_2(top_k),
        num_warps=4 if block_e >= 256 else 1,
        **pdl_launch(logits),
    )
    return ids, weights


def topk_softmax(logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton on CUDA tensors, the torch reference elsewhere."""
    if logits.is_cuda and triton is not None:
        return topk_softmax_triton(logits, top_k, renormalize)
    return topk_softmax_torch(logits, top_k, renormalize)
