"""NVFP4 and FP8 bytes: our quantizers (``freetoken.quant``) against hand-derived golden values and, byte for byte,
against the producers themselves installed on CPU: nvidia-modelopt 0.47 (``NVFP4QTensor.quantize`` /
``dequantize``, ``to_quantized_weight`` for FP8, and a whole ``mtq.quantize`` + ``export_hf_checkpoint`` of a tiny
Qwen3.5-MoE vs ``python -m freetoken.quant.quantize_checkpoint``) and compressed-tensors 0.20 (``generate_gparam``,
``calculate_qparams``, ``quantize_and_pack_fp4``, ``unpack_fp4_from_uint8``). Without those packages the
comparisons skip and the golden tests still pin the published formulas (REFERENCES §3.1, §3.6)."""

from __future__ import annotations

import importlib.util
import json
import os
import warnings

import pytest
import torch

from freetoken.quant import fp8, nvfp4

HAS_MODELOPT = importlib.util.find_spec("modelopt") is not None
HAS_CT = importlib.util.find_spec("compressed_tensors") is not None
needs_modelopt = pytest.mark.skipif(
    not HAS_MODELOPT, reason="nvidia-modelopt not installed (pip install nvidia-modelopt)"
)
needs_ct = pytest.mark.skipif(not HAS_CT, reason="compressed-tensors not installed (pip install compressed-tensors)")
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t


