"""What Qwen3-Next and Qwen3.5/3.6 MoE share: a stack of decoder layers, each a token mixer (Gated DeltaNet or
gated full attention, by ``layer_types``) and a sparse MoE block with a shared expert, all with (1+w) RMSNorms
(REFERENCES §1.5). The two models differ only in the GDN input projections (separate vs interleaved), the
checkpoint prefix and config defaults; ``HybridMoeForCausalLM`` takes those as class attributes.
"""

from __future__ import annotations

import re
from typing import Iterable, Optional

import torch
from torch import nn

from ..engine.forward_batch import ForwardBatch
from ..errors import UnsupportedModel
from ..layers.gated_attention import GatedAttention
from ..layers.gated_deltanet import GatedDeltaNet
from ..layers.moe import ExpertsFactory, GatedMLP, SparseMoeBlock, moe_input_rows
from ..layers.norm import RMSNorm, final_norm, pre_norm
from ..loading.copy_weight import copy_weight
from .base import CausalLM, KVLayout, ModelConfig, StateLayout

LINEAR, FULL = "linear_attention", "full_attention"


def hybrid_layer_types(config: ModelConfig) -> list[str]:
    """``layer_types`` from the config, else from ``full_attention_interval`` (default 4): layer i is full
    attention when ``(i + 1) % interval == 0``."""
    n = config.num_hidden_layers
    types = config.get("layer_types")
    if types:
        types = list(types)[:n]
        if len(types) != n:
            raise UnsupportedModel(f"layer_types has {len(types)} entries for {n} layers")
    else:
        interval = int(config.get("full_attention_interval", 4))
        types = [FULL if (i + 1) % interval == 0 else LINEAR for i in range(n)]
    bad = set(types) - {LINEAR, FULL}
    if bad:
        raise UnsupportedModel(f"unsupported layer types {sorted(bad)}")
    return types


def uses_moe(config: ModelConfig, layer_id: int) -> bool:
    """Qwen3-Next: a layer listed in ``mlp_only_layers``, or off the ``decoder_sparse_step`` grid, has a dense MLP
    (none of the released checkpoints has one). Qwen3.5/3.6 configs lack both fields: every layer is MoE."""
    if layer_id in (config.get("mlp_only_layers") or []):
        return False
    step = int(config.get("decoder_sparse_step", 1) or 1)
    return config.get("num_experts", 0) > 0 and (layer_id + 1) % step == 0


class HybridDecoderLayer(nn.Module):
    def __init__(
        self,
        config: ModelConfig,
        layer_id: int,
        layer_type: str,
        mixer_index: int,
        interleaved_gdn: bool,
        experts_factory: Optional[ExpertsFactory] = None,
    ):
        super().__init__()
        self.layer_type = layer_type
        eps = config.get("rms_norm_eps", 1e-6)
        if layer_type == LINEAR:
            self.linear_attn = GatedDeltaNet(config, layer_id, mixer_index, interleaved_proj=interleaved_gdn)
        else:
            self.self_attn = GatedAttention(config, layer_id, mixer_index)
        if uses_moe(config, layer_id):
            self.mlp = SparseMoeBlock(config, layer_id, experts_factory=experts_factory)
        else:
            self.mlp = GatedMLP(config.hidden_size, config.intermediate_size)
        self.input_layernorm = RMSNorm(config.hidden_size, eps=eps, one_plus=True)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps=eps, one_plus=True)

    def forward(self, h: torch.Tensor, residual: Optional[torch.Tensor], batch: ForwardBatch):
        """``h`` is the previous layer's output, ``residual`` the stream before it (None at the first layer):
        returns this layer's output and the stream, so each residual add is fused into the next norm."""
        x, residual = pre_norm(self.input_layernorm, h, residual)
        mixer = self.linear_attn if self.layer_type == LINEAR else self.self_attn
        mixed = mixer(x, batch)
        x, residual = self.post_attention_layernorm.add(mixed, residual, out=moe_input_rows(self.mlp, mixed))
        return self.mlp(x), residual


