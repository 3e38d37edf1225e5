"""Building a model whose Linears and experts are quantized as the checkpoint's ``QuantConfig`` says.

Every ``nn.Linear`` is first built on the meta device (no memory), then each one is either replaced by its
quantized holder (``Nvfp4Linear`` / ``Fp8Linear``, allocated in the quantized layout on the real device) or
materialized as it is. Routed experts are built by the ``experts_factory`` the model's constructor already takes:
NVFP4 experts as an ``Nvfp4Experts`` bank, so a 35B model never allocates its BF16 experts.
"""

from __future__ import annotations

import contextlib
from typing import Optional

import torch
from torch import nn

from ..errors import UnsupportedModel
from ..layers.nvfp4_experts import Nvfp4Experts
from ..layers.quantized_linear import QuantizedLinear, make_quantized_linear
from ..quant.config import FP8_SCHEMES, NVFP4_SCHEMES, QuantConfig


@contextlib.contextmanager
def linears_on_meta():
    """``nn.Linear`` built inside allocates its weight on the meta device unless given a device."""
    init = nn.Linear.__init__

    def meta_init(self, *args, **kwargs):
        kwargs.setdefault("device", "meta")
        init(self, *args, **kwargs)

    nn.Linear.__init__ = meta_init
    try:
        yield
    finally:
        nn.Linear.__init__ = init


def experts_scheme(qcfg: QuantConfig, layer_id: int) -> Optional[str]:
    """The scheme of layer ``layer_id``'s routed experts (all three projections must agree)."""
    names = [f"layers.{layer_id}.mlp.experts.0.{p}" for p in ("gate_proj", "up_proj", "down_proj")]
    schemes = {qcfg.scheme_for(n) for n in names}
    if len(schemes) != 1:
        raise UnsupportedModel(f"layer {layer_id}: experts quantized unevenly ({sorted(map(str, schemes))})")
    return schemes.pop()


def quantized_experts_factory(qcfg: QuantConfig, device, fallback=None, offload=None):
    """An ``experts_factory``: NVFP4 banks where the config quantizes experts (in host memory, in NVFP4 bytes, with
    ``offload``: an ``ExpertOffload``), else ``fallback`` (the offload's factory, or the model's default
    ``FusedExperts``)."""
    from ..layers.moe import FusedExperts

    def make(layer_id: int, num_experts: int, hidden: int, inter: int):
        scheme = experts_scheme(qcfg, layer_id)
        if scheme in NVFP4_SCHEMES and offload is not None:
            return offload.make_nvfp4_experts(layer_id, num_experts, hidden, inter)
        if scheme in NVFP4_SCHEMES:
            return Nvfp4Experts(num_experts, hidden, inter, device=device)
        if scheme in FP8_SCHEMES:
            raise UnsupportedModel("FP8 routed experts are not supported yet (NVFP4 experts and FP8 Linears are)")
        if fallback is not None:
            return fallback(layer_id, num_experts, hidden, inter)
        return FusedExperts(num_experts, hidden, inter)

    return make


def quantize_linears(model: nn.Module, qcfg: QuantConfig, dtype: torch.dtype, device) -> int:
    """Replace or materialize every meta ``nn.Linear`` of ``model``. Returns how many were quantized."""
    n = 0
    for name, mod in list(model.named_modules()):
        if not isinstance(mod, nn.Linear) or not mod.weight.is_meta:
            continue
        scheme = qcfg.scheme_for(name)
        if scheme is None:
            mod.to_empty(device=device)
            continue
        q = make_quantized_linear(scheme, mod.in_features, mod.out_features, mod.bias is not None, dtype, device)
        parent, _, attr = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, attr, q)
        n += 1
    return n


def build_quantized_model(
    cls, config, qcfg: QuantConfig, dtype: torch.dtype, device, experts_factory=None, offload=None
):
    """``cls(config)`` on ``device`` with the quantized layout of ``qcfg`` (call inside ``skip_init``); ``offload``:
    the ``ExpertOffload`` whose host banks take the routed experts."""
    with linears_on_meta():
        model = cls(config, experts_factory=quantized_experts_factory(qcfg, device, experts_factory, offload))
    quantize_linears(model, qcfg, dtype, device)
    return model.eval()


def quantized_model_bytes(cls, config, qcfg: QuantConfig, dtype: torch.dtype) -> int:
    """Parameter bytes of the quantized model, counted on the meta device (``--moe-backend auto``)."""
    from .model_loader import skip_init

    with skip_init(dtype, torch.device("meta")):
        probe = build_quantized_model(cls, config, qcfg, dtype, torch.device("meta"))
    return sum(p.numel() * p.element_size() for p in probe.parameters())


def quantized_modules(model: nn.Module) -> list[nn.Module]:
    return [m for m in model.modules() if isinstance(m, (QuantizedLinear, Nvfp4Experts))]
