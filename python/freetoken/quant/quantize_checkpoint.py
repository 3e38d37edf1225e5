"""Our quantizer: a BF16 Hugging Face checkpoint -> a ModelOpt-format checkpoint (``hf_quant_config.json``,
``quantization_config`` in config.json, ModelOpt tensor names), with ModelOpt's published rounding and scaling
(``quant/nvfp4.py``, ``quant/fp8.py``).

    ft quantize --model-path BF16_DIR --output DIR --scheme SCHEME      (the Rust CLI runs ``main`` below)
    python -m freetoken.quant.quantize_checkpoint --model-path BF16_DIR --out DIR --scheme SCHEME

Schemes:
  w4a16-nvfp4    ModelOpt W4A16_NVFP4: every Linear NVFP4 (weights only) except ModelOpt's default-disabled ones
                 (GDN conv1d / in_proj_a / in_proj_b, routers, shared_expert_gate, lm_head, MTP, vision, embeddings)
  nvfp4          ModelOpt NVFP4 (W4A4): the same weights plus each layer's static ``input_scale`` from calibration
  mixed-qwen3.6  NVIDIA's Qwen3.6-35B-A3B-NVFP4 recipe (REFERENCES §3.3): W4A16_NVFP4 experts, shared experts and
                 lm_head; FP8 per-tensor GDN in_proj_qkv / in_proj_z / out_proj and attention q/k/v/o (input scales
                 from calibration); everything else as it was

As ModelOpt's export does, projections that read the same input (q|k|v, GDN in_proj_qkv|in_proj_z, gate|up) share
one NVFP4 ``weight_scale_2`` (the largest), fused 3-D experts are written per expert, and scales are fp32 scalars.
Calibration (``calibration.py``) runs the BF16 model through our own worker over ``--calib-tokens`` tokens.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import sys
from typing import Iterator, Optional

import torch

from . import fp8, nvfp4
from .config import FP8, NVFP4, NVFP4_SCHEMES, W4A16_NVFP4, QuantConfig, normalize

SCHEMES = ("w4a16-nvfp4", "nvfp4", "mixed-qwen3.6")
# ModelOpt's default-disabled quantizers (modelopt_recipes/configs/ptq/units/default_disabled_quantizers.yaml)
DEFAULT_EXCLUDE = [
    "*linear_attn.conv1d*",
    "*in_proj_a*",
    "*in_proj_b*",
    "*mlp.gate",
    "*shared_expert_gate*",
    "*lm_head*",
    "*router*",
    "mtp*",
    "*visual*",
    "*embed_tokens*",
]
_MIXED_NVFP4 = ("*mlp.experts.*", "*mlp.shared_expert.*", "lm_head")
_MIXED_FP8 = ("*linear_attn.in_proj_qkv", "*linear_attn.in_proj_z", "*linear_attn.out_proj", "*self_attn.*_proj")
# projections that read the same input: ModelOpt unifies their NVFP4 weight_scale_2 on export
_FUSION = [
    (re.compile(r"^(.*\.self_attn)\.[qkv]_proj$"), r"\1.qkv"),
    (re.compile(r"^(.*\.linear_attn)\.in_proj_(qkvz|qkv|z|ba|b|a)$"), r"\1.in_proj"),
    (re.compile(r"^(.*)\.(gate|up)_proj$"), r"\1.gate_up"),
]
_SHARD_BYTES = 4 << 30


def scheme_config(scheme: str) -> QuantConfig:
    """The ``QuantConfig`` a scheme writes; the quantizer asks it which module gets what, as the loader will."""
    if scheme == "w4a16-nvfp4":
        return QuantConfig("modelopt", "W4A16_NVFP4", W4A16_NVFP4, {}, list(DEFAULT_EXCLUDE))
    if scheme == "nvfp4":
        return QuantConfig("modelopt", "NVFP4", NVFP4, {}, list(DEFAULT_EXCLUDE))
    if scheme == "mixed-qwen3.6":
        layers = {p: W4A16_NVFP4 for p in _MIXED_NVFP4} | {p: FP8 for p in _MIXED_FP8}
        exclude = [p for p in DEFAULT_EXCLUDE if p != "*lm_head*"]
        return QuantConfig("modelopt", "MIXED_PRECISION", None, layers, exclude)
    raise ValueError(f"unknown scheme {scheme!r} ({', '.join(SCHEMES)})")


def fusion_key(module: str) -> str:
    for pattern, key in _FUSION:
        if pattern.match(module):
            return pattern.sub(key, module)
    return module


# ---------------------------------------------------------------------------------------------------- source


def source_tensors(path: str) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor of the BF16 checkpoint, fused 3-D experts split into ModelOpt's per-expert Linear names."""
    from ..loading.checkpoint import HFCheckpoint

    for name, t in HFCheckpoint(path).tensors(progress=False):
        if name.endswith("experts.gate_up_proj") or name.endswith("experts.down_proj"):
            base = name[: name.rindex(".") + 1]
            for e in range(t.shape[0]):
                if name.endswith("gate_up_proj"):
                    gate, up = t[e].chunk(2, dim=0)
                    yield f"{base}{e}.gate_proj.weight", gate
                    yield f"{base}{e}.up_proj.weight", up
                else:
                    yield f"{base}{e}.down_proj.weight", t[e]
        else:
            yield name, t


