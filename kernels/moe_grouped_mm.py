"""The BF16 grouped MoE through torch's grouped GEMM (``torch._grouped_mm``: CUTLASS's grouped kernel on sm_90).

Why a library route beside ``fused_moe.py``: a cached agent turn (issue 12) runs ~2,200 tokens through every MoE
layer, ~70 rows per expert, so each layer is one pass over all 256 experts' weights and the grouped GEMMs are bound
by HBM; our Triton kernels read them at ~66 % of the copy bandwidth. CUTLASS's grouped kernel (TMA loads,
warp-specialized persistent programs) is the reference point for what the hardware gives at that shape. Measured on
the H200 (2026-12-06, bench/results/2026-12-06-h200-qwen3.6-35b-a3b-bf16-moe-grouped-mm.txt): at 2,184 tokens its two
GEMMs alone take about what our whole MoE takes (1.11x uniform, 0.89x Zipf) and the route with its glue 0.83x / 0.70x;
at 8,192 the GEMMs are 1.34-1.42x ours but the glue takes it back. So it stays an A/B
(``FREETOKEN_BF16_MOE_GROUPED=grouped_mm``, ``layers/moe.grouped_gemm_choice``) and a benchmark baseline
(``bench/nvfp4_kernel_bench.py --groups grouped_mm``).

The pipeline (same contract as ``fused_moe_triton``, weights in the transformers layout ``w13 [E, 2I, H]``,
``w2 [E, H, I]``):

    order  = the (token, slot) pairs sorted by expert (stable), ``ends`` = each expert's cumulative row end
    xs     = x[order // k]                                     [P, H]   (gathered rows)
    inter  = silu_and_mul(grouped_mm(xs, w13ᵀ, ends))          [P, I]
    rows   = grouped_mm(inter, w2ᵀ, ends)                      [P, H]   (bf16, as the Triton down kernel writes them)
    out    = moe_combine(rows, read through the pairs' positions in ``order``)

Everything stays on the device (no host sync: the sort, the ends by ``searchsorted``, the library's device-side
problem sizes), so it can be captured in the MoE prefill graphs. Pairs whose expert id lies outside
``[0, E)`` (the padding rows of a graph) sort past the last end: the GEMMs leave their rows unwritten and only the
padding tokens' own (unused) outputs read them.
"""

from __future__ import annotations

import torch

from .activation import silu_and_mul
from .moe_combine import moe_combine_torch, moe_combine_triton


def grouped_mm_supported(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor) -> bool:
    """Whether ``torch._grouped_mm`` takes these operands: bf16, and every stride a multiple of 16 bytes (TMA)."""
    if not hasattr(torch, "_grouped_mm") or x.dtype != torch.bfloat16:
        return False
    if w13.dtype != torch.bfloat16 or w2.dtype != torch.bfloat16:
        return False
    return x.shape[1] % 8 == 0 and w2.shape[2] % 8 == 0 and w13.stride(-1) == 1 and w2.stride(-1) == 1


def sort_pairs_by_expert(topk_ids: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``order [P]`` (flat pair index ``t*k + j`` in expert order, stable), ``ends [E]`` int32 (each expert's
    cumulative row end in that order) and ``position [P]`` int32 (where each pair's row lands: ``order``'s
    inverse). Pairs outside ``[0, num_experts)`` sort last, past ``ends[-1]``. No host sync."""
    flat = topk_ids.reshape(-1).to(torch.int64)
    binned = torch.where((flat >= 0) & (flat < num_experts), flat, num_experts)
    order = torch.argsort(binned, stable=True)
    experts = torch.arange(1, num_experts + 1, device=flat.device, dtype=torch.int64)
    ends = torch.searchsorted(binned[order], experts).to(torch.int32)  # rows with an id below e + 1
    position = torch.empty_like(order, dtype=torch.int32)
    position[order] = torch.arange(order.numel(), device=flat.device, dtype=torch.int32)
    return order, ends, position


def fused_moe_grouped_mm(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    shared: torch.Tensor | None = None,
    shared_gate: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Same contract as ``fused_moe.fused_moe_triton`` (bf16 only: ``grouped_mm_supported``). On CUDA the combine
    is the Triton one (it reads each pair's row through ``position``); elsewhere the torch reference, on rows
    put back in pair order."""
    T, H = x.shape
    E, k = w13.shape[0], topk_ids.shape[1]
    if T == 0:
        return torch.zeros_like(x) if out is None else out.zero_()
    order, ends, position = sort_pairs_by_expert(topk_ids, E)
    xs = x.index_select(0, order // k)
    inter = silu_and_mul(torch._grouped_mm(xs, w13.transpose(1, 2), offs=ends))
    rows = torch._grouped_mm(inter, w2.transpose(1, 2), offs=ends)
    if x.is_cuda:
        return moe_combine_triton(
            rows, k, x.dtype, shared, shared_gate, weights=topk_weights, out=out, rows_at=position
        )
    result = moe_combine_torch(rows[position.long()], k, x.dtype, shared, shared_gate, weights=topk_weights)
    return result if out is None else out.copy_(result)
