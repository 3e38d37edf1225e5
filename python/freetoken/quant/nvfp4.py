"""NVFP4: 4-bit E2M1 values in blocks of 16 along K, one FP8 E4M3 scale per block, one fp32 scale per tensor.

Layout of one ``[N, K]`` weight, as ModelOpt writes it (REFERENCES §3.1) and compressed-tensors too (§3.6)::

    packed  uint8          [N, K/2]   element 2j in the low nibble, 2j+1 in the high nibble
    scale   float8_e4m3fn  [N, K/16]  per-16 block scale, row-major, not swizzled
    scale_2 float32        []         per-tensor scale (ModelOpt ``weight_scale_2``; compressed-tensors stores
                                       its reciprocal as ``weight_global_scale``)
    W[n, k] = e2m1(code[n, k]) * float(scale[n, k // 16]) * scale_2

A code is sign (bit 3) + magnitude index (bits 0-2) into ``E2M1_GRID``. Two quantizers are implemented, each the
exact arithmetic of its producer so that our bytes equal theirs:

- ``quantize`` — nvidia-modelopt 0.47 ``NVFP4QTensor.quantize`` (``get_weights_scaling_factor_2``,
  ``get_weights_scaling_factor``, ``_cast_fp4``): ``scale_2 = amax/(6*448)``, ``scale = fp8(clamp(amax_blk/(6*scale_2),
  2^-9, 448))`` (0 -> 1), codes = round-half-even of ``w / (scale * scale_2)`` onto the grid.
- ``quantize_compressed_tensors`` — compressed-tensors 0.20 (``generate_gparam``, ``calculate_qparams``, ``_quantize``,
  ``cast_to_fp4``): ``global = 448*6/amax``, ``scale = fp8(clamp(global * amax_blk/6, ±448))`` (0 -> 0.125), codes
  from ``w / (scale / global)``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

BLOCK = 16
E2M1_MAX = 6.0
E4M3_MAX = 448.0
E4M3_MIN_SUBNORMAL = 2.0**-9
# magnitudes of codes 0..7; code | 8 is the negative
E2M1_GRID = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
# midpoints between grid neighbours; a value equal to one rounds to the neighbour with an even code (0.25 -> 0,
# 0.75 -> 1.0, 1.25 -> 1.0, 1.75 -> 2.0, 2.5 -> 2.0, 3.5 -> 4.0, 5 -> 4.0): round-half-to-even on the code
_MIDPOINTS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)


@dataclass
class Nvfp4Tensor:
    packed: torch.Tensor  # uint8 [..., K/2]
    scale: torch.Tensor  # float8_e4m3fn [..., K/16]
    scale_2: torch.Tensor  # float32 scalar (ModelOpt weight_scale_2)


_VALUES: dict = {}


def e2m1_values(device=None) -> torch.Tensor:
    """The 16 code values, fp32: index = code. Cached per device (no host copy inside a CUDA-graph capture)."""
    key = torch.device(device) if device is not None else torch.device("cpu")
    if key not in _VALUES:
        g = torch.tensor(E2M1_GRID, dtype=torch.float32, device=key)
        _VALUES[key] = torch.cat([g, -g])
    return _VALUES[key]


def e2m1_codes(x: torch.Tensor) -> torch.Tensor:
    """uint8 codes of ``x`` (already divided by its scales) rounded half-to-even onto the grid; |x| > 6 saturates
    to 6. The sign bit is set for x < 0, so a small negative that rounds to zero becomes code 8 (-0), as both
    producers write it."""
    mag = x.abs().float()
    mids = torch.tensor(_MIDPOINTS, dtype=torch.float32, device=x.device)
    idx = torch.bucketize(mag, mids)  # first midpoint >= |x|: a tie lands on the lower neighbour ...
    tie_up = (mag == mids[1]) | (mag == mids[3]) | (mag == mids[5])  # ... which is odd at these three
    code = idx.to(torch.uint8) + tie_up.to(torch.uint8)
    return code | ((x < 0).to(torch.uint8) << 3)


def pack_codes(codes: torch.Tensor) -> torch.Tensor:
    """``[..., K]`` uint8 codes -> ``[..., K/2]`` bytes, element 2j in the low nibble."""
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def unpack_codes(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of ``pack_codes``."""
    out = torch.stack([packed & 0x0F, packed >> 4], dim=-1)
    return out.reshape(*packed.shape[:-1], packed.shape[-1] * 2)


