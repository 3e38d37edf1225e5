"""Qwen3 dense (``qwen3``, ``Qwen3ForCausalLM``); also the decoder skeleton ``qwen3_moe`` builds on.

    h = embed_tokens[ids]
    for each layer: h = h + Attn(RMSNorm(h));  h = h + MLP(RMSNorm(h))
    logits = lm_head(RMSNorm(h))            (lm_head tied to embed_tokens when tie_word_embeddings)

Attention (HF ``Qwen3Attention``): q/k/v projections (optional bias), **plain-w** RMSNorm per head on q and k
(``Qwen3RMSNorm``: cast to x dtype, then times w) BEFORE a full rotate-half RoPE, GQA, scale D^-0.5, o_proj.
Every norm here is the plain-w kind (Llama-style), not the (1+w) kind of Qwen3.5/Next.
"""

from __future__ import annotations

import re
from typing import Iterable

import torch
from torch import nn

from ..engine.forward_batch import ForwardBatch
from ..layers.moe import GatedMLP
from ..layers.norm import RMSNorm
from ..layers.rotary import RotaryEmbedding, rope_config
from ..loading.copy_weight import copy_weight
from .base import CausalLM, KVLayout, ModelConfig


class Qwen3Attention(nn.Module):
    def __init__(self, config, layer_id: int, kv_layer: int):
        super().__init__()
        self.layer_id = layer_id
        self.kv_layer = kv_layer
        H = config.hidden_size
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.get("num_key_value_heads") or self.num_heads
        self.head_dim = D = config.get("head_dim") or H // self.num_heads
        bias = bool(config.get("attention_bias", False))
        self.q_proj = nn.Linear(H, self.num_heads * D, bias=bias)
        self.k_proj = nn.Linear(H, self.num_kv_heads * D, bias=bias)
        self.v_proj = nn.Linear(H, self.num_kv_heads * D, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * D, H, bias=bias)
        eps = config.get("rms_norm_eps", 1e-6)
        self.q_norm = RMSNorm(D, eps=eps)
        self.k_norm = RMSNorm(D, eps=eps)
        theta, _, scaling = rope_config(config)
        self.rotary = RotaryEmbedding(D, D, theta, config.get("max_position_embeddings", 32768), scaling)
        self.scale = D**-0.5

    def forward(self, x: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        T, D = x.shape[0], self.head_dim
        q = self.q_norm(self.q_proj(x).view(T, self.num_heads, D))
        k = self.k_norm(self.k_proj(x).view(T, self.num_kv_heads, D))
        v = self.v_proj(x).view(T, self.num_kv_heads, D)
        q, k = self.rotary(batch.positions, q, k)
        o = batch.attn.forward(q, k, v, self.kv_layer, batch, self.scale)
        return self.o_proj(o.reshape(T, self.num_heads * D))


class Qwen3DecoderLayer(nn.Module):
    def __init__(self, config, layer_id: int, mlp: nn.Module):
        super().__init__()
        eps = config.get("rms_norm_eps", 1e-6)
        self.input_layernorm = RMSNorm(config.hidden_size, eps=eps)
        self.self_attn = Qwen3Attention(config, layer_id, kv_layer=layer_id)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps=eps)
        self.mlp = mlp

    def forward(self, h: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        h = h + self.self_attn(self.input_layernorm(h), batch)
        return h + self.mlp(self.post_attention_layernorm(h))


class Qwen3Model(nn.Module):
    def __init__(self, config, make_mlp):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            [Qwen3DecoderLayer(config, i, make_mlp(config, i)) for i in range(config.num_hidden_layers)]
        )
        self.norm = RMSNorm(config.hidden_size, eps=config.get("rms_norm_eps", 1e-6))

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        h = self.embed_tokens(batch.input_ids)
        for layer in self.layers:
            h = layer(h, batch)
        return h


class Qwen3ForCausalLM(CausalLM):
    """Dense Qwen3. Subclasses change only ``make_mlp`` (and how the MLP loads)."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.model = Qwen3Model(config, self.make_mlp)
        self.tie_word_embeddings = bool(config.get("tie_word_embeddings", False))
        if self.tie_word_embeddings:
            self.lm_head = None
        else:
            self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    @staticmethod
    def make_mlp(config, layer_id: int) -> nn.Module:
        return GatedMLP(config.hidden_size, config.intermediate_size)

    @property
    def kv_layout(self) -> KVLayout:
        c = self.config
        nh = c.num_attention_heads
        return KVLayout(
            num_layers=c.num_hidden_layers,
            num_kv_heads=c.get("num_key_value_heads") or nh,
            head_dim=c.get("head_dim") or c.hidden_size // nh,
        )

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        h = self.model(batch)
        h = self.model.norm(h[batch.logits_indices])
        w = self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return torch.nn.functional.linear(h, w).float()

    # -- loading ---------------------------------------------------------------------------------------------------

    _SKIP = re.compile(r"(^mtp\.|^model\.visual\.|rotary_emb\.inv_freq$)")
    _MLP = re.compile(r"^model\.layers\.(\d+)\.mlp\.(.+)$")

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for name, tensor in weights:
            if name.startswith("model.language_model."):
                name = "model." + name[len("model.language_model.") :]
            if self._SKIP.search(name):
                continue
            if name == "lm_head.weight" and self.lm_head is None:
                continue  # tied checkpoints sometimes ship a copy
            m = self._MLP.match(name)
            if m and hasattr(self.model.layers[int(m.group(1))].mlp, "load_weights"):
                self.model.layers[int(m.group(1))].mlp.load_weights([(m.group(2), tensor)])
                loaded.add(name)
                continue
            if name not in params:
                raise KeyError(f"unexpected checkpoint tensor {name!r}")
            copy_weight(params[name], tensor, name)
            loaded.add(name)
        missing = []
        for i, layer in enumerate(self.model.layers):
            if hasattr(layer.mlp, "missing_weights"):
                missing += [f"model.layers.{i}.mlp.{n}" for n in layer.mlp.missing_weights()]
        mlp_owned = tuple(
            f"model.layers.{i}.mlp." for i, l in enumerate(self.model.layers) if hasattr(l.mlp, "missing_weights")
        )
        missing += [n for n in params if n not in loaded and not n.startswith(mlp_owned)]
        if missing:
            more = f" (+{len(missing) - 8} more)" if len(missing) > 8 else ""
            raise KeyError(f"checkpoint is missing {len(missing)} tensors: {missing[:8]}{more}")