def linear_scheme(qcfg: QuantConfig, name: str, t: torch.Tensor) -> Optional[str]:
    """The scheme of tensor ``name`` when it is a Linear weight the config quantizes, else None."""
    if not name.endswith(".weight") or t.dim() != 2 or not t.is_floating_point():
        return None
    return qcfg.scheme_for(name[: -len(".weight")])


def nvfp4_group_scales(path: str, qcfg: QuantConfig) -> dict[str, torch.Tensor]:
    """First pass: the shared ``weight_scale_2`` of every NVFP4 fusion group (max of its members' own)."""
    scales: dict[str, torch.Tensor] = {}
    for name, t in source_tensors(path):
        if linear_scheme(qcfg, name, t) in NVFP4_SCHEMES:
            key = fusion_key(name[: -len(".weight")])
            s = nvfp4.global_scale(t)
            scales[key] = s if key not in scales else torch.maximum(scales[key], s)
    return scales


# ---------------------------------------------------------------------------------------------------- output


def quantized_tensors(
    path: str, qcfg: QuantConfig, group_scales: dict, input_amax: dict
) -> Iterator[tuple[str, torch.Tensor]]:
    """Second pass: the output tensors in ModelOpt's names. ``input_amax``: calibrated activation amax per module
    (normalized name), for NVFP4 W4A4 and FP8 input scales."""
    for name, t in source_tensors(path):
        scheme = linear_scheme(qcfg, name, t)
        if scheme is None:
            yield name, t.contiguous()
            continue
        module = name[: -len(".weight")]
        if scheme in NVFP4_SCHEMES:
            q = nvfp4.quantize(t, group_scales[fusion_key(module)])
            yield name, q.packed
            yield f"{module}.weight_scale", q.scale
            yield f"{module}.weight_scale_2", q.scale_2.reshape(()).clone()  # (group members share it)
        else:
            w, s = fp8.quantize(t)
            yield name, w
            yield f"{module}.weight_scale", s.reshape(())
        if scheme == NVFP4:
            yield f"{module}.input_scale", _input_scale(input_amax, module) / (nvfp4.E2M1_MAX * nvfp4.E4M3_MAX)
        elif scheme == FP8:
            yield f"{module}.input_scale", fp8.activation_scale(_input_scale(input_amax, module))


def _input_scale(input_amax: dict, module: str) -> torch.Tensor:
    amax = input_amax.get(normalize(module))
    if amax is None:
        raise ValueError(f"no calibrated activation amax for {module} (needed for its input_scale)")
    return amax.float().reshape(())


