"""SparseMoeBlock vs transformers' MoE blocks (fp32, CPU), weight-name mapping, per-expert merging."""

import pytest
import torch

from freetoken.layers.moe import FusedExperts, SparseMoeBlock, merge_expert_weights
from freetoken.models.base import ModelConfig


def _cfg(**kw):
    d = dict(
        model_type="qwen3_5_moe_text",
        hidden_size=32,
        num_experts=8,
        num_experts_per_tok=3,
        moe_intermediate_size=24,
        shared_expert_intermediate_size=20,
        hidden_act="silu",
        rms_norm_eps=1e-6,
    )
    d.update(kw)
    return d


def _randomise(module, seed=0):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.2)


def _hf_block(kind, d):
    if kind == "qwen3_5_moe":
        from transformers.models.qwen3_5_moe.configuration_qwen3_5_moe import Qwen3_5MoeTextConfig
        from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeSparseMoeBlock

        return Qwen3_5MoeSparseMoeBlock(Qwen3_5MoeTextConfig(**{k: v for k, v in d.items() if k != "model_type"}))
    if kind == "qwen3_next":
        from transformers.models.qwen3_next.configuration_qwen3_next import Qwen3NextConfig
        from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextSparseMoeBlock

        return Qwen3NextSparseMoeBlock(Qwen3NextConfig(**{k: v for k, v in d.items() if k != "model_type"}))
    from transformers.models.qwen3_moe.configuration_qwen3_moe import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    return Qwen3MoeSparseMoeBlock(Qwen3MoeConfig(**{k: v for k, v in d.items() if k != "model_type"}))


@pytest.mark.parametrize(
    "kind,extra",
    [
        ("qwen3_5_moe", {}),
        ("qwen3_next", {"norm_topk_prob": True, "model_type": "qwen3_next"}),
        ("qwen3_next", {"norm_topk_prob": False, "model_type": "qwen3_next"}),
        ("qwen3_moe", {"norm_topk_prob": True, "model_type": "qwen3_moe", "shared_expert_intermediate_size": 0}),
        ("qwen3_moe", {"norm_topk_prob": False, "model_type": "qwen3_moe", "shared_expert_intermediate_size": 0}),
    ],
)
@pytest.mark.parametrize("T", [1, 5, 17])
def test_block_matches_hf(kind, extra, T):
    d = _cfg(**extra)
    hf = _hf_block(kind, d).float()
    _randomise(hf, seed=T)
    ours = SparseMoeBlock(ModelConfig.from_dict(d), layer_id=0)
    sd = hf.state_dict()
    ours.load_weights(sd.items())
    assert ours.missing_weights() == []
    assert set(sd) == {n for n, _ in ours.named_parameters()}
    x = torch.randn(T, d["hidden_size"], generator=torch.Generator().manual_seed(100 + T))
    with torch.no_grad():
        ref = hf(x[None])[0] if kind != "qwen3_moe" else hf(x[None])[0]
        ref = ref[0] if isinstance(ref, tuple) else ref
        out = ours(x)
    torch.testing.assert_close(out, ref.reshape(T, -1), atol=1e-5, rtol=1e-5)


def test_per_expert_checkpoint_names_merge():
    d = _cfg()
    ref = SparseMoeBlock(ModelConfig.from_dict(d))
    _randomise(ref, 3)
    E, I = d["num_experts"], d["moe_intermediate_size"]
    items = []
    for name, p in ref.state_dict().items():
        if name == "experts.gate_up_proj":
            for e in range(E):
                items.append((f"experts.{e}.gate_proj.weight", p[e, :I].clone()))
                items.append((f"experts.{e}.up_proj.weight", p[e, I:].clone()))
        elif name == "experts.down_proj":
            items += [(f"experts.{e}.down_proj.weight", p[e].clone()) for e in range(E)]
        else:
            items.append((name, p.clone()))
    ours = SparseMoeBlock(ModelConfig.from_dict(d))
    ours.load_weights(items[: len(items) - 3])
    assert ours.missing_weights()  # incomplete load is reported
    ours.load_weights(items[len(items) - 3 :])
    assert ours.missing_weights() == []
    x = torch.randn(7, d["hidden_size"])
    with torch.no_grad():
        torch.testing.assert_close(ours(x), ref(x))
    fused = dict(merge_expert_weights(items, E))
    torch.testing.assert_close(fused["experts.gate_up_proj"], ref.experts.gate_up_proj.data)
    torch.testing.assert_close(fused["experts.down_proj"], ref.experts.down_proj.data)


def test_bad_names_and_shapes_raise():
    ours = SparseMoeBlock(ModelConfig.from_dict(_cfg()))
    with pytest.raises(KeyError):
        ours.load_weights([("router.weight", torch.zeros(8, 32))])
    with pytest.raises(ValueError):
        ours.load_weights([("experts.gate_up_proj", torch.zeros(8, 48, 31))])
    with pytest.raises(ValueError):
        ours.load_weights([("experts.9.gate_proj.weight", torch.zeros(24, 32))])


def test_bf16_forward_close_to_fp32():
    d = _cfg()
    blk = SparseMoeBlock(ModelConfig.from_dict(d))
    _randomise(blk, 5)
    # a fixed input: about one random input in ten has a near-tie in the router that bf16 flips (a different
    # expert, an error of ~0.4), which no tolerance on the outputs can allow for
    x = torch.randn(9, d["hidden_size"], generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = blk(x)
        out = blk.to(torch.bfloat16)(x.bfloat16())
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), ref, atol=0.08, rtol=0.05)


def test_fused_experts_impl_pinning():
    from freetoken.layers.moe import resolve_moe_impl

    fe = FusedExperts(4, 16, 8, impl="torch")
    assert resolve_moe_impl(fe.impl, torch.zeros(1)) == "torch"
    fe.impl = "auto"
    assert resolve_moe_impl(fe.impl, torch.zeros(1)) == "torch"  # CPU tensors never pick triton


def test_checkpoint_tensor_of_the_wrong_shape_is_refused():
    from freetoken.loading.copy_weight import copy_weight

    dst = torch.zeros(4, 3)
    with pytest.raises(ValueError, match=r"w: checkpoint shape \(3, 4\) != model shape \(4, 3\)"):
        copy_weight(dst, torch.ones(3, 4), "w")
    copy_weight(dst, torch.ones(4, 3, dtype=torch.float64), "w")
    assert dst.dtype == torch.float32 and bool((dst == 1).all())
