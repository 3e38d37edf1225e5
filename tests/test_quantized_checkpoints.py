"""Quantized checkpoints end to end on CPU: a tiny Qwen3.5-MoE quantized by our quantizer in ModelOpt format
(``w4a16-nvfp4``; ``mixed-qwen3.6`` = FP8 attention/GDN projections with calibrated input scales + W4A16 NVFP4
experts, shared experts and lm_head) and in compressed-tensors ``nvfp4-pack-quantized`` (reciprocal global scales),
loaded through ``freetoken.LLM`` (the worker's loader), give the logits and greedy tokens of the same checkpoint
dequantized to fp32 and run as a plain one. Also: ``--dummy-weight`` builds the quantized layout at the real size,
and unsupported quantizations stop with one line."""

from __future__ import annotations

import json
import os
import shutil

import hf_reference as R
import pytest
import torch

from freetoken.errors import UnsupportedModel
from freetoken.loading.checkpoint import HFCheckpoint
from freetoken.loading.quantized_checkpoint import dequantized_tensors
from freetoken.quant import nvfp4
from freetoken.quant.config import find_quant_config
from freetoken.quant.quantize_checkpoint import main as quantize_main

pytestmark = pytest.mark.slow
LLM_ARGS = dict(device="cpu", num_tokens=2048, max_seq_len_override=512, load_progress=False, max_prefill_length=64)
PROMPT = R.prompt(23, 4, vocab=1000)


@pytest.fixture(scope="module")
def bf16_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("bf16")
    R.write_released_qwen3_5_moe(str(d), seed=9)
    return str(d)


def _copy_side_files(src: str, dst: str) -> None:
    for name in os.listdir(src):
        skip = name.endswith(".safetensors") or name in ("config.json", "model.safetensors.index.json")
        if not skip and os.path.isfile(os.path.join(src, name)):
            shutil.copy2(os.path.join(src, name), os.path.join(dst, name))


def write_compressed_tensors(src: str, dst: str) -> None:
    """Our compressed-tensors writer for the test: every Linear but routers, GDN a/b, lm_head NVFP4 through
    ``nvfp4.quantize_compressed_tensors`` (fused experts split per expert), their config block."""
    from safetensors.torch import save_file

    from freetoken.quant.quantize_checkpoint import source_tensors

    os.makedirs(dst, exist_ok=True)
    ignore = [
        "lm_head",
        "re:.*mlp\\.gate$",
        "re:.*shared_expert_gate$",
        "re:.*in_proj_[ab]$",
        "re:^mtp.*",
        "re:^visual.*",
    ]
    qcfg_dict = {
        "quant_method": "compressed-tensors",
        "format": "nvfp4-pack-quantized",
        "quantization_status": "compressed",
        "config_groups": {
            "config_group_0": {
                "targets": ["Linear"],
                "weights": {"num_bits": 4, "type": "float", "strategy": "tensor_group", "group_size": 16},
                "input_activations": None,
            }
        },
        "ignore": ignore,
    }
    cfg = HFCheckpoint(src).config
    qcfg = find_quant_config(None, {"quantization_config": qcfg_dict})
    out = {}
    for name, t in source_tensors(src):
        module = name[: -len(".weight")]
        if name.endswith(".weight") and t.dim() == 2 and qcfg.scheme_for(module) and "embed_tokens" not in name:
            packed, scale, gscale = nvfp4.quantize_compressed_tensors(t)
            out.update({f"{module}.weight_packed": packed, f"{module}.weight_scale": scale})
            out[f"{module}.weight_global_scale"] = gscale
        else:
            out[name] = t.contiguous()
    save_file(out, os.path.join(dst, "model.safetensors"))
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump({**cfg, "quantization_config": qcfg_dict}, f)
    _copy_side_files(src, dst)


def write_dequantized(qdir: str, dst: str) -> None:
    """The quantized checkpoint dequantized to fp32, as a plain checkpoint."""
    from safetensors.torch import save_file

    ck = HFCheckpoint(qdir)
    sd = dequantized_tensors(ck.tensors(progress=False), find_quant_config(qdir, ck.config))
    os.makedirs(dst, exist_ok=True)
    save_file({k: v.contiguous() for k, v in sd.items()}, os.path.join(dst, "model.safetensors"))
    cfg = {k: v for k, v in ck.config.items() if k != "quantization_config"}
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump({**cfg, "torch_dtype": "float32"}, f)
    _copy_side_files(qdir, dst)
    if os.path.exists(os.path.join(dst, "hf_quant_config.json")):
        os.remove(os.path.join(dst, "hf_quant_config.json"))


@pytest.fixture(scope="module", params=["w4a16-nvfp4", "mixed-qwen3.6", "compressed-tensors"])
def pair(request, bf16_dir, tmp_path_factory):
    base = tmp_path_factory.mktemp(request.param)
    qdir, ddir = str(base / "quantized"), str(base / "dequantized")
    if request.param == "compressed-tensors":
        write_compressed_tensors(bf16_dir, qdir)
    else:
        args = ["--model-path", bf16_dir, "--out", qdir, "--scheme", request.param, "--calib-tokens", "64"]
        assert quantize_main(args + ["--device", "cpu"]) == 0
    write_dequantized(qdir, ddir)
    return request.param, qdir, ddir


