"""Random NVFP4 weights and banks for the kernel tests (``test_nvfp4_linear.py``, ``test_nvfp4_moe.py``).

Codes are uniform random bytes (every E2M1 code, both nibbles, -0 included); block scales are random E4M3 bytes
over the whole finite range (0x00..0x7E: zero, subnormals, up to 448) unless ``plain_scales``, which keeps them in
[1, 2) like ``--dummy-weight`` (large banks: outputs of a sane size). The global scale is chosen so that outputs stay
O(1). Everything is drawn on the CPU from one seed, so a CUDA case has the same numbers as its CPU twin.
"""

from __future__ import annotations

import torch

from freetoken.quant import nvfp4


def error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """max |out - ref| / (1 + |ref|)."""
    assert out.shape == ref.shape and out.dtype == ref.dtype, (out.shape, ref.shape, out.dtype, ref.dtype)
    return float(((out.float() - ref.float()).abs() / (1 + ref.float().abs())).max()) if ref.numel() else 0.0


def _scales(shape, g: torch.Generator, plain: bool) -> torch.Tensor:
    if plain:
        return (torch.rand(shape, generator=g) + 1.0).to(torch.float8_e4m3fn)
    return torch.randint(0, 0x7F, shape, generator=g, dtype=torch.uint8).view(torch.float8_e4m3fn)


def random_weight(n: int, k: int, seed: int = 0, plain_scales: bool = False, device="cpu"):
    """``(packed uint8 [n, k/2], scale e4m3 [n, k/16], scale_2 fp32 [])``."""
    g = torch.Generator().manual_seed(seed)
    packed = torch.randint(0, 256, (n, k // 2), generator=g, dtype=torch.uint8)
    scale = _scales((n, k // nvfp4.BLOCK), g, plain_scales)
    rms = nvfp4.dequantize(packed[:64], scale[:64], torch.tensor(1.0)).pow(2).mean().sqrt().clamp(min=1e-6)
    scale_2 = (1.0 / (rms * k**0.5)).float().reshape(())
    return packed.to(device), scale.to(device), scale_2.to(device)


def random_bank(S: int, H: int, I: int, seed: int = 0, plain_scales: bool = False, device="cpu"):
    """The six bank tensors (``Nvfp4Experts.bank()`` order) of ``S`` experts, gate and up with different globals per
    expert, as checkpoints have them."""
    g = torch.Generator().manual_seed(seed)
    w13 = torch.randint(0, 256, (S, 2 * I, H // 2), generator=g, dtype=torch.uint8)
    s13 = _scales((S, 2 * I, H // nvfp4.BLOCK), g, plain_scales)
    w2 = torch.randint(0, 256, (S, H, I // 2), generator=g, dtype=torch.uint8)
    s2 = _scales((S, H, I // nvfp4.BLOCK), g, plain_scales)
    one = torch.tensor(1.0)
    r13 = nvfp4.dequantize(w13[0], s13[0], one).pow(2).mean().sqrt().clamp(min=1e-6)
    r2 = nvfp4.dequantize(w2[0], s2[0], one).pow(2).mean().sqrt().clamp(min=1e-6)
    part = torch.rand(S, 2, generator=g) + 0.5  # gate and up of an expert get different global scales
    g13 = (part / (r13 * H**0.5)).repeat_interleave(I, dim=1).float()
    g2 = ((torch.rand(S, 1, generator=g) + 0.5) / (r2 * I**0.5)).expand(S, H).contiguous().float()
    return tuple(t.to(device) for t in (w13, s13, g13, w2, s2, g2))


def dequantized_bank(bank, dtype: torch.dtype):
    """``(w13 [S, 2I, H], w2 [S, H, I])`` in ``dtype``: what the reference runs."""
    w13, s13, g13, w2, s2, g2 = bank
    return nvfp4.dequantize(w13, s13, g13, dtype), nvfp4.dequantize(w2, s2, g2, dtype)
