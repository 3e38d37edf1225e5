"""``Nvfp4Experts``: one MoE layer's routed experts resident in NVFP4, and THE NVFP4 expert bank layout.

The bank layout (the one place it is defined; the NVFP4 MoE kernels read it, one expert = one index of the leading
dim; expert offload stores the same tensors as strided views of two rows of words per expert, ``moe/nvfp4_rows.py``,
in host memory, the slot cache and the prefill stream)::

    gate_up_proj         uint8          [E, 2I, H/2]   rows [gate(I) | up(I)], two E2M1 codes per byte, low nibble first
    gate_up_proj_scale   float8_e4m3fn  [E, 2I, H/16]  per-16 block scales, row-major (not swizzled)
    gate_up_proj_global  float32        [E, 2I]        the part's ModelOpt weight_scale_2, repeated on each output row
    down_proj            uint8          [E, H, I/2]
    down_proj_scale      float8_e4m3fn  [E, H, I/16]
    down_proj_global     float32        [E, H]

    W[e, n, k] = e2m1(code[e, n, k]) * float(scale[e, n, k // 16]) * global[e, n]

Why a global per output row rather than folded into the E4M3 block scales: gate and up have different global
scales in NVIDIA's checkpoints and folding can underflow E4M3 (REFERENCES §4.8); per row (not per part) so a
kernel applies it in its epilogue with no knowledge of where gate ends. It costs 12 KiB per expert of
Qwen3.6-35B-A3B against 1.69 MiB of codes and scales.

Loading takes ModelOpt's per-expert tensors ``{e}.{gate,up,down}_proj.{weight,weight_scale,weight_scale_2}``
(compressed-tensors' names are translated before, ``loading/quantized_checkpoint.py``). Compute
(``kernels/nvfp4_moe.py``, ``impl``: ``auto`` | ``torch`` | ``triton``): on CUDA the Triton kernels read the packed
bank directly (decode-sized steps through two GEMVs with the block's shared expert added in their epilogue, larger
ones through the grouped kernels); elsewhere the torch reference dequantizes the experts a step uses to the
activation dtype, then runs the BF16 math. The kernels take ids into the bank's leading dim, so a slot pool in this
layout (the offload cache) runs through them with slot ids.
"""

from __future__ import annotations

import re

import torch
from torch import nn

from ..kernels.nvfp4_moe import DECODE_MAX_PAIRS, nvfp4_moe_torch
from ..quant import nvfp4
from ..tuning_env import int_from_env
from .moe import ExpertsBackend, grouped_shared_args, resolve_moe_impl, write_into

_PIECE = re.compile(r"^(\d+)\.(gate_proj|up_proj|down_proj)\.(weight|weight_scale|weight_scale_2)$")
_SUFFIX = {"weight": "", "weight_scale": "_scale", "weight_scale_2": "_global"}


def _frozen(t: torch.Tensor) -> nn.Parameter:
    return nn.Parameter(t, requires_grad=False)


