"""Gated full attention of Qwen3-Next and Qwen3.5/3.6 (REFERENCES §1.7).

    qg = x·q_projᵀ viewed [T, nh, 2D]: per head [q | gate]  (not [all q | all gates])
    q, k = (1+w) RMSNorm per head (q_norm, k_norm), BEFORE a partial rotary (first D·partial_rotary_factor dims)
    out = o_proj( attention(q, k, v) · sigmoid(gate) )

Attention runs through the batch's backend over the paged KV pool; ``kv_layer`` counts attention layers only.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from ..kernels.rope import qk_norm_rope
from .fused_linear import FusedLinear, fuse_linears
from .gemm_rows import padded_rows_linear
from .norm import RMSNorm
from .rotary import RotaryEmbedding, rope_config


class GatedAttention(nn.Module):
    def __init__(self, config, layer_id: int, kv_layer: int):
        super().__init__()
        self.layer_id = layer_id
        self.kv_layer = kv_layer
        H = config.hidden_size
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.get("head_dim") or H // self.num_heads
        bias = bool(config.get("attention_bias", False))
        D = self.head_dim
        self.q_proj = nn.Linear(H, 2 * self.num_heads * D, bias=bias)
        self.k_proj = nn.Linear(H, self.num_kv_heads * D, bias=bias)
        self.v_proj = nn.Linear(H, self.num_kv_heads * D, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * D, H, bias=bias)
        eps = config.get("rms_norm_eps", 1e-6)
        self.q_norm = RMSNorm(D, eps=eps, one_plus=True)
        self.k_norm = RMSNorm(D, eps=eps, one_plus=True)
        theta, partial, scaling = rope_config(config, default_partial=0.25)
        self.rotary = RotaryEmbedding(D, int(D * partial), theta, config.get("max_position_embeddings", 32768), scaling)
        self.scale = D**-0.5
        self._qkv: Optional[FusedLinear] = None

    def fuse_projections(self) -> None:
        if self._qkv is None:
            self._qkv = fuse_linears(self.q_proj, self.k_proj, self.v_proj)

    def forward(self, x: torch.Tensor, batch) -> torch.Tensor:
        T, D = x.shape[0], self.head_dim
        if self._qkv is not None:
            qg, k, v = self._qkv.split(self._qkv(x))
        else:
            qg, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        qg = qg.view(T, self.num_heads, 2 * D)
        q, gate = qg[..., :D], qg[..., D:]
        k = k.view(T, self.num_kv_heads, D)
        v = v.view(T, self.num_kv_heads, D)
        # q/k (1+w) norms, then the partial rotary: one kernel on CUDA
        q, k = qk_norm_rope(
            q,
            k,
            batch.positions,
            self.rotary.inv_freq,
            self.rotary.rotary_dim,
            self.q_norm.weight,
            self.k_norm.weight,
            self.q_norm.eps,
            one_plus=True,
        )
        # the output gate goes to the backend: decode applies it in the split merge kernel
        o = batch.attn.forward(q, k, v, self.kv_layer, batch, self.scale, gate=gate)
        return padded_rows_linear(o.reshape(T, self.num_heads * D), self.o_proj)
