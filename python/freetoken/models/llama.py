"""Llama family (Llama 2/3, Mistral without sliding window, SmolLM2, ...), read top to bottom:
embed → N × [RMSNorm → attention (GQA, RoPE, paged KV) → residual → RMSNorm → SiLU MLP → residual]
→ final RMSNorm → lm_head (optionally tied to the embeddings), logits only where the batch samples.

Module and parameter names are HF's, so ``load_weights`` is a lookup and ``state_dict()`` loads into
transformers' ``LlamaForCausalLM`` unchanged (the tests do exactly that).
"""

from __future__ import annotations

from typing import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from ..engine.forward_batch import ForwardBatch
from ..layers.norm import RMSNorm
from ..layers.rotary import RotaryEmbedding, rope_config
from ..loading.copy_weight import copy_weight
from .base import CausalLM, KVLayout, ModelConfig


class LlamaAttention(nn.Module):
    def __init__(self, config: ModelConfig, layer_id: int, rotary: RotaryEmbedding):
        super().__init__()
        hidden = config.hidden_size
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.get("num_key_value_heads") or self.num_heads
        self.head_dim = config.get("head_dim") or hidden // self.num_heads
        self.scale = self.head_dim**-0.5
        self.layer_id = layer_id
        bias = bool(config.get("attention_bias", False))
        self.q_proj = nn.Linear(hidden, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(hidden, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(hidden, self.num_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, hidden, bias=bias)
        self.rotary = [rotary]  # shared by all layers; in a list so it is not registered once per layer

    def forward(self, x: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        t = x.shape[0]
        q = self.q_proj(x).view(t, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(t, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(t, self.num_kv_heads, self.head_dim)
        q, k = self.rotary[0](batch.positions, q, k)
        o = batch.attn.forward(q, k, v, self.layer_id, batch, self.scale)
        return self.o_proj(o.reshape(t, self.num_heads * self.head_dim))


class LlamaMLP(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        if config.get("hidden_act", "silu") != "silu":
            raise ValueError(f"Llama MLP expects silu, got {config.get('hidden_act')}")
        bias = bool(config.get("mlp_bias", False))
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=bias)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=bias)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_id: int, rotary: RotaryEmbedding):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = LlamaAttention(config, layer_id, rotary)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = LlamaMLP(config)

    def forward(self, h: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        h = h + self.self_attn(self.input_layernorm(h), batch)
        return h + self.mlp(self.post_attention_layernorm(h))


class LlamaModel(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        head_dim = config.get("head_dim") or config.hidden_size // config.num_attention_heads
        theta, _, scaling = rope_config(config)
        self.rotary = RotaryEmbedding(head_dim, head_dim, theta, config.max_position_embeddings, scaling)
        factors = config.get("rope_freq_factors")  # GGUF Llama 3.1: llama3 scaling stored as divisors
        if factors is not None:
            self.rotary.inv_freq = self.rotary.inv_freq / torch.tensor(factors, dtype=torch.float32,
                                                                       device=self.rotary.inv_freq.device)
        if scaling and scaling.get("rope_type", scaling.get("type")) not in ("llama3", "default", None):
            raise ValueError(f"rope scaling {scaling} is not supported for Llama")
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            [LlamaDecoderLayer(config, i, self.rotary) for i in range(config.num_hidden_layers)]
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        h = self.embed_tokens(batch.input_ids)
        for layer in self.layers:
            h = layer(h, batch)
        return h


class LlamaForCausalLM(CausalLM):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.model = LlamaModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.tie_word_embeddings = bool(config.get("tie_word_embeddings", False))
        if self.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    @property
    def kv_layout(self) -> KVLayout:
        attn = self.model.layers[0].self_attn
        return KVLayout(len(self.model.layers), attn.num_kv_heads, attn.head_dim)

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        h = self.model(batch)
        # norm and lm_head only at the rows that are sampled (RMSNorm is per row, so this is exact)
        h = self.model.norm(h[batch.logits_indices])
        return self.lm_head(h).float()

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        params = dict(self.named_parameters(remove_duplicate=False))
        loaded: set[str] = set()
        for name, tensor in weights:
            if name.endswith("rotary_emb.inv_freq"):
                continue  # old checkpoints saved the rope table; we compute it
            if name == "lm_head.weight" and self.tie_word_embeddings:
                continue  # some tied checkpoints store a copy anyway; the embedding is the one we keep
            p = params.get(name)
            if p is None:
                continue  # MTP / vision / unknown tensors are skipped on purpose
            copy_weight(p, tensor, name)
            loaded.add(name)
        if self.tie_word_embeddings:
            loaded.add("lm_head.weight")
        missing = sorted(set(params) - loaded)
        if missing:
            raise ValueError(f"checkpoint is missing {len(missing)} tensors, e.g. {missing[:5]}")