class Nvfp4Experts(ExpertsBackend):
    impl = "auto"  # auto (Triton on CUDA) | torch | triton (CPU only under TRITON_INTERPRET=1)

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, device=None):
        super().__init__()
        E, H, I = num_experts, hidden_size, intermediate_size
        if H % nvfp4.BLOCK or I % nvfp4.BLOCK:
            raise ValueError(f"NVFP4 experts need hidden and intermediate sizes divisible by {nvfp4.BLOCK}")
        self.num_experts, self.hidden_size, self.intermediate_size = E, H, I
        self._allocate(E, H, I, device)
        self._loaded: set = set()

    def _allocate(self, E: int, H: int, I: int, device) -> None:
        """The six bank tensors as parameters (expert offload keeps them as views of host rows instead)."""
        kw = dict(device=device)
        self.gate_up_proj = _frozen(torch.empty(E, 2 * I, H // 2, dtype=torch.uint8, **kw))
        self.gate_up_proj_scale = _frozen(torch.empty(E, 2 * I, H // 16, dtype=torch.float8_e4m3fn, **kw))
        self.gate_up_proj_global = _frozen(torch.empty(E, 2 * I, dtype=torch.float32, **kw))
        self.down_proj = _frozen(torch.empty(E, H, I // 2, dtype=torch.uint8, **kw))
        self.down_proj_scale = _frozen(torch.empty(E, H, I // 16, dtype=torch.float8_e4m3fn, **kw))
        self.down_proj_global = _frozen(torch.empty(E, H, dtype=torch.float32, **kw))

    def bank(self) -> tuple[torch.Tensor, ...]:
        """The six bank tensors in the order ``nvfp4_moe_torch`` takes them."""
        return (
            self.gate_up_proj,
            self.gate_up_proj_scale,
            self.gate_up_proj_global,
            self.down_proj,
            self.down_proj_scale,
            self.down_proj_global,
        )

    def forward(self, x, topk_ids, topk_weights, shared=None, out=None):
        return nvfp4_experts_forward(self.impl, x, self.bank(), topk_ids, topk_weights, shared, out)

    def takes_nvfp4_shared_down(self, pairs: int) -> bool:
        """The steps ``run_nvfp4_experts`` gives the decode kernel, whose epilogue runs it (the torch paths:
        ``SharedExpertTerm.add_to``)."""
        return pairs <= DECODE_MAX_PAIRS

    def prefill_capturable(self, device: torch.device) -> bool:
        """The Triton path (ids ``num_experts`` go to its all-zero dummy expert); the torch reference syncs."""
        return self.impl == "triton" or (self.impl == "auto" and device.type == "cuda")

    def decode_max_pairs(self) -> int:
        return DECODE_MAX_PAIRS

    @torch.no_grad()
    def load_expert_weight(self, name: str, tensor: torch.Tensor) -> None:
        m = _PIECE.match(name)
        if not m:
            raise KeyError(f"unexpected NVFP4 expert tensor experts.{name} (per-expert ModelOpt tensors expected)")
        e, kind, what = int(m.group(1)), m.group(2), m.group(3)
        if e >= self.num_experts:
            raise ValueError(f"expert index {e} >= num_experts {self.num_experts}")
        fused = "down_proj" if kind == "down_proj" else "gate_up_proj"
        dst = getattr(self, fused + _SUFFIX[what])[e]
        if kind != "down_proj":
            I = self.intermediate_size
            dst = dst[:I] if kind == "gate_proj" else dst[I:]
        if what == "weight_scale_2":
            if tensor.numel() != 1:
                raise ValueError(f"experts.{name}: expected a scalar, got shape {tuple(tensor.shape)}")
            dst.fill_(tensor.reshape(()).item())
        else:
            if tuple(tensor.shape) != tuple(dst.shape) or tensor.dtype != dst.dtype:
                raise ValueError(
                    f"experts.{name}: checkpoint {tensor.dtype} {tuple(tensor.shape)} != bank {dst.dtype} "
                    f"{tuple(dst.shape)}"
                )
            dst.copy_(tensor)
        self._loaded.add((e, kind, what))

    def missing_weights(self) -> list[str]:
        return [
            f"experts.{e}.{k}.{w}"
            for e in range(self.num_experts)
            for k in ("gate_proj", "up_proj", "down_proj")
            for w in _SUFFIX
            if (e, k, w) not in self._loaded
        ]

    @torch.no_grad()
    def fill_dummy(self, std: float, gen: torch.Generator) -> None:
        from .quantized_linear import fill_nvfp4_dummy

        for part in ("gate_up_proj", "down_proj"):
            packed, scale, glob = (getattr(self, part + s) for s in ("", "_scale", "_global"))
            one = torch.empty((), dtype=torch.float32, device=glob.device)
            fill_nvfp4_dummy(packed, scale, one, std, gen)
            glob.fill_(float(one))


def nvfp4_experts_forward(impl, x, bank, topk_ids, topk_weights, shared=None, out=None):
    """The routed experts over a bank in this layout (expert or slot ids) plus ``shared``: the Triton kernels where
    ``impl`` resolves to triton, else the torch reference; written into ``out`` when given."""
    if resolve_moe_impl(impl, x) == "triton":
        return run_nvfp4_experts(x, bank, topk_ids, topk_weights, shared, out)
    y = nvfp4_moe_torch(x, *bank, topk_ids, topk_weights.to(x.dtype))
    return write_into(out, y if shared is None else shared.add_to(y))


# From this many (token, expert) pairs a step dequantizes the whole bank to x's dtype and runs the BF16 grouped kernel
# (``kernels/nvfp4_dequant.py`` says why); below, the grouped NVFP4 kernel. Measured on the H200 at Qwen3.6's expert
# shapes, uniform routing, one layer alone (bench/nvfp4_kernel_bench.py): grouped 797 us vs dequant 1,146 at 1,024
# tokens; 1,981 vs 1,720 at 4,096; 2,873 (128-row blocks) vs 2,554 at 8,192. But end to end, the 8k-token NVFP4
# offload prefill (bench/decode_bench.py) ran 7,757 tok/s on the dequant path against 9,098 on the grouped kernel
# with 64-row blocks, at an earlier commit (why is not measured yet: there the bank is the offload stream's strided
# staging rows, and writing a 1.6 GB BF16 bank a layer shares HBM with the stream). So the default keeps chunks up to
# 8,192 tokens on the grouped kernel, and ``FREETOKEN_NVFP4_DEQUANT_MIN_PAIRS`` moves the cut for the A/B that
# settles it.
def _dequant_min_pairs(default: int = 8192 * 8 + 1) -> int:
    return int_from_env("FREETOKEN_NVFP4_DEQUANT_MIN_PAIRS", default)


DEQUANT_MIN_PAIRS = _dequant_min_pairs()


def run_nvfp4_experts(x, bank, topk_ids, topk_weights, shared=None, out=None):
    """The Triton kernels over a bank in this layout (six tensors, ``Nvfp4Experts.bank()``'s order; expert or slot
    ids): the decode GEMVs for steps of at most ``DECODE_MAX_PAIRS`` pairs (shared expert in their epilogue), the
    grouped kernels above (shared expert added after), from ``DEQUANT_MIN_PAIRS`` pairs over the bank dequantized.
    On CPU this runs under TRITON_INTERPRET=1 only."""
    from ..kernels.nvfp4_dequant import nvfp4_dequant_moe
    from ..kernels.nvfp4_moe import nvfp4_fused_moe_triton, nvfp4_moe_decode_triton

    T, k = topk_ids.shape
    if T * k <= DECODE_MAX_PAIRS:
        args = shared.kernel_args() if shared else {}
        return write_into(out, nvfp4_moe_decode_triton(x, *bank, topk_ids, topk_weights, **args))
    grouped = nvfp4_dequant_moe if T * k >= DEQUANT_MIN_PAIRS else nvfp4_fused_moe_triton
    return grouped(x, *bank, topk_ids, topk_weights.to(x.dtype), **grouped_shared_args(shared), out=out)
