"""configs/*/config.json parse with ModelConfig.from_dict and have the expected parameter counts (formula from the
config, cross-checked against transformers' classes built on the meta device)."""

import json
import os

import pytest
import torch

from freetoken.models.base import ModelConfig
from freetoken.models.registry import model_class

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _load(name):
    with open(os.path.join(ROOT, "configs", name, "config.json")) as f:
        return json.load(f)


def qwen3_5_moe_params(c) -> int:
    """Text model (no MTP, no vision): embeddings + lm_head + 10 gated-attention + 30 GDN layers, MoE every layer."""
    H, V, E, I, Is = (
        c.hidden_size,
        c.vocab_size,
        c.num_experts,
        c.moe_intermediate_size,
        c.shared_expert_intermediate_size,
    )
    nh, nkv, D = c.num_attention_heads, c.num_key_value_heads, c.head_dim
    Hk, Hv, dk, dv, Kc = (
        c.linear_num_key_heads,
        c.linear_num_value_heads,
        c.linear_key_head_dim,
        c.linear_value_head_dim,
        c.linear_conv_kernel_dim,
    )
    moe = E * H + E * 3 * I * H + 3 * Is * H + H
    attn = 2 * nh * D * H + 2 * nkv * D * H + H * nh * D + 2 * D
    conv_dim = 2 * Hk * dk + Hv * dv
    gdn = conv_dim * H + Hv * dv * H + 2 * Hv * H + conv_dim * Kc + 2 * Hv + dv + H * Hv * dv
    total = V * H * (1 if c.tie_word_embeddings else 2) + H
    for t in c.layer_types:
        total += 2 * H + moe + (attn if t == "full_attention" else gdn)
    return total


def qwen3_moe_params(c) -> int:
    H, V, E, I = c.hidden_size, c.vocab_size, c.num_experts, c.moe_intermediate_size
    nh, nkv, D = c.num_attention_heads, c.num_key_value_heads, c.head_dim
    attn = 2 * nh * D * H + 2 * nkv * D * H + 2 * D
    moe = E * H + E * 3 * I * H
    return V * H * (1 if c.tie_word_embeddings else 2) + H + c.num_hidden_layers * (2 * H + attn + moe)


def test_qwen3_6_35b_a3b():
    d = _load("qwen3.6-35b-a3b")
    c = ModelConfig.from_dict(d)
    assert c.outer_model_type == "qwen3_5_moe" and c.model_type == "qwen3_5_moe_text"
    assert c.hidden_size == 2048 and c.num_hidden_layers == 40 and len(c.layer_types) == 40
    assert [i for i, t in enumerate(c.layer_types) if t == "full_attention"] == list(range(3, 40, 4))
    assert (c.num_attention_heads, c.num_key_value_heads, c.head_dim) == (16, 2, 256)
    assert (c.num_experts, c.num_experts_per_tok, c.moe_intermediate_size, c.shared_expert_intermediate_size) == (
        256,
        8,
        512,
        512,
    )
    assert c.rope_parameters["rope_theta"] == 1e7 and c.rope_parameters["partial_rotary_factor"] == 0.25
    assert c.vocab_size == 248320 and c.eos_token_id == 248044 and c.tie_word_embeddings is False
    assert c.mamba_ssm_dtype == "float32" and c.mtp_num_hidden_layers == 1
    n = qwen3_5_moe_params(c)
    assert abs(n / 1e9 - 34.66) < 0.01, n
    # transformers agrees (meta device: no memory)
    from transformers.models.qwen3_5_moe.configuration_qwen3_5_moe import Qwen3_5MoeTextConfig
    from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeForCausalLM

    with torch.device("meta"):
        hf = Qwen3_5MoeForCausalLM(
            Qwen3_5MoeTextConfig(**{k: v for k, v in d["text_config"].items() if k != "model_type"})
        )
    assert sum(p.numel() for p in hf.parameters()) == n


def test_qwen3_30b_a3b():
    d = _load("qwen3-30b-a3b")
    c = ModelConfig.from_dict(d)
    assert c.model_type == "qwen3_moe" and c.num_hidden_layers == 48 and c.norm_topk_prob is True
    n = qwen3_moe_params(c)
    assert abs(n / 1e9 - 30.5) < 0.05, n
    from transformers import Qwen3MoeConfig
    from transformers import Qwen3MoeForCausalLM as HF

    with torch.device("meta"):
        hf = HF(Qwen3MoeConfig(**{k: v for k, v in d.items() if k not in ("model_type", "architectures")}))
        ours = model_class(c)(c)
    assert sum(p.numel() for p in hf.parameters()) == n
    assert sum(p.numel() for p in ours.parameters()) == n
    assert {k for k, _ in ours.named_parameters()} == {k for k, _ in hf.named_parameters()}


@pytest.mark.parametrize("name", ["qwen3.6-35b-a3b", "qwen3-30b-a3b"])
def test_registry_knows_config(name):
    c = ModelConfig.from_dict(_load(name))
    assert model_class(c).__name__ in ("Qwen3_5MoeForCausalLM", "Qwen3MoeForCausalLM")
