"""``--dummy-weight``: a model with the checkpoint's shapes (from config.json alone) and random weights, for
memory planning, benchmarks and tests without downloading weights. A config with a quantization block gets its
quantized layers at the real size: random E2M1 codes / E4M3 values with scales that give the usual spread
(``fill_dummy`` of ``layers/quantized_linear.py`` and ``layers/nvfp4_experts.py``).

Filling is in place on the device (the model is built with ``torch.empty``-style storage, see
``model_loader.skip_init``), so it costs one pass of a random-number kernel, not a host round trip.
"""

from __future__ import annotations

import torch
from torch import nn

from ..layers.norm import RMSNorm

# Host tensors above this many elements (offloaded expert banks: 64 GB for Qwen3.6-35B-A3B) are filled by tiling one
# random block at shifting offsets: the CPU generator would take minutes, and dummy values need not be independent.
_TILE = 1 << 24


def _fill_tiled(p: torch.Tensor, std: float, gen: torch.Generator) -> None:
    block = torch.empty(2 * _TILE, dtype=p.dtype)
    block.normal_(0.0, std, generator=gen)
    flat = p.view(-1)
    for n, start in enumerate(range(0, flat.numel(), _TILE)):
        piece = flat[start : start + _TILE]
        shift = (n * 7919) % _TILE
        piece.copy_(block[shift : shift + piece.numel()])


@torch.no_grad()
def fill_dummy_weights(model: nn.Module, std: float = 0.02, seed: int = 0) -> None:
    """Small normal values everywhere except where a value has a meaning: RMSNorm weights are ones (plain
    ``x·w`` norms) or zeros (``x·(1+w)`` norms), biases are zeros. Integer tensors are left alone."""
    gen_cpu = torch.Generator().manual_seed(seed)
    special: set[int] = set()
    for module in model.modules():
        if hasattr(module, "fill_dummy"):  # quantized layers and NVFP4 expert banks: random codes and scales
            dev = next(module.parameters()).device
            gen = gen_cpu if dev.type == "cpu" else torch.Generator(device=dev).manual_seed(seed + len(special))
            module.fill_dummy(std, gen)
            special.update(id(p) for name, p in module.named_parameters() if not name.endswith("bias"))
    for module in model.modules():
        if isinstance(module, RMSNorm) or type(module).__name__.endswith("RMSNorm"):
            w = getattr(module, "weight", None)
            if isinstance(w, torch.Tensor):
                (w.zero_() if getattr(module, "one_plus", False) else w.fill_(1.0))
                special.add(id(w))
    for name, p in model.named_parameters():
        if id(p) in special or not p.is_floating_point():
            continue
        if name.endswith("bias"):
            p.zero_()
        elif p.device.type == "cpu" and p.numel() > _TILE:
            _fill_tiled(p, std, gen_cpu)
        elif p.device.type == "cpu":
            p.normal_(0.0, std, generator=gen_cpu)
        else:
            gen = torch.Generator(device=p.device).manual_seed(seed)
            p.normal_(0.0, std, generator=gen)
            seed += 1