def write_shards(tensors: Iterator[tuple[str, torch.Tensor]], out: str) -> None:
    """``model-0000i-of-0000n.safetensors`` of at most ~4 GiB each and ``model.safetensors.index.json``."""
    from safetensors.torch import save_file

    shards, current, size = [], {}, 0
    for name, t in tensors:
        if current and size + t.numel() * t.element_size() > _SHARD_BYTES:
            shards.append(_save_tmp(current, out, len(shards), save_file))
            current, size = {}, 0
        current[name] = t
        size += t.numel() * t.element_size()
    shards.append(_save_tmp(current, out, len(shards), save_file))
    weight_map = {}
    for i, (tmp, names) in enumerate(shards):
        final = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        os.replace(tmp, os.path.join(out, final))
        weight_map.update({n: final for n in names})
    with open(os.path.join(out, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f, indent=1)


def _save_tmp(tensors: dict, out: str, i: int, save_file) -> tuple[str, list[str]]:
    tmp = os.path.join(out, f".shard-{i}.tmp")
    save_file(tensors, tmp, metadata={"format": "pt"})
    return tmp, list(tensors)


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("freetoken")
    except PackageNotFoundError:
        return "dev"


def quant_metadata(qcfg: QuantConfig, excluded: list[str], quantized: dict[str, str]) -> tuple[dict, dict]:
    """(``hf_quant_config.json``, config.json's ``quantization_config``) in ModelOpt's form."""
    producer = {"name": "freetoken", "version": _version()}
    quant = {"quant_algo": qcfg.algo, "kv_cache_quant_algo": None, "group_size": 16, "exclude_modules": excluded}
    if qcfg.algo == "MIXED_PRECISION":
        algo_name = {W4A16_NVFP4: "W4A16_NVFP4", NVFP4: "NVFP4", FP8: "FP8"}
        quant["quantized_layers"] = {m: {"quant_algo": algo_name[s], "group_size": 16} for m, s in quantized.items()}
    hf_quant = {"producer": producer, "quantization": quant}
    return hf_quant, {"quant_method": "modelopt", **quant, "ignore": excluded, "producer": producer}


# ---------------------------------------------------------------------------------------------------- driver


def plan(path: str, qcfg: QuantConfig) -> tuple[dict, list[str], dict[str, str]]:
    """First pass: NVFP4 group scales, the modules left unquantized (``exclude_modules``: every weight of 2+ dims
    that is not quantized) and the quantized modules with their schemes (``quantized_layers``; experts listed once
    per layer as their container, as ModelOpt does)."""
    group_scales = nvfp4_group_scales(path, qcfg)
    excluded, quantized = [], {}
    for name, t in source_tensors(path):
        if not name.endswith(".weight") or t.dim() < 2:
            continue
        module = name[: -len(".weight")]
        scheme = linear_scheme(qcfg, name, t)
        if scheme is None:
            excluded.append(module)
        else:
            quantized[re.sub(r"(\.mlp\.experts)\.\d+\..*$", r"\1", module)] = scheme
    return group_scales, sorted(set(excluded)), quantized


def quantize_checkpoint(src: str, out: str, scheme: str, calib_tokens: int = 512, device: str = "auto") -> QuantConfig:
    qcfg = scheme_config(scheme)
    os.makedirs(out, exist_ok=True)
    group_scales, excluded, quantized = plan(src, qcfg)
    input_amax = {}
    if qcfg.schemes & {NVFP4, FP8}:  # static input scales
        from .calibration import calibrate_input_amax, calibration_tokens

        input_amax = calibrate_input_amax(src, calibration_tokens(src, calib_tokens), device)
    write_shards(quantized_tensors(src, qcfg, group_scales, input_amax), out)
    hf_quant, qc = quant_metadata(qcfg, excluded, quantized)
    with open(os.path.join(out, "hf_quant_config.json"), "w") as f:
        json.dump(hf_quant, f, indent=4)
    with open(os.path.join(src, "config.json")) as f:
        config = json.load(f)
    config["quantization_config"] = qc
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    for name in os.listdir(src):  # tokenizer, chat template, generation config, ...
        full = os.path.join(src, name)
        if os.path.isfile(full) and not name.endswith(".safetensors") and name not in _WRITTEN:
            shutil.copy2(full, os.path.join(out, name))
    return qcfg


_WRITTEN = ("config.json", "hf_quant_config.json", "model.safetensors.index.json")


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="ft quantize", description=__doc__.split("\n\n")[0])
    p.add_argument("--model-path", required=True, help="BF16/FP16/FP32 Hugging Face checkpoint directory")
    p.add_argument("--out", required=True, help="output directory (ModelOpt format)")
    p.add_argument("--scheme", required=True, choices=SCHEMES)
    p.add_argument("--calib-tokens", type=int, default=512, help="calibration tokens for static input scales")
    p.add_argument("--device", default="auto", help="where calibration runs (auto | cpu | cuda)")
    a = p.parse_args(argv)
    qcfg = quantize_checkpoint(a.model_path, a.out, a.scheme, a.calib_tokens, a.device)
    print(f"Wrote {a.out}: {qcfg.describe()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
