"""Projections that read the same input, run as one GEMM (q|k|v, gate|up, the GDN input projections, router|shared
expert): one launch and one pass over the activations instead of several, which matters most in decode, where
each projection is a small GEMV.

``fuse_linears`` is applied after the weights are loaded: the parts' weights are concatenated along the output
dimension into one tensor, and each part's ``weight`` (and ``bias``) becomes a view into it, so parameter names,
``state_dict()`` and the bytes counted stay exactly as loaded. The layer then calls the ``FusedLinear`` and splits
the output. Quantized parts keep their own scales and run part by part (``PartwiseLinear``), except in decode-sized
steps on CUDA (up to 32 rows of x), where the parts of each format are one block of rows of a single mixed
BF16/FP8/NVFP4 launch (``layers/mixed_projection.py``: a GEMV, or from 3-5 rows on tensor cores); FP8 parts
(``Fp8PartwiseLinear``) quantize the shared input once per distinct input scale and run one tensor-wise
``_scaled_mm`` per part, on the current stream: a single GEMM over the concatenated weight would need a row-wise
scale vector, and row-wise ``_scaled_mm`` ignores the stream on sm_89 with torch < 2.12 (REFERENCES §3.5).
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from ..kernels.fp8_linear import fp8_quantize, fp8_scaled_mm, scaled_mm_supported
from ..kernels.mixed_dot import mixed_kernel
from ..kernels.mixed_gemv import MixedRows
from .gemm_rows import padded_rows_linear
from .mixed_projection import mixed_rows
from .quantized_linear import Fp8Linear

# The fused weight's rows are padded with zeros to a multiple of this: an output row of an odd width (the MoE
# router | shared gate | shared gate_up of Qwen3.5/3.6 is 256 + 1 + 1024 = 1281 wide) is not 16-byte aligned, and
# cuBLAS then falls back to an sm_75 kernel that ran the router GEMM of an 8,192-token prefill at ~18 TFLOP/s on an
# H200 (19 ms of a 320 ms chunk). The padding costs a few zero rows; the output is narrowed back to the parts.
_ROW_ALIGN = 8


class FusedLinear(nn.Module):
    """One weight ``[sum(sizes) + padding, in]`` whose row blocks are the parts' weights. The parts own the
    parameters; the fused tensors are non-persistent buffers (out of ``state_dict()`` and the parameter count,
    moved by ``.to()``; after a move the two are separate copies of the same values)."""

    def __init__(self, weight: torch.Tensor, bias: Optional[torch.Tensor], sizes: list[int]):
        super().__init__()
        self.register_buffer("weight", weight, persistent=False)  # rows past sum(sizes): zero padding
        self.register_buffer("bias", bias, persistent=False)
        self.sizes = sizes
        self.out_features = sum(sizes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = padded_rows_linear(x, self._linear)
        return y if y.shape[-1] == self.out_features else y[..., : self.out_features]

    def _linear(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)

    def split(self, y: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return torch.split(y, self.sizes, dim=-1)


class PartwiseLinear(nn.Module):
    """The fused projection of parts that cannot share one weight tensor (quantized parts keep their own scales):
    each part runs on its own and the outputs are concatenated; ``split`` is ``FusedLinear``'s. The parts stay owned
    by their modules (held in a list, so they are not registered twice). Decode-sized inputs run the mixed GEMV
    over all parts at once where it applies (``mixed``; ``mixed_mode`` auto | on | off, tests pin it)."""

    def __init__(self, parts: list[nn.Module]):
        super().__init__()
        self.parts = list(parts)
        self.sizes = [p.out_features for p in parts]
        self.mixed_mode = "auto"
        self._mixed = mixed_rows(self.parts)
        if self._mixed is not None:  # its tensors as buffers: ``.to()`` moves them with the module
            for name, t in self._mixed.tensors().items():
                self.register_buffer("mixed_" + name, t, persistent=False)

    @property
    def mixed(self) -> Optional[MixedRows]:
        """The parts as the mixed GEMV's row blocks (``None``: the kernel does not apply to them)."""
        if self._mixed is None:
            return None
        return dataclasses.replace(self._mixed, **{n: getattr(self, "mixed_" + n) for n in self._mixed.tensors()})

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if all(p.impl == "auto" for p in self._quantized()):
            kernel = mixed_kernel(x, self._mixed, self.mixed_mode)
            if kernel is not None:
                return kernel(x, self.mixed)
        return self.forward_parts(x)

    def _quantized(self) -> list[nn.Module]:
        return [p for p in self.parts if hasattr(p, "impl")]

    def forward_parts(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([p(x) for p in self.parts], dim=-1)

    def split(self, y: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return torch.split(y, self.sizes, dim=-1)


class Fp8PartwiseLinear(PartwiseLinear):
    """FP8 parts of one fused projection (q|k|v, GDN in_proj_qkv|z): the input quantized once per group of parts
    with equal input scales (all dynamic parts form one group: the same x gives the same amax), then one
    tensor-wise ``_scaled_mm`` per part. Where ``_scaled_mm`` cannot run (CPU, sm_80, a shape off the 16 grid) or a
    part is pinned to another implementation, each part runs its own ``forward``."""

    def __init__(self, parts: list[Fp8Linear]):
        super().__init__(parts)
        self.groups = _input_scale_groups(parts)

    def forward_parts(self, x: torch.Tensor) -> torch.Tensor:
        parts = self.parts
        if any(p.impl != "auto" for p in parts) or not all(scaled_mm_supported(x, p.weight) for p in parts):
            return super().forward_parts(x)
        x2 = x.reshape(-1, x.shape[-1])
        if x2.shape[0] == 0:
            return super().forward_parts(x)
        x2 = x2 if x2.is_contiguous() else x2.contiguous()
        quantized: dict = {}
        outs = []
        for p, g in zip(parts, self.groups):
            if g not in quantized:
                quantized[g] = fp8_quantize(x2, parts[g].input_scale)
            xq, s = quantized[g]
            outs.append(fp8_scaled_mm(xq, s, p.weight, p.weight_scale, p.bias, x.dtype))
        return torch.cat(outs, dim=-1).view(*x.shape[:-1], sum(self.sizes))


def _input_scale_groups(parts: list[Fp8Linear]) -> list[int]:
    """For each part, the index of the first part whose input quantization is the same (equal static scale, or
    both dynamic). Reads the scales on the host: call at load time, never under a CUDA-graph capture."""
    groups: list[int] = []
    for i, p in enumerate(parts):
        same = (
            j
            for j in range(i)
            if (p.input_scale is None and parts[j].input_scale is None)
            or (
                p.input_scale is not None
                and parts[j].input_scale is not None
                and bool(torch.equal(p.input_scale, parts[j].input_scale))
            )
        )
        groups.append(next(same, i))
    return groups


@torch.no_grad()
def fuse_linears(*parts: nn.Module) -> FusedLinear | PartwiseLinear:
    """Concatenate ``parts`` (same input size, same dtype and device; all with or all without bias) and point each
    part's parameters at its block of the result. The old per-part storage is freed as it is replaced. Parts that are
    not plain ``nn.Linear`` (quantized layers) give a ``PartwiseLinear`` instead."""
    if len({p.in_features for p in parts}) != 1:
        raise ValueError("fused projections must share their input size")
    if all(isinstance(p, Fp8Linear) for p in parts):
        return Fp8PartwiseLinear(list(parts))
    if not all(isinstance(p, nn.Linear) for p in parts):
        return PartwiseLinear(list(parts))
    with_bias = [p.bias is not None for p in parts]
    if any(with_bias) and not all(with_bias):
        raise ValueError("fused projections must all have a bias or none")
    sizes = [p.out_features for p in parts]
    pad = -sum(sizes) % _ROW_ALIGN
    w0 = parts[0].weight
    weight = torch.cat([p.weight for p in parts] + [w0.new_zeros(pad, w0.shape[1])], dim=0)
    bias = torch.cat([p.bias for p in parts] + [parts[0].bias.new_zeros(pad)], dim=0) if all(with_bias) else None
    start = 0
    for p, n in zip(parts, sizes):
        p.weight = nn.Parameter(weight[start : start + n], requires_grad=False)
        if bias is not None:
            p.bias = nn.Parameter(bias[start : start + n], requires_grad=False)
        start += n
    return FusedLinear(weight, bias, sizes)


def fuse_projections(model: nn.Module) -> None:
    """Every module of ``model`` with a ``fuse_projections()`` method fuses its own projections."""
    for m in list(model.modules()):  # (fusing adds FusedLinear children)
        if m is not model and hasattr(m, "fuse_projections"):
            m.fuse_projections()
