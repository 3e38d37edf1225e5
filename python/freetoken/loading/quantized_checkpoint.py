"""Quantized checkpoint tensors as our quantized holders name them (ModelOpt's names and conventions):

- compressed-tensors: ``weight_packed`` -> ``weight`` (bytes unchanged), ``weight_global_scale`` (the reciprocal of
  ModelOpt's) -> ``weight_scale_2 = 1 / weight_global_scale``, ``input_global_scale`` -> ``input_scale = 1 / it``.
- one-element scales (``[1]`` in older exports and compressed-tensors) become scalars.
- ``input_scale`` of NVFP4 modules is dropped (NVFP4 runs W4A16), as are KV-cache scales (``k_scale``,
  ``v_scale``: the KV cache stays in the model dtype).
"""

from __future__ import annotations

from typing import Iterable, Iterator

import torch

from ..quant.config import FP8_SCHEMES, NVFP4_SCHEMES, QuantConfig

_RENAME = {"weight_packed": "weight", "weight_global_scale": "weight_scale_2", "input_global_scale": "input_scale"}
_RECIPROCAL = ("weight_global_scale", "input_global_scale")
_SCALARS = ("weight_scale_2", "input_scale")
_DROPPED = ("k_scale", "v_scale")


def translate(tensors: Iterable[tuple[str, torch.Tensor]], qcfg: QuantConfig) -> Iterator[tuple[str, torch.Tensor]]:
    for name, t in tensors:
        module, _, leaf = name.rpartition(".")
        if leaf in _DROPPED:
            continue
        if leaf in _RECIPROCAL:
            t = 1.0 / t.float()
        leaf = _RENAME.get(leaf, leaf)
        scheme = qcfg.scheme_for(module)
        if leaf == "input_scale" and (scheme in NVFP4_SCHEMES or scheme is None):
            continue  # NVFP4 runs W4A16; an unquantized module has no use for one either
        if leaf in _SCALARS or (leaf == "weight_scale" and scheme in FP8_SCHEMES):
            if t.numel() == 1:
                t = t.reshape(())
        yield f"{module}.{leaf}", t


def dequantized_tensors(
    tensors: Iterable[tuple[str, torch.Tensor]], qcfg: QuantConfig, dtype: torch.dtype = torch.float32
) -> dict[str, torch.Tensor]:
    """A quantized checkpoint as the plain one it stands for: every quantized module's ``weight`` dequantized to
    ``dtype`` (its scales dropped), other tensors cast to ``dtype`` when floating. For tests and tools (holds the
    whole checkpoint in memory)."""
    from ..quant import fp8, nvfp4

    flat = dict(translate(tensors, qcfg))
    out = {}
    for name, t in flat.items():
        module, _, leaf = name.rpartition(".")
        if f"{module}.weight_scale" not in flat:  # not quantized (the config's default covers Linears only)
            out[name] = t.to(dtype) if t.is_floating_point() else t
        elif leaf == "weight" and t.dtype == torch.float8_e4m3fn:
            out[name] = fp8.dequantize(t, flat[f"{module}.weight_scale"], dtype)
        elif leaf == "weight":
            out[name] = nvfp4.dequantize(t, flat[f"{module}.weight_scale"], flat[f"{module}.weight_scale_2"], dtype)
    return out
