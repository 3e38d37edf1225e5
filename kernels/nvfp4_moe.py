"""Grouped MoE over an NVFP4 expert bank (layout: ``layers/nvfp4_experts.py``): the torch reference.

``nvfp4_moe_torch`` dequantizes only the experts the step routes to (to x's dtype, ModelOpt's dequantization) and
runs ``fused_moe_torch`` on them, with the ids remapped into the gathered copy, so its result equals
``fused_moe_torch`` over the whole bank dequantized — the property the Triton kernel will be tested against.
A decode-sized step gathers one copy per (token, expert) pair (fixed shapes, no host sync); larger steps dequantize
each expert hit once.
"""

from __future__ import annotations

import torch

from ..quant import nvfp4
from .fused_moe import _GATHER_PAIRS, _moe_gather_torch, fused_moe_torch


def dequantize_experts(packed, scale, glob, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Experts ``ids`` of one bank part -> ``[len(ids), N, K]`` in ``dtype``."""
    return nvfp4.dequantize(packed[ids], scale[ids], glob[ids], dtype)


def nvfp4_moe_torch(x, w13, w13_scale, w13_global, w2, w2_scale, w2_global, topk_ids, topk_weights):
    """Same contract as ``fused_moe_torch``; ``topk_ids`` index the bank's experts (ids outside it add nothing)."""
    T, k = topk_ids.shape
    E = w13.shape[0]
    ids = topk_ids.reshape(-1).to(torch.int64)
    valid = (ids >= 0) & (ids < E)
    # inside a CUDA-graph capture always gather: the loop's torch.unique would sync the host
    gather = T * k <= _GATHER_PAIRS or (x.is_cuda and torch.cuda.is_current_stream_capturing())
    if gather:
        take = ids.clamp(0, E - 1)  # one copy per pair
        local = torch.where(valid, torch.arange(T * k, device=ids.device), -1).view(T, k)
    else:
        take = torch.unique(ids[valid])  # sorted: the loop visits experts in the order it would over the bank
        remap = torch.full((E,), -1, dtype=torch.int64, device=ids.device)
        remap[take] = torch.arange(take.numel(), device=ids.device)
        local = torch.where(valid, remap[ids.clamp(0, E - 1)], -1).view(T, k)
    g13 = dequantize_experts(w13, w13_scale, w13_global, take, x.dtype)
    g2 = dequantize_experts(w2, w2_scale, w2_global, take, x.dtype)
    if gather:
        return _moe_gather_torch(x, g13, g2, local, topk_weights)
    return fused_moe_torch(x, g13, g2, local, topk_weights)