def test_logits_and_greedy_equal_the_dequantized_checkpoint(pair):
    from freetoken import LLM, SamplingParams

    scheme, qdir, ddir = pair
    q, d = LLM(qdir, **LLM_ARGS), LLM(ddir, **LLM_ARGS)
    assert q.worker.loaded.nvfp4_backend == "torch" and d.worker.loaded.nvfp4_backend == "none"
    kinds = {type(m).__name__ for m in q.worker.model.modules()}
    assert "Nvfp4Experts" in kinds and "Nvfp4Linear" in kinds
    assert ("Fp8Linear" in kinds) == (scheme == "mixed-qwen3.6")
    lq, ld = q.logits(PROMPT), d.logits(PROMPT)
    assert float((lq - ld).abs().max()) < 1e-4 * max(1.0, float(ld.abs().max()))
    sp = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    assert q.generate([PROMPT], sp)[0].token_ids == d.generate([PROMPT], sp)[0].token_ids


def test_mixed_scheme_layout_and_scales(pair):
    """The written mixed checkpoint: NVIDIA's recipe, FP8 input scales from calibration, shared gate|up scales."""
    scheme, qdir, _ = pair
    if scheme != "mixed-qwen3.6":
        pytest.skip("mixed only")
    with open(os.path.join(qdir, "hf_quant_config.json")) as f:
        q = json.load(f)["quantization"]
    layers = q["quantized_layers"]
    assert q["quant_algo"] == "MIXED_PRECISION"
    assert layers["model.language_model.layers.0.mlp.experts"]["quant_algo"] == "W4A16_NVFP4"
    assert layers["lm_head"]["quant_algo"] == "W4A16_NVFP4"
    assert layers["model.language_model.layers.0.linear_attn.in_proj_qkv"]["quant_algo"] == "FP8"
    assert layers["model.language_model.layers.1.self_attn.o_proj"]["quant_algo"] == "FP8"
    assert "model.language_model.layers.0.linear_attn.in_proj_a" in q["exclude_modules"]
    t = dict(HFCheckpoint(qdir).tensors(progress=False))
    pre = "model.language_model.layers.0."
    assert t[pre + "linear_attn.in_proj_qkv.weight"].dtype == torch.float8_e4m3fn
    assert float(t[pre + "linear_attn.in_proj_qkv.input_scale"]) > 0
    assert torch.equal(
        t[pre + "mlp.experts.3.gate_proj.weight_scale_2"], t[pre + "mlp.experts.3.up_proj.weight_scale_2"]
    )
    assert pre + "mlp.experts.3.gate_proj.input_scale" not in t  # W4A16: no activation scales


def test_dummy_weights_in_the_quantized_layout(bf16_dir, tmp_path):
    from freetoken import LLM

    d = str(tmp_path / "cfg")
    os.makedirs(d)
    cfg = HFCheckpoint(bf16_dir).config
    cfg["quantization_config"] = {"quant_method": "modelopt", "quant_algo": "W4A16_NVFP4", "ignore": ["lm_head"]}
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump(cfg, f)
    _copy_side_files(bf16_dir, d)
    llm = LLM(d, dummy_weight=True, **LLM_ARGS)
    experts = llm.worker.model.layers[0].mlp.experts
    assert type(experts).__name__ == "Nvfp4Experts" and experts.gate_up_proj.dtype == torch.uint8
    w = experts.gate_up_proj_global[0, 0] * experts.gate_up_proj_scale[0].float().mean()
    assert 0.003 < float(w) < 0.01  # dequantized std about 0.02
    assert torch.isfinite(llm.logits(PROMPT[:5])).all()


def test_real_size_quantized_bytes():
    """Qwen3.6-35B-A3B in the mixed layout, counted on the meta device: the routed experts at their NVFP4 size
    (REFERENCES §1.3: 1,769,472 B of codes and scales per expert, plus the bank's per-row global scales)."""
    from freetoken.loading.model_loader import skip_init
    from freetoken.loading.quantized_model import build_quantized_model
    from freetoken.models.base import ModelConfig
    from freetoken.models.registry import model_class
    from freetoken.quant.quantize_checkpoint import scheme_config

    with open(os.path.join(os.path.dirname(__file__), "..", "configs", "qwen3.6-35b-a3b", "config.json")) as f:
        cfg = ModelConfig.from_dict(json.load(f))
    meta = torch.device("meta")
    with skip_init(torch.bfloat16, meta):
        m = build_quantized_model(model_class(cfg), cfg, scheme_config("mixed-qwen3.6"), torch.bfloat16, meta)
    ex = m.layers[0].mlp.experts
    per_expert = sum(p[0].numel() * p.element_size() for p in ex.parameters())
    assert per_expert == 1_769_472 + 4 * (2 * 512 + 2048)
    assert type(m.layers[3].self_attn.q_proj).__name__ == "Fp8Linear"
    assert type(m.lm_head).__name__ == "Nvfp4Linear" and type(m.layers[0].linear_attn.in_proj_a).__name__ == "Linear"


def test_unsupported_quantization_is_one_line(tmp_path):
    with pytest.raises(UnsupportedModel, match="quant_method 'gptq'"):
        find_quant_config(None, {"quantization_config": {"quant_method": "gptq", "bits": 4}})
    with pytest.raises(UnsupportedModel, match="INT4_AWQ"):
        find_quant_config(None, {"quantization_config": {"quant_method": "modelopt", "quant_algo": "INT4_AWQ"}})
    from freetoken.loading.quantized_model import quantized_experts_factory
    from freetoken.moe.offload import ExpertOffload

    qcfg = find_quant_config(None, {"quantization_config": {"quant_method": "modelopt", "quant_algo": "NVFP4"}})
    off = ExpertOffload(torch.device("cpu"), torch.bfloat16, top_k=2)
    experts = quantized_experts_factory(qcfg, "cpu", offload=off)(0, 8, 32, 16)  # NVFP4 offload is built
    assert type(experts).__name__ == "OffloadedNvfp4Experts" and off.layers == [experts]