def _weights(dtype, seed, shape=(48, 96)):
    """Rows of very different magnitudes (block scales across the E4M3 range), an all-zero block, exact grid ties."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(*shape, generator=g) * torch.logspace(-4, 0, shape[0])[:, None]
    w[0, :16] = 0
    w[1, :16] = torch.tensor(
        [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0, -0.25, -0.75, -1.25, -1.75, -2.5, -3.5, -5, -6]
    )
    return w.to(dtype)


# ------------------------------------------------------------------------------------------------ golden values


def test_e2m1_rounding_is_half_to_even_on_the_code():
    x = torch.tensor([0.0, 0.2, 0.25, 0.26, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 5.1, 6.0, 7.0, 1e9])
    # 0.25 -> 0, 0.75 -> 1.0 (code 2), 1.25 -> 1.0, 1.75 -> 2.0, 2.5 -> 2.0, 3.5 -> 4.0, 5 -> 4.0, > 6 saturates
    assert nvfp4.e2m1_codes(x).tolist() == [0, 0, 0, 1, 2, 2, 4, 4, 6, 6, 7, 7, 7, 7]
    assert nvfp4.e2m1_codes(-x).tolist() == [0, 8, 8, 9, 10, 10, 12, 12, 14, 14, 15, 15, 15, 15]  # -0 keeps its sign
    assert nvfp4.e2m1_values()[nvfp4.e2m1_codes(torch.tensor([-6.0, 3.0])).long()].tolist() == [-6.0, 3.0]


def test_packing_puts_the_even_element_in_the_low_nibble():
    codes = torch.tensor([[1, 2, 15, 8]], dtype=torch.uint8)
    packed = nvfp4.pack_codes(codes)
    assert packed.tolist() == [[0x21, 0x8F]]
    assert torch.equal(nvfp4.unpack_codes(packed), codes)


def test_hand_quantized_block():
    """One 16-element block, amax 12: scale_2 = 12/2688, block scale = 12/(6*scale_2) = 448 exactly, so
    w / (448 * scale_2) = w / 2 lands on the grid."""
    w = torch.tensor([[12.0, -12.0, 1.0, 0.5, 0.0, 3.0, 4.0, 8.0, 6.0, -1.0, 0.49, 2.0, 7.0, 10.0, -5.0, 0.1]])
    q = nvfp4.quantize(w)
    assert float(q.scale_2) == pytest.approx(12 / 2688, rel=1e-7)
    assert float(q.scale.float()) == 448.0
    # w/2 = 6, -6, .5, .25, 0, 1.5, 2, 4, 3, -.5, .245, 1, 3.5, 5, -2.5, .05 -> codes
    want = [7, 15, 1, 0, 0, 3, 4, 6, 5, 9, 0, 2, 6, 6, 12, 0]
    assert nvfp4.unpack_codes(q.packed)[0].tolist() == want
    deq = nvfp4.dequantize(q.packed, q.scale, q.scale_2)
    assert deq[0, :3].tolist() == pytest.approx([12.0, -12.0, 1.0], rel=1e-6)


def test_zero_block_and_compressed_tensors_reciprocal():
    w = torch.zeros(2, 32)
    w[1, 16:] = 1.0
    q = nvfp4.quantize(w)
    assert q.scale[0].float().tolist() == [1.0, 1.0] and q.packed[0].eq(0).all()
    packed, scale, gscale = nvfp4.quantize_compressed_tensors(w)
    assert float(gscale) == pytest.approx(1 / float(q.scale_2), rel=1e-6)  # weight_global_scale = 1/weight_scale_2
    assert torch.equal(packed, q.packed)
    assert torch.equal(
        nvfp4.dequantize(packed, scale, 1 / gscale.reshape(())), nvfp4.dequantize(q.packed, q.scale, q.scale_2)
    )


def test_fp8_golden():
    w = torch.tensor([[448.0, -224.0, 1.0, 0.0]])
    q, s = fp8.quantize(w)
    assert float(s) == 1.0 and q.float().tolist() == [[448.0, -224.0, 1.0, 0.0]]
    q, s = fp8.quantize(w / 1000)
    assert torch.equal(fp8.dequantize(q, s), (q.float() * s))


# ------------------------------------------------------------------------------------------------ nvidia-modelopt


@needs_modelopt
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_nvfp4_bytes_equal_modelopt(dtype, seed):
    from modelopt.torch.quantization.qtensor.nvfp4_tensor import NVFP4QTensor

    w = _weights(dtype, seed)
    qt, scale, scale_2 = NVFP4QTensor.quantize(w.clone(), 16)
    ours = nvfp4.quantize(w)
    assert torch.equal(qt._quantized_data, ours.packed)
    assert torch.equal(_bits(scale), _bits(ours.scale))
    assert torch.equal(scale_2, ours.scale_2)
    # a shared (fused-group) scale_2, as export passes it
    s2 = scale_2 * 1.7
    qt2, scale2, _ = NVFP4QTensor.quantize(w.clone(), 16, weights_scaling_factor_2=s2)
    ours2 = nvfp4.quantize(w, s2)
    assert torch.equal(qt2._quantized_data, ours2.packed) and torch.equal(_bits(scale2), _bits(ours2.scale))
    deq = qt.dequantize(torch.float32, scale=scale, double_scale=scale_2, block_sizes={-1: 16})
    assert torch.equal(deq, nvfp4.dequantize(ours.packed, ours.scale, ours.scale_2))


@needs_modelopt
@pytest.mark.parametrize("dtype", DTYPES)
def test_fp8_bytes_equal_modelopt_export(dtype):
    from modelopt.torch.export.quant_utils import to_quantized_weight

    w = _weights(dtype, 3)
    q, s = fp8.quantize(w)
    theirs = to_quantized_weight(w, w.abs().amax().float() / 448.0, "fp8")
    assert torch.equal(_bits(theirs), _bits(q))


# ------------------------------------------------------------------------------------------------ compressed-tensors


@needs_ct
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_nvfp4_bytes_equal_compressed_tensors(dtype, seed):
    from compressed_tensors.compressors.nvfp4.helpers import quantize_and_pack_fp4, unpack_fp4_from_uint8
    from compressed_tensors.quantization import QuantizationArgs
    from compressed_tensors.quantization.utils.helpers import calculate_qparams, generate_gparam

    args = QuantizationArgs(
        num_bits=4, type="float", strategy="tensor_group", group_size=16, scale_dtype=torch.float8_e4m3fn
    )
    w = _weights(dtype, seed)
    gscale = generate_gparam(*torch.aminmax(w))
    blocks = w.reshape(w.shape[0], -1, 16)
    scale, _ = calculate_qparams(blocks.amin(-1), blocks.amax(-1), args, global_scale=gscale)
    packed = quantize_and_pack_fp4(w, scale, global_scale=gscale, group_size=16)
    ours = nvfp4.quantize_compressed_tensors(w)
    assert torch.equal(gscale, ours[2])
    assert torch.equal(_bits(scale.to(torch.float8_e4m3fn)), _bits(ours[1]))
    assert torch.equal(packed, ours[0])
    vals = nvfp4.e2m1_values()[nvfp4.unpack_codes(ours[0]).long()]
    assert torch.equal(unpack_fp4_from_uint8(packed, *w.shape, torch.float32), vals)
    # with ModelOpt's scales (global = 1/scale_2 a power of two, so both divisions are exact) the bytes agree too
    mo = nvfp4.quantize(w, torch.tensor(2.0**-12))
    ct = quantize_and_pack_fp4(w, mo.scale.float(), global_scale=torch.tensor([2.0**12]), group_size=16)
    assert torch.equal(ct, mo.packed)


# ------------------------------------------------------------------------------------------------ whole checkpoints


def write_bf16_qwen3_5_moe(d: str, seed: int = 3):
    """A tiny Qwen3.5-MoE in BF16, released layout (``model.language_model.*``, fused 3-D experts)."""
    import hf_reference as R
    from safetensors.torch import save_file

    cfg = R.qwen3_5_moe_config(hidden_size=32, moe_intermediate_size=16, shared_expert_intermediate_size=16)
    hf = R.build_hf_model(cfg, seed=seed).to(torch.bfloat16)
    sd = {
        ("model.language_model." + k[len("model.") :] if k.startswith("model.") else k): v.contiguous()
        for k, v in hf.state_dict().items()
    }
    os.makedirs(d, exist_ok=True)
    save_file(sd, os.path.join(d, "model.safetensors"))
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump({**cfg, "torch_dtype": "bfloat16"}, f)
    return hf


def _load_dir(d: str) -> dict:
    from safetensors.torch import load_file

    out = {}
    for f in sorted(os.listdir(d)):
        if f.endswith(".safetensors"):
            out.update(load_file(os.path.join(d, f)))
    return out


@needs_modelopt
@pytest.mark.timeout(600)
def test_quantize_checkpoint_equals_modelopt_export(tmp_path):
    """``--scheme w4a16-nvfp4`` vs ModelOpt's W4A16_NVFP4_CFG quantize + export of the same BF16 weights: the
    same tensor names, dtypes, shapes and bytes (q|k|v, GDN in_proj_qkv|z and gate|up share weight_scale_2)."""
    import modelopt.torch.quantization as mtq
    from modelopt.torch.export import export_hf_checkpoint

    from freetoken.quant.quantize_checkpoint import main

    hf = write_bf16_qwen3_5_moe(str(tmp_path / "bf16"))
    assert (
        main(["--model-path", str(tmp_path / "bf16"), "--out", str(tmp_path / "ours"), "--scheme", "w4a16-nvfp4"]) == 0
    )
    hf.config.architectures = ["Qwen3_5MoeForCausalLM"]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        mtq.quantize(hf, mtq.W4A16_NVFP4_CFG, forward_loop=lambda m: m(input_ids=torch.arange(12)[None]))
        export_hf_checkpoint(hf, export_dir=str(tmp_path / "modelopt"))
    theirs, ours = _load_dir(str(tmp_path / "modelopt")), _load_dir(str(tmp_path / "ours"))
    assert sorted(theirs) == sorted(ours)
    for name, t in theirs.items():
        assert t.dtype == ours[name].dtype and t.shape == ours[name].shape, name
        assert torch.equal(_bits(t), _bits(ours[name])), name
    with open(tmp_path / "modelopt" / "hf_quant_config.json") as f:
        q_theirs = json.load(f)["quantization"]
    with open(tmp_path / "ours" / "hf_quant_config.json") as f:
        q_ours = json.load(f)["quantization"]
    assert q_ours["quant_algo"] == q_theirs["quant_algo"] == "W4A16_NVFP4"
    assert sorted(q_ours["exclude_modules"]) == sorted(q_theirs["exclude_modules"])