class HybridMoeForCausalLM(CausalLM):
    """Subclasses set ``interleaved_gdn`` and ``weight_prefixes`` (tried in order; the first that matches a name
    is stripped) and ``skip_prefixes`` (tensors ignored on purpose: MTP, vision)."""

    interleaved_gdn: bool = False
    weight_prefixes: tuple[str, ...] = ("model.",)
    skip_prefixes: tuple[str, ...] = ("mtp.",)

    def __init__(self, config: ModelConfig, experts_factory: Optional[ExpertsFactory] = None):
        super().__init__()
        self.config = config
        self.layer_types = hybrid_layer_types(config)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        layers, n_attn, n_gdn = [], 0, 0
        for i, t in enumerate(self.layer_types):
            if t == LINEAR:
                layers.append(HybridDecoderLayer(config, i, t, n_gdn, self.interleaved_gdn, experts_factory))
                n_gdn += 1
            else:
                layers.append(HybridDecoderLayer(config, i, t, n_attn, self.interleaved_gdn, experts_factory))
                n_attn += 1
        self.layers = nn.ModuleList(layers)
        self.num_attention_layers, self.num_gdn_layers = n_attn, n_gdn
        self.norm = RMSNorm(config.hidden_size, eps=config.get("rms_norm_eps", 1e-6), one_plus=True)
        self.tie_word_embeddings = bool(config.get("tie_word_embeddings", False))
        self.lm_head = (
            None if self.tie_word_embeddings else nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        )

    # --- caches ---------------------------------------------------------------------------------------------
    @property
    def kv_layout(self) -> KVLayout:
        c = self.config
        return KVLayout(
            num_layers=self.num_attention_layers,
            num_kv_heads=c.num_key_value_heads,
            head_dim=c.get("head_dim") or c.hidden_size // c.num_attention_heads,
        )

    @property
    def state_layout(self) -> Optional[StateLayout]:
        from ..cache.state_pool import default_ssm_dtype

        c = self.config
        key_dim = c.linear_num_key_heads * c.linear_key_head_dim
        conv_dim = 2 * key_dim + c.linear_num_value_heads * c.linear_value_head_dim
        return StateLayout(
            num_layers=self.num_gdn_layers,
            conv_shape=(conv_dim, c.linear_conv_kernel_dim - 1),
            ssm_shape=(c.linear_num_value_heads, c.linear_key_head_dim, c.linear_value_head_dim),
            ssm_dtype=default_ssm_dtype(),
        )

    # --- forward --------------------------------------------------------------------------------------------
    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        if batch.state is None and self.num_gdn_layers:
            raise ValueError("hybrid model forward needs batch.state (a RecurrentStatePool)")
        h, residual = self.embed_tokens(batch.input_ids), None
        for layer in self.layers:
            h, residual = layer(h, residual, batch)
        h = final_norm(self.norm, h, residual, batch.logits_indices)
        if self.lm_head is None:
            return torch.nn.functional.linear(h, self.embed_tokens.weight).float()
        return self.lm_head(h).float()  # (a quantized lm_head is a module of its own)

    # --- weights --------------------------------------------------------------------------------------------
    def _local_name(self, name: str) -> Optional[str]:
        """Checkpoint name → parameter name relative to this module; None to skip on purpose."""
        if name.startswith("lm_head."):
            return None if self.lm_head is None else name
        for p in self.skip_prefixes:
            if name.startswith(p):
                return None
        for p in self.weight_prefixes:
            if name.startswith(p):
                return name[len(p) :]
        raise KeyError(f"unexpected tensor {name!r}")

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        moe_layer = re.compile(r"^layers\.(\d+)\.mlp\.(.+)$")
        for name, tensor in weights:
            local = self._local_name(name)
            if local is None:
                continue
            m = moe_layer.match(local)
            if m and isinstance(self.layers[int(m.group(1))].mlp, SparseMoeBlock):
                self.layers[int(m.group(1))].mlp.load_weights([(m.group(2), tensor)])
                continue
            if local not in params:
                raise KeyError(f"unexpected tensor {name!r}")
            copy_weight(params[local], tensor, name)
            loaded.add(local)
        # MoE blocks track their own (fused or per-expert) tensors
        missing = [n for n in params if n not in loaded and not self._is_moe_param(n)]
        for i, layer in enumerate(self.layers):
            if isinstance(layer.mlp, SparseMoeBlock):
                missing += [f"layers.{i}.mlp.{n}" for n in layer.mlp.missing_weights()]
        if missing:
            shown = ", ".join(missing[:8]) + (" ..." if len(missing) > 8 else "")
            raise KeyError(f"{len(missing)} weights missing from the checkpoint: {shown}")

    def _is_moe_param(self, local: str) -> bool:
        m = re.match(r"^layers\.(\d+)\.mlp\.", local)
        return bool(m) and isinstance(self.layers[int(m.group(1))].mlp, SparseMoeBlock)
