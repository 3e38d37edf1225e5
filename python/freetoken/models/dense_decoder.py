"""The decoder Llama, Qwen3 and Qwen3-MoE share, read top to bottom:

    h = embed_tokens[ids]
    for each layer: h = h + Attn(RMSNorm(h));  h = h + MLP(RMSNorm(h))
    logits = lm_head(RMSNorm(h))            (lm_head tied to embed_tokens when tie_word_embeddings)

Attention: q/k/v projections (optional bias), optionally a plain-w RMSNorm per head on q and k (Qwen3's
``q_norm``/``k_norm``, before RoPE), full rotate-half RoPE (Llama-3 frequency scaling, GGUF ``rope_freq_factors``),
GQA, scale D^-0.5, o_proj. Every norm is the plain-w kind (cast to x's dtype, then times w). Subclasses state only
how they differ: ``qk_norm`` and ``make_mlp``.

Module and parameter names are HF's, so ``load_weights`` is a lookup (and ``state_dict()`` loads into transformers'
classes unchanged). One rule for every checkpoint: tensors we skip on purpose are listed (``skip``); any other
unknown tensor and any missing one fails with its name.
"""

from __future__ import annotations

import re
from typing import Iterable, Optional

import torch
from torch import nn

from ..engine.forward_batch import ForwardBatch
from ..kernels.rope import qk_norm_rope
from ..layers.fused_linear import FusedLinear, fuse_linears
from ..layers.gemm_rows import padded_rows_linear
from ..layers.moe import ExpertsFactory, GatedMLP, moe_input_rows
from ..layers.norm import RMSNorm, final_norm, pre_norm
from ..layers.rotary import RotaryEmbedding, rope_config
from ..loading.copy_weight import copy_weight
from .base import CausalLM, KVLayout, ModelConfig


def make_rotary(config: ModelConfig, head_dim: int) -> RotaryEmbedding:
    theta, _, scaling = rope_config(config)
    if scaling and scaling.get("rope_type", scaling.get("type")) not in ("llama3", "default", None):
        raise ValueError(f"rope scaling {scaling} is not supported")
    rotary = RotaryEmbedding(head_dim, head_dim, theta, config.get("max_position_embeddings", 32768), scaling)
    factors = config.get("rope_freq_factors")  # GGUF Llama 3.1: llama3 scaling stored as divisors
    if factors is not None:
        rotary.inv_freq = rotary.inv_freq / torch.tensor(factors, dtype=torch.float32, device=rotary.inv_freq.device)
    return rotary


class DecoderAttention(nn.Module):
    def __init__(self, config: ModelConfig, layer_id: int, rotary: RotaryEmbedding, qk_norm: bool):
        super().__init__()
        H = config.hidden_size
        self.layer_id = layer_id
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.get("num_key_value_heads") or self.num_heads
        self.head_dim = D = config.get("head_dim") or H // self.num_heads
        self.scale = D**-0.5
        bias = bool(config.get("attention_bias", False))
        self.q_proj = nn.Linear(H, self.num_heads * D, bias=bias)
        self.k_proj = nn.Linear(H, self.num_kv_heads * D, bias=bias)
        self.v_proj = nn.Linear(H, self.num_kv_heads * D, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * D, H, bias=bias)
        if qk_norm:
            eps = config.get("rms_norm_eps", 1e-6)
            self.q_norm, self.k_norm = RMSNorm(D, eps=eps), RMSNorm(D, eps=eps)
        else:
            self.q_norm = self.k_norm = None
        self.rotary = [rotary]  # shared by all layers; in a list so it is not registered once per layer
        self._qkv: Optional[FusedLinear] = None

    def fuse_projections(self) -> None:
        if self._qkv is None:
            self._qkv = fuse_linears(self.q_proj, self.k_proj, self.v_proj)

    def forward(self, x: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        T, D = x.shape[0], self.head_dim
        if self._qkv is not None:
            q, k, v = self._qkv.split(self._qkv(x))
        else:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        q, k, v = q.view(T, self.num_heads, D), k.view(T, self.num_kv_heads, D), v.view(T, self.num_kv_heads, D)
        rotary = self.rotary[0]
        norms = (
            (self.q_norm.weight, self.k_norm.weight, self.q_norm.eps) if self.q_norm is not None else (None, None, 1e-6)
        )
        q, k = qk_norm_rope(q, k, batch.positions, rotary.inv_freq, rotary.rotary_dim, *norms, one_plus=False)
        o = batch.attn.forward(q, k, v, self.layer_id, batch, self.scale)
        return padded_rows_linear(o.reshape(T, self.num_heads * D), self.o_proj)


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_id: int, rotary: RotaryEmbedding, qk_norm: bool, mlp: nn.Module):
        super().__init__()
        eps = config.get("rms_norm_eps", 1e-6)
        self.input_layernorm = RMSNorm(config.hidden_size, eps=eps)
        self.self_attn = DecoderAttention(config, layer_id, rotary, qk_norm)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps=eps)
        self.mlp = mlp

    def forward(self, h: torch.Tensor, residual: Optional[torch.Tensor], batch: ForwardBatch):
        """Returns this layer's output and the residual stream before it (the add is fused into the next norm)."""
        x, residual = pre_norm(self.input_layernorm, h, residual)
        attn = self.self_attn(x, batch)
        x, residual = self.post_attention_layernorm.add(attn, residual, out=moe_input_rows(self.mlp, attn))
        return self.mlp(x), residual