def _blocks(w: torch.Tensor) -> torch.Tensor:
    if w.shape[-1] % BLOCK:
        raise ValueError(f"NVFP4 needs the last dim to be a multiple of {BLOCK}, got {tuple(w.shape)}")
    return w.reshape(*w.shape[:-1], w.shape[-1] // BLOCK, BLOCK)


def global_scale(w: torch.Tensor) -> torch.Tensor:
    """ModelOpt ``weight_scale_2 = amax(|w|) / (6 * 448)``, fp32 scalar."""
    return w.abs().amax().float() / (E2M1_MAX * E4M3_MAX)


def block_scales(w: torch.Tensor, scale_2: torch.Tensor) -> torch.Tensor:
    """ModelOpt per-block scales in E4M3 for a given ``scale_2`` (fused projections share one)."""
    s = _blocks(w).abs().amax(dim=-1).float() / (E2M1_MAX * scale_2)
    s[s == 0] = 1.0  # an all-zero block: any scale reproduces it
    return s.clamp(min=E4M3_MIN_SUBNORMAL, max=E4M3_MAX).to(torch.float8_e4m3fn)


def quantize(w: torch.Tensor, scale_2: torch.Tensor | None = None) -> Nvfp4Tensor:
    """ModelOpt's NVFP4 quantization of ``w [..., K]``; ``scale_2`` defaults to ``global_scale(w)``."""
    scale_2 = global_scale(w) if scale_2 is None else scale_2.float().reshape(())
    scale = block_scales(w, scale_2)
    x = _blocks(w) / (scale.float() * scale_2).unsqueeze(-1)
    codes = e2m1_codes(x.reshape(w.shape))
    return Nvfp4Tensor(pack_codes(codes), scale, scale_2)


def quantize_compressed_tensors(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """compressed-tensors' NVFP4 of ``w [..., K]``: ``(weight_packed, weight_scale, weight_global_scale [1])``.
    Their global and block amaxes are divided in ``w``'s dtype (bf16 weights: bf16 arithmetic), as here."""
    amax = w.abs().amax().clamp(min=torch.finfo(w.dtype).tiny)
    gscale = torch.nan_to_num((E4M3_MAX * E2M1_MAX) / amax, nan=1.0, posinf=1.0, neginf=1.0).float().reshape(1)
    s = gscale * (_blocks(w).abs().amax(dim=-1) / torch.tensor(E2M1_MAX, dtype=w.dtype)).float()
    s = s.clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).float()
    s = torch.where(s == 0, torch.tensor(0.125), s).to(torch.float8_e4m3fn)  # their eps for an all-zero block
    x = _blocks(w) / (s.float() / gscale).unsqueeze(-1)
    codes = e2m1_codes(x.reshape(w.shape).clamp(-E2M1_MAX, E2M1_MAX))
    return pack_codes(codes), s, gscale


def dequantize(
    packed: torch.Tensor, scale: torch.Tensor, scale_2: torch.Tensor, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """``[..., K/2]`` bytes -> ``[..., K]`` in ``dtype``: values times ``float(scale) * scale_2`` in fp32, then cast
    (ModelOpt's ``NVFP4QTensor.dequantize``). ``scale_2``: a scalar, or one per row (``[...]``, expert banks)."""
    vals = e2m1_values(packed.device)[unpack_codes(packed).long()]
    s2 = scale_2.float()
    per_block = scale.float() * (s2 if s2.dim() == 0 else s2.unsqueeze(-1))
    w = _blocks(vals) * per_block.unsqueeze(-1)
    return w.reshape(vals.shape).to(dtype)


def nbytes(n: int, k: int) -> int:
    """Bytes of one ``[n, k]`` NVFP4 weight (packed + block scales), without its scalar."""
    return n * k // 2 + n * k // BLOCK
