"""Which modules of a checkpoint are quantized, and how: one ``QuantConfig`` read from ModelOpt's
``hf_quant_config.json`` or ``config.json["quantization_config"]`` (ModelOpt or compressed-tensors; REFERENCES
§3.2, §3.6).

Schemes (what a module's tensors are): ``nvfp4`` (W4A4 in the file: packed E2M1 + E4M3 block scales + global scale
+ ``input_scale``), ``w4a16_nvfp4`` (the same without activation scales), ``fp8`` (E4M3 per-tensor weight and static
input scales), ``fp8_dynamic`` (E4M3 per-tensor weight, no ``input_scale``: compressed-tensors groups whose
activations are dynamic or not quantized; run W8A8 with a per-tensor scale taken from each input), None
(unquantized). NVFP4 runs as W4A16 here either way (no FP4 tensor cores on Hopper; activations stay
in the model dtype).

Module names are matched after ``normalize``: the checkpoint prefix (``model.language_model.``, ``model.``) is
dropped from both the module and the config's names, so ``layers.3.self_attn.q_proj`` is the same module in every
layout and model class.
"""

from __future__ import annotations

import fnmatch
import json
import os
import re
from dataclasses import dataclass, field
from typing import Optional

from ..errors import UnsupportedModel

NVFP4, W4A16_NVFP4, FP8, FP8_DYNAMIC = "nvfp4", "w4a16_nvfp4", "fp8", "fp8_dynamic"
NVFP4_SCHEMES = (NVFP4, W4A16_NVFP4)
FP8_SCHEMES = (FP8, FP8_DYNAMIC)
_MODELOPT_ALGOS = {"NVFP4": NVFP4, "W4A16_NVFP4": W4A16_NVFP4, "FP8": FP8}
_PREFIXES = ("model.language_model.", "language_model.model.", "language_model.", "model.")


def normalize(name: str) -> str:
    for p in _PREFIXES:
        if name.startswith(p):
            return name[len(p) :]
    return name


def _matches(pattern: str, name: str) -> bool:
    """compressed-tensors ``re:`` regexes, else ModelOpt-style globs; a pattern naming a container (``...mlp.experts``)
    covers what is inside it."""
    if pattern.startswith("re:"):
        return re.match(pattern[3:], name) is not None
    p = normalize(pattern)
    return fnmatch.fnmatchcase(name, p) or name.startswith(p + ".")


@dataclass
class QuantConfig:
    method: str  # "modelopt" | "compressed-tensors"
    algo: str  # ModelOpt quant_algo or compressed-tensors format, for logs
    default: Optional[str]  # scheme of every Linear not excluded (None: only the listed ones)
    layers: dict[str, str] = field(default_factory=dict)  # normalized name or pattern -> scheme (MIXED_PRECISION)
    exclude: list[str] = field(default_factory=list)
    group_size: int = 16

    def scheme_for(self, module: str) -> Optional[str]:
        """The scheme of the Linear named ``module`` (any prefix), or None when it stays unquantized."""
        name = normalize(module)
        if any(_matches(p, name) for p in self.exclude):
            return None
        for pattern, scheme in self.layers.items():
            if _matches(pattern, name):
                return scheme
        return self.default

    @property
    def schemes(self) -> set[str]:
        return {s for s in (self.default, *self.layers.values()) if s}

    def describe(self) -> str:
        return f"{self.method} {self.algo} ({', '.join(sorted(self.schemes))})"


def find_quant_config(path: Optional[str], config: dict) -> Optional[QuantConfig]:
    """The checkpoint's quantization, or None for an unquantized one. ``hf_quant_config.json`` wins over
    ``config.json`` (it is ModelOpt's own file; NVIDIA's config.json copy of a mixed scheme mislabels groups)."""
    if path and os.path.isfile(os.path.join(path, "hf_quant_config.json")):
        with open(os.path.join(path, "hf_quant_config.json")) as f:
            return _modelopt(json.load(f).get("quantization") or {})
    q = config.get("quantization_config") or (config.get("text_config") or {}).get("quantization_config")
    if not q:
        return None
    method = str(q.get("quant_method", "")).lower()
    if method == "modelopt":
        return _modelopt(q)
    if method == "compressed-tensors":
        return _compressed_tensors(q)
    raise UnsupportedModel(
        f"config.json has quantization_config with quant_method {q.get('quant_method')!r}: supported are modelopt "
        "(NVFP4, W4A16_NVFP4, FP8, MIXED_PRECISION) and compressed-tensors nvfp4-pack-quantized"
    )


def _algo_scheme(algo: str, where: str) -> str:
    scheme = _MODELOPT_ALGOS.get(str(algo).upper())
    if scheme is None:
        raise UnsupportedModel(f"{where}: quant_algo {algo!r} is not supported (NVFP4, W4A16_NVFP4, FP8)")
    return scheme


def _modelopt(q: dict) -> QuantConfig:
    algo = str(q.get("quant_algo") or "").upper()
    exclude = list(q.get("exclude_modules") or q.get("ignore") or [])
    group = int(q.get("group_size") or 16)
    if algo == "MIXED_PRECISION":
        layers = q.get("quantized_layers")
        if layers:
            table = {normalize(k): _algo_scheme(v.get("quant_algo"), k) for k, v in layers.items()}
            return QuantConfig("modelopt", algo, None, table, exclude, group)
        return _from_groups("modelopt", algo, q, exclude)
    return QuantConfig("modelopt", algo, _algo_scheme(algo, "modelopt"), {}, exclude, group)


def _group_scheme(group: dict, where: str) -> str:
    w = group.get("weights") or {}
    bits, typ = int(w.get("num_bits", 0)), str(w.get("type", ""))
    if typ == "float" and bits == 4 and int(w.get("group_size") or 16) == 16:
        acts = group.get("input_activations") or {}
        return NVFP4 if acts and int(acts.get("num_bits", 16)) == 4 else W4A16_NVFP4
    if typ == "float" and bits == 8 and str(w.get("strategy", "tensor")) == "tensor":
        acts = group.get("input_activations")
        return FP8_DYNAMIC if not acts or acts.get("dynamic") not in (False, None, "false") else FP8
    raise UnsupportedModel(f"{where}: weights {w} are not supported (NVFP4 group 16, FP8 per-tensor)")


def _from_groups(method: str, algo: str, q: dict, exclude: list[str]) -> QuantConfig:
    """``config_groups``: each group's ``targets`` are module names, ``re:`` regexes or a class (``Linear``: every
    Linear not ignored)."""
    default, layers = None, {}
    for gname, g in (q.get("config_groups") or {}).items():
        scheme = _group_scheme(g, f"config_groups.{gname}")
        for t in g.get("targets") or []:
            if t == "Linear":
                default = scheme
            else:
                layers[t if t.startswith("re:") else normalize(t)] = scheme
    if default is None and not layers:
        raise UnsupportedModel(f"quantization_config ({method}) has no config_groups with targets")
    return QuantConfig(method, algo, default, layers, exclude)


def _compressed_tensors(q: dict) -> QuantConfig:
    fmt = str(q.get("format", ""))
    if fmt not in ("nvfp4-pack-quantized", "float-quantized", "mixed-precision"):
        raise UnsupportedModel(
            f"compressed-tensors format {fmt!r} is not supported (nvfp4-pack-quantized, float-quantized)"
        )
    return _from_groups("compressed-tensors", fmt, q, list(q.get("ignore") or []))