class DecoderModel(nn.Module):
    def __init__(self, config: ModelConfig, qk_norm: bool, make_mlp, experts_factory: Optional[ExpertsFactory]):
        super().__init__()
        head_dim = config.get("head_dim") or config.hidden_size // config.num_attention_heads
        self.rotary = make_rotary(config, head_dim)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            [
                DecoderLayer(config, i, self.rotary, qk_norm, make_mlp(config, i, experts_factory))
                for i in range(config.num_hidden_layers)
            ]
        )
        self.norm = RMSNorm(config.hidden_size, eps=config.get("rms_norm_eps", 1e-6))


class DecoderForCausalLM(CausalLM):
    """Llama by default. Subclasses set ``qk_norm`` and may replace ``make_mlp``."""

    qk_norm: bool = False
    # tensors skipped on purpose: MTP heads, vision towers, saved rope tables
    skip = re.compile(r"(^mtp\.|^model\.visual\.|rotary_emb\.inv_freq$)")
    _MLP = re.compile(r"^model\.layers\.(\d+)\.mlp\.(.+)$")

    def __init__(self, config: ModelConfig, experts_factory: Optional[ExpertsFactory] = None):
        super().__init__()
        if config.get("hidden_act", "silu") not in ("silu", "swish"):
            raise ValueError(f"MLP activation {config.get('hidden_act')!r} is not supported (silu only)")
        self.config = config
        self.model = DecoderModel(config, self.qk_norm, self.make_mlp, experts_factory)
        self.tie_word_embeddings = bool(config.get("tie_word_embeddings", False))
        self.lm_head = (
            None if self.tie_word_embeddings else nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        )

    @staticmethod
    def make_mlp(config: ModelConfig, layer_id: int, experts_factory: Optional[ExpertsFactory] = None) -> nn.Module:
        return GatedMLP(config.hidden_size, config.intermediate_size, bias=bool(config.get("mlp_bias", False)))

    @property
    def kv_layout(self) -> KVLayout:
        attn = self.model.layers[0].self_attn
        return KVLayout(len(self.model.layers), attn.num_kv_heads, attn.head_dim)

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        h, residual = self.model.embed_tokens(batch.input_ids), None
        for layer in self.model.layers:
            h, residual = layer(h, residual, batch)
        h = final_norm(self.model.norm, h, residual, batch.logits_indices)  # only the rows that are sampled
        if self.lm_head is None:
            return torch.nn.functional.linear(h, self.model.embed_tokens.weight).float()
        return self.lm_head(h).float()  # (a quantized lm_head is a module of its own)

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for name, tensor in weights:
            if name.startswith("model.language_model."):
                name = "model." + name[len("model.language_model.") :]
            if self.skip.search(name) or (name == "lm_head.weight" and self.lm_head is None):
                continue  # (tied checkpoints sometimes ship a copy of the embedding as lm_head)
            m = self._MLP.match(name)
            mlp = self.model.layers[int(m.group(1))].mlp if m else None
            if mlp is not None and hasattr(mlp, "load_weights"):
                mlp.load_weights([(m.group(2), tensor)])
            elif name in params:
                copy_weight(params[name], tensor, name)
            else:
                raise KeyError(f"unexpected checkpoint tensor {name!r}")
            loaded.add(name)
        missing = []
        owned = []  # MLPs that track their own tensors (fused or per-expert experts)
        for i, layer in enumerate(self.model.layers):
            if hasattr(layer.mlp, "missing_weights"):
                missing += [f"model.layers.{i}.mlp.{n}" for n in layer.mlp.missing_weights()]
                owned.append(f"model.layers.{i}.mlp.")
        missing += [n for n in params if n not in loaded and not n.startswith(tuple(owned))]
        if missing:
            more = f" (+{len(missing) - 8} more)" if len(missing) > 8 else ""
            raise KeyError(f"checkpoint is missing {len(missing)} tensors: {missing[:8]}{more}")
