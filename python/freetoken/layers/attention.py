"""Attention over the paged KV pool, behind one small interface so backends can be swapped.

``TorchAttention`` is the reference every fast backend (the Triton kernels in ``kernels/``) is tested against:
per sequence it gathers the context's K/V through the page table and runs plain softmax attention with the
causal offset of the cached prefix. It works on CPU and CUDA.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Optional

import torch

from ..engine.forward_batch import ForwardBatch
from ..kernels.kv_store import store_kv


class AttentionBackend(ABC):
    name: str = "abstract"

    def store_kv(self, k: torch.Tensor, v: torch.Tensor, kv_layer: int, batch: ForwardBatch) -> None:
        # K and V in one kernel on CUDA (kernels/kv_store.py; its reference is the two index assignments)
        store_kv(batch.kv.k[kv_layer], batch.kv.v[kv_layer], batch.out_cache_loc, k, v)

    @abstractmethod
    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_layer: int,
        batch: ForwardBatch,
        scale: float,
        gate: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        """``q [T, nh, D]``, ``k [T, nkv, D]``, ``v [T, nkv, Dv]`` for this step's new tokens. Stores k and v
        at ``batch.out_cache_loc`` in layer ``kv_layer`` of the pool, then attends every new token causally over
        its sequence's whole context. Returns ``[T, nh, Dv]`` in q's dtype, times ``sigmoid(gate [T, nh, Dv])``
        when a gate is given (gated attention; ``gate_output`` is the reference)."""


def gate_output(out: torch.Tensor, gate: Optional[torch.Tensor]) -> torch.Tensor:
    """Gated attention's output gate, ``out * sigmoid(gate)`` in out's dtype (``out`` itself without a gate)."""
    return out if gate is None else out * torch.sigmoid(gate)


class TorchAttention(AttentionBackend):
    name = "torch"

    def forward(self, q, k, v, kv_layer, batch, scale, gate=None):
        return gate_output(self._attend(q, k, v, kv_layer, batch, scale), gate)

    def _attend(self, q, k, v, kv_layer, batch, scale):
        self.store_kv(k, v, kv_layer, batch)
        kc, vc = batch.kv.k[kv_layer], batch.kv.v[kv_layer]
        if batch.in_graph:
            return decode_attention_padded_torch(
                q, kc, vc, batch.kv.req_to_token, batch.rows, batch.context_lens, scale
            )
        nh, nkv = q.shape[1], kc.shape[1]
        out = torch.empty(q.shape[0], nh, vc.shape[2], dtype=q.dtype, device=q.device)
        rows = batch.rows.tolist()
        start = 0
        for b, (n, ctx) in enumerate(zip(batch.extend_lens_cpu, batch.context_lens_cpu)):
            slots = batch.kv.req_to_token[rows[b], :ctx].to(torch.int64)
            keys = kc[slots].float().repeat_interleave(nh // nkv, dim=1)  # [ctx, nh, D]
            vals = vc[slots].float().repeat_interleave(nh // nkv, dim=1)
            qs = q[start : start + n].float()  # [n, nh, D]
            scores = torch.einsum("qhd,khd->hqk", qs, keys) * scale
            # new token i sits at position ctx - n + i and sees keys 0..ctx - n + i
            qpos = torch.arange(ctx - n, ctx, device=q.device)[:, None]
            kpos = torch.arange(ctx, device=q.device)[None, :]
            scores = scores.masked_fill(kpos > qpos, float("-inf"))
            probs = torch.softmax(scores, dim=-1)
            out[start : start + n] = torch.einsum("hqk,khd->qhd", probs, vals).to(q.dtype)
            start += n
        return out


def decode_attention_padded_torch(q, k_cache, v_cache, req_to_token, rows, context_lens, scale) -> torch.Tensor:
    """Decode attention with fixed shapes (no host reads): every sequence gathers the page table's whole row and
    masks the positions past its context. ``q [B, nh, D]``, one new token per sequence, already stored. Costs
    ``B × max_context`` gathers, so it serves CPU CUDA-graph emulation and tests, not production decode."""
    nh, nkv = q.shape[1], k_cache.shape[1]
    slots = req_to_token[rows].to(torch.int64)  # [B, max_ctx]
    keys = k_cache[slots].float().repeat_interleave(nh // nkv, dim=2)  # [B, max_ctx, nh, D]
    vals = v_cache[slots].float().repeat_interleave(nh // nkv, dim=2)
    scores = torch.einsum("bhd,bkhd->bhk", q.float(), keys) * scale
    kpos = torch.arange(slots.shape[1], device=q.device)[None, None, :]
    scores = scores.masked_fill(kpos >= context_lens.to(torch.int64)[:, None, None], float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    return torch.einsum("bhk,bkhd->bhd", probs, vals).to(q.dtype)


_BACKENDS: dict[str, type[AttentionBackend]] = {"torch": TorchAttention}


def register_attention_backend(name: str, cls: type[AttentionBackend]) -> None:
    _BACKENDS[name] = cls


def make_attention_backend(name: str, device: torch.device) -> AttentionBackend:
    """``auto`` picks the Triton kernels on CUDA and the torch reference elsewhere."""
    if "triton" not in _BACKENDS and (name == "triton" or (name == "auto" and device.type == "cuda")):
        try:  # the Triton backend registers itself on import (kernels/attention.py)
            import freetoken.kernels.attention  # noqa: F401
        except ImportError:
            pass
    if name == "auto":
        name = "triton" if device.type == "cuda" and "triton" in _BACKENDS else "torch"
    if name in ("fi", "fa", "trtllm"):
        raise ValueError(f"--attention-backend {name} needs FlashInfer/FlashAttention, which this build does not ship")
    if name not in _BACKENDS:
        raise ValueError(f"unknown or unavailable attention backend {name!r} (have: {sorted(_BACKENDS)})")
    if name == "triton" and device.type != "cuda":
        raise ValueError("--attention-backend triton needs a CUDA device")
    return _BACKENDS[name]()
