"""Linear layers whose weights stay quantized on the device: ``Nvfp4Linear`` and ``Fp8Linear``.

Parameter names are the checkpoint's (ModelOpt, REFERENCES §3.1, §3.5), so the models' ``load_weights`` is the same
lookup as for ``nn.Linear``::

    Nvfp4Linear  weight uint8 [N, K/2], weight_scale float8_e4m3fn [N, K/16], weight_scale_2 float32 []
    Fp8Linear    weight float8_e4m3fn [N, K], weight_scale float32 [], input_scale float32 []

``forward`` dispatches by ``impl`` (``auto``: the kernels on CUDA, the torch reference elsewhere; ``torch`` or
``triton`` pin one, tests do): ``Nvfp4Linear`` runs the W4A16 Triton kernels of ``kernels/nvfp4_linear.py``,
``Fp8Linear`` W8A8 through ``torch._scaled_mm`` with tensor-wise scales (``kernels/fp8_linear.py``; static
``input_scale``, or a dynamic per-tensor one with ``dynamic_input=True``). At decode sizes on CUDA (up to
``kernels/mixed_gemv.FP8_MAX_M`` rows) ``Fp8Linear`` runs one W8A16 launch of ``kernels/mixed_gemv.py`` instead (no
activation quantization kernel), and so does an ``Nvfp4Linear`` with few rows (up to ``MAX_M``; no split-K
reduce). Past those rows a lone Linear keeps its GEMMs: the fused projections' tensor-core twin
(``kernels/mixed_dot.py``) ran the lone FP8 o_proj (2048 x 4096) at 10-14 us where W8A8 took 8 (H200, 2026-12-04).
The torch reference every kernel is checked against dequantizes the whole weight to the activation dtype,
then runs one matmul (W4A16 / W8A16; a W4A4 checkpoint's ``input_scale`` is not used for NVFP4).
``dequantized_weight`` gives the same tensor for tests and tools.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from ..kernels.fp8_linear import fp8_linear, fp8_linear_scaled_mm
from ..kernels.mixed_gemv import MixedRows, mixed_gemv_triton, use_mixed_gemv
from ..kernels.nvfp4_linear import nvfp4_linear_triton
from ..quant import fp8, nvfp4

IMPLS = ("auto", "torch", "triton")

# A lone NVFP4 Linear with fewer output rows than this (the shared expert's down projection; not the lm_head, whose
# GEMV is tuned for its 248,320 rows) takes the mixed GEMV at decode sizes: the same time alone on the H200 (2.7 us
# at 1 row, 2026-12-02), but one launch where the GEMV splits K and adds a reduce, and launches add up in a decode step
MIXED_MAX_ROWS = 16384


def _frozen(t: torch.Tensor) -> nn.Parameter:
    return nn.Parameter(t, requires_grad=False)


class QuantizedLinear(nn.Module):
    """Common shape of the quantized layers: ``in_features``, ``out_features``, an optional bias in the model dtype."""

    scheme: str
    impl: str = "auto"  # auto | torch | triton (the kernels: CUDA, or CPU under TRITON_INTERPRET=1 for NVFP4)

    def __init__(self, in_features: int, out_features: int, bias: bool, dtype: torch.dtype, device=None):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.bias = _frozen(torch.empty(out_features, dtype=dtype, device=device)) if bias else None

    def dequantized_weight(self, dtype: torch.dtype) -> torch.Tensor:
        raise NotImplementedError

    def forward_reference(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.dequantized_weight(x.dtype), self.bias)

    def use_kernel(self, x: torch.Tensor) -> bool:
        if self.impl not in IMPLS:
            raise ValueError(f"unknown implementation {self.impl!r} (one of {', '.join(IMPLS)})")
        return self.impl == "triton" or (self.impl == "auto" and x.is_cuda)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.forward_reference(x)

    def fill_dummy(self, std: float, gen: torch.Generator) -> None:
        """Random values in the quantized layout whose dequantized weight has about ``std`` (``--dummy-weight``)."""
        raise NotImplementedError

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, scheme={self.scheme}"


class Nvfp4Linear(QuantizedLinear):
    scheme = "nvfp4"

    def __init__(self, in_features: int, out_features: int, bias: bool = False, dtype=torch.bfloat16, device=None):
        super().__init__(in_features, out_features, bias, dtype, device)
        if in_features % nvfp4.BLOCK:
            raise ValueError(f"NVFP4 Linear needs in_features divisible by {nvfp4.BLOCK}, got {in_features}")
        kw = dict(device=device)
        self.weight = _frozen(torch.empty(out_features, in_features // 2, dtype=torch.uint8, **kw))
        self.weight_scale = _frozen(
            torch.empty(out_features, in_features // nvfp4.BLOCK, dtype=torch.float8_e4m3fn, **kw)
        )
        self.weight_scale_2 = _frozen(torch.empty((), dtype=torch.float32, **kw))

    def dequantized_weight(self, dtype: torch.dtype) -> torch.Tensor:
        return nvfp4.dequantize(self.weight, self.weight_scale, self.weight_scale_2, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.impl == "auto" and self.bias is None and self.out_features < MIXED_MAX_ROWS:
            rows = MixedRows(
                self.in_features,
                nvfp4_weight=self.weight,
                nvfp4_scale=self.weight_scale,
                nvfp4_global=self.weight_scale_2,
            )
            if use_mixed_gemv(x, rows):  # one launch where the GEMV splits K and adds a reduce
                return mixed_gemv_triton(x, rows)
        if self.use_kernel(x):
            return nvfp4_linear_triton(x, self.weight, self.weight_scale, self.weight_scale_2, self.bias)
        return self.forward_reference(x)

    @torch.no_grad()
    def fill_dummy(self, std: float, gen: torch.Generator) -> None:
        fill_nvfp4_dummy(self.weight, self.weight_scale, self.weight_scale_2, std, gen)


class Fp8Linear(QuantizedLinear):
    """``dynamic_input``: the checkpoint has no ``input_scale`` (dynamic activation quantization): the W8A8 kernel
    takes ``amax(|x|) / 448`` per call, on the device."""

    scheme = "fp8"

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = False,
        dtype=torch.bfloat16,
        device=None,
        dynamic_input: bool = False,
    ):
        super().__init__(in_features, out_features, bias, dtype, device)
        self.weight = _frozen(torch.empty(out_features, in_features, dtype=torch.float8_e4m3fn, device=device))
        self.weight_scale = _frozen(torch.empty((), dtype=torch.float32, device=device))
        self.dynamic_input = dynamic_input
        self.input_scale = None if dynamic_input else _frozen(torch.empty((), dtype=torch.float32, device=device))

    def dequantized_weight(self, dtype: torch.dtype) -> torch.Tensor:
        return fp8.dequantize(self.weight, self.weight_scale, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.impl == "triton":  # pinned: the W8A8 kernel even where ``fp8_linear`` would pick the reference
            return fp8_linear_scaled_mm(x, self.weight, self.weight_scale, self.input_scale, self.bias)
        if self.impl == "auto" and self.bias is None:
            # one W8A16 launch: no activation quantization kernel, the reference's arithmetic
            rows = MixedRows(self.in_features, fp8_weight=self.weight, fp8_scale=self.weight_scale)
            if use_mixed_gemv(x, rows):
                return mixed_gemv_triton(x, rows)
        if self.use_kernel(x):
            return fp8_linear(x, self.weight, self.weight_scale, self.input_scale, self.bias)
        return self.forward_reference(x)

    @torch.no_grad()
    def fill_dummy(self, std: float, gen: torch.Generator) -> None:
        w = torch.empty(self.weight.shape, dtype=torch.float32, device=self.weight.device)
        w.normal_(0.0, 1.0, generator=gen)
        self.weight.copy_(w.clamp(-fp8.E4M3_MAX, fp8.E4M3_MAX).to(torch.float8_e4m3fn))
        self.weight_scale.fill_(std)
        if self.input_scale is not None:
            self.input_scale.fill_(1.0 / fp8.E4M3_MAX)


def fill_nvfp4_dummy(
    packed: torch.Tensor, scale: torch.Tensor, scale_2: torch.Tensor, std: float, gen: torch.Generator
) -> None:
    """Uniform random codes (rms of the E2M1 values ~2.9) with block scales spread over [1, 2) in E4M3, and
    ``scale_2`` so that the dequantized weight has about ``std``."""
    packed.view(-1).random_(0, 256, generator=gen)
    s = torch.empty(scale.shape, dtype=torch.float32, device=scale.device)
    s.uniform_(1.0, 2.0, generator=gen)
    scale.copy_(s.to(torch.float8_e4m3fn))
    scale_2.fill_(std / (2.93 * 1.5))


def make_quantized_linear(
    scheme: str, in_features: int, out_features: int, bias: bool, dtype: torch.dtype, device
) -> QuantizedLinear:
    if scheme == "fp8_dynamic":
        return Fp8Linear(in_features, out_features, bias, dtype=dtype, device=device, dynamic_input=True)
    cls: Optional[type] = {"nvfp4": Nvfp4Linear, "w4a16_nvfp4": Nvfp4Linear, "fp8": Fp8Linear}.get(scheme)
    if cls is None:
        raise ValueError(f"unknown quantization scheme {scheme!r}")
    return cls(in_features, out_features, bias, dtype=dtype, device=device)
