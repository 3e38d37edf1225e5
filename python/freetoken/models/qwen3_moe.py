"""Qwen3-MoE (``qwen3_moe``, ``Qwen3MoeForCausalLM``; e.g. Qwen3-30B-A3B, Qwen3-235B-A22B).

Qwen3's decoder (plain-w RMSNorms, q_norm/k_norm before full RoPE, GQA; see ``qwen3.py``) with a sparse MoE MLP in
layer i when ``i not in mlp_only_layers and (i + 1) % decoder_sparse_step == 0`` (HF ``Qwen3MoeDecoderLayer``), a
dense SwiGLU MLP (``intermediate_size``) otherwise. No shared expert. Router: fp32 softmax → top-k → renormalise
iff ``norm_topk_prob`` (HF default False; real checkpoints set True). Checkpoints ship per-expert tensors
``mlp.experts.{e}.{gate,up,down}_proj.weight``; transformers 5.x fused ``experts.gate_up_proj`` is accepted too.
"""

from __future__ import annotations

from typing import Optional

from torch import nn

from ..layers.moe import ExpertsFactory, GatedMLP, SparseMoeBlock
from .base import ModelConfig
from .qwen3 import Qwen3ForCausalLM


def is_moe_layer(config, layer_id: int) -> bool:
    step = int(config.get("decoder_sparse_step", 1) or 1)
    only = config.get("mlp_only_layers") or []
    return config.num_experts > 0 and layer_id not in only and (layer_id + 1) % step == 0


class Qwen3MoeForCausalLM(Qwen3ForCausalLM):
    def __init__(self, config: ModelConfig, experts_factory: Optional[ExpertsFactory] = None):
        if config.get("shared_expert_intermediate_size"):
            raise ValueError("qwen3_moe has no shared expert; shared_expert_intermediate_size must be 0")
        super().__init__(config, experts_factory)

    @staticmethod
    def make_mlp(config, layer_id: int, experts_factory: Optional[ExpertsFactory] = None) -> nn.Module:
        if is_moe_layer(config, layer_id):
            return SparseMoeBlock(config, layer_id, experts_factory=experts_factory)
        return GatedMLP(config.hidden_size, config.intermediate_size)
