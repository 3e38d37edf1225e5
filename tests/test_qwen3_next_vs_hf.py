"""Qwen3-Next (``Qwen3NextForCausalLM``) vs transformers, fp32 on CPU, tiny random configs: interleaved
``in_proj_qkvz`` / ``in_proj_ba``, per-expert checkpoint tensors, norm_topk_prob, dense ``mlp_only_layers``;
one-shot and chunked prefill, a batch of different lengths, 64-step greedy agreement across a chunk-split prefix
and mixed decode/prefill steps. Tie handling as in test_qwen3_5_moe_vs_hf.py."""

from __future__ import annotations

import hf_reference as R
import pytest
import torch

from freetoken.models.base import ModelConfig
from freetoken.models.qwen3_next import Qwen3NextForCausalLM
from freetoken.models.registry import model_class

torch.set_num_threads(1)

CONFIGS = {
    "gva_r2": dict(),
    # r=3 (value heads 6 over 2 key heads), dk != dv, a dense MLP layer, no top-k renormalisation
    "r3_dense_layer": dict(
        linear_num_key_heads=2,
        linear_num_value_heads=6,
        linear_key_head_dim=8,
        linear_value_head_dim=12,
        mlp_only_layers=[2],
        norm_topk_prob=False,
    ),
    "r1_interval4": dict(
        linear_num_key_heads=2,
        linear_num_value_heads=2,
        linear_key_head_dim=16,
        linear_value_head_dim=16,
        full_attention_interval=4,
        num_hidden_layers=5,
    ),
}

_cache: dict = {}


def models(name):
    if name not in _cache:
        over = dict(CONFIGS[name])
        ntp = over.pop("norm_topk_prob", True)
        cfg = R.qwen3_next_config(**over)
        cfg["norm_topk_prob"] = ntp
        hf = R.build_hf_model(cfg, seed=21)
        sd = R.split_experts(hf.state_dict())  # Qwen3-Next ships experts one by one
        sd["mtp.fc.weight"] = torch.zeros(2, 2)
        _cache[name] = (hf, R.build_ours(cfg, hf, sd))
    return _cache[name]


@pytest.mark.parametrize("name", list(CONFIGS))
def test_one_shot_prefill(name):
    hf, ours = models(name)
    R.check_chunked_prefill(hf, ours, {0: [37]}, seed=1)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_chunked_prefill_across_gdn_chunks(name):
    hf, ours = models(name)
    R.check_chunked_prefill(hf, ours, {0: [1, 70, 63, 17], 2: [5, 2, 90]}, seed=2)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_batch_of_different_lengths(name):
    hf, ours = models(name)
    R.check_chunked_prefill(hf, ours, {0: [13], 1: [1], 2: [66], 3: [29]}, seed=3)


@pytest.mark.parametrize("name", ["gva_r2", "r3_dense_layer"])
def test_greedy_64_mixed_steps(name):
    hf, ours = models(name)
    err, ties, margin = R.check_greedy(hf, ours, {0: (0, [45, 56]), 1: (4, [30, 1, 10]), 2: (9, [1])}, steps=64)
    assert ties == 0, (ties, margin)


def test_layout_and_registry():
    cfg = R.qwen3_next_config()
    assert model_class(ModelConfig.from_dict(cfg)) is Qwen3NextForCausalLM
    hf, ours = models("gva_r2")
    assert ours.layer_types == hf.config.layer_types
    assert ours.kv_layout.num_layers == 2 and ours.state_layout.num_layers == 2
    assert isinstance(ours.layers[2].mlp, torch.nn.Module)
    hf5, ours5 = models("r1_interval4")
    assert ours5.layer_types == ["linear_attention"] * 3 + ["full_attention", "linear_attention"]
    # fused experts (transformers 5.x save) load too and give the same model
    ours_fused = R.build_ours(R.qwen3_next_config(), hf)
    ids = R.prompt(20, 5)
    assert torch.equal(
        R.TinyEngine(ours).step([(0, ids)], all_logits=True)[0],
        R.TinyEngine(ours_fused).step([(0, ids)], all_logits=True)[0],
    )
