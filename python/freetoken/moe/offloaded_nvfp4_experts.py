"""``OffloadedNvfp4Experts``: one MoE layer's NVFP4 routed experts kept in host memory (``--moe-backend offload``
with an NVFP4 checkpoint).

The host bank is the NVFP4 bytes themselves (codes, E4M3 block scales, per-row globals: ``Nvfp4Rows``), about
3.6x smaller than BF16, so every cache miss and every streamed prefill layer moves 3.6x fewer bytes over PCIe.
Loading, the dummy fill and the six bank tensors are ``Nvfp4Experts``' (here views of the host rows). A step goes
through ``device_weights`` like the BF16 layer: the slot pool (rows of the same layout, slot ids) or the layer
streamed whole (expert ids); either way the NVFP4 kernels (or the torch reference off CUDA) run on the views.
"""

from __future__ import annotations

import torch
from torch import nn

from ..layers.nvfp4_experts import Nvfp4Experts, nvfp4_experts_forward
from .nvfp4_rows import Nvfp4Rows
from .offloaded_experts import device_weights

_BANK = (
    "gate_up_proj",
    "gate_up_proj_scale",
    "gate_up_proj_global",
    "down_proj",
    "down_proj_scale",
    "down_proj_global",
)
_DUMMY_DISTINCT = 8  # --dummy-weight: this many random experts per layer, repeated (the CPU generator is slow)


class OffloadedNvfp4Experts(Nvfp4Experts):
    def __init__(self, offload, index: int, num_experts: int, hidden_size: int, intermediate_size: int):
        self.rows = Nvfp4Rows(hidden_size, intermediate_size)
        super().__init__(num_experts, hidden_size, intermediate_size, device="cpu")
        self.offload = offload  # the ExpertOffload that owns the cache, the stream buffers and num_valid_tokens
        self.index = index  # position among the model's MoE layers (forward order)

    def _allocate(self, E: int, H: int, I: int, device) -> None:
        # the bank lives on the host whatever the ambient device; the rows are the parameters (counted once)
        gate_up, down = self.rows.allocate(E, "cpu")
        self.gate_up_rows = nn.Parameter(gate_up, requires_grad=False)
        self.down_rows = nn.Parameter(down, requires_grad=False)
        self._set_views()

    def _set_views(self) -> None:
        for name, view in zip(_BANK, self.rows.views(self.gate_up_rows, self.down_rows)):
            setattr(self, name, view)  # plain attributes, not parameters: the rows hold the bytes

    def _apply(self, fn, recurse=True):
        out = super()._apply(fn, recurse)
        self._set_views()  # a .to() / .float() may give the rows new storage
        return out

    def host_banks(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.gate_up_rows, self.down_rows

    def prefill_capturable(self, device: torch.device) -> bool:
        return False  # the cache and the layer stream are planned on the host, step by step

    def cpu_bank(self) -> tuple[torch.Tensor, ...]:
        """The bank as the CPU expert executor reads it: the six views of the host rows (``moe/cpu_experts.py``)."""
        return tuple(self.rows.views(*self.host_banks()))

    def forward(self, x, topk_ids, topk_weights, shared=None, out=None):
        gate_up, down, ids, host = device_weights(
            self.offload, self.index, self.host_banks(), x, topk_ids, topk_weights
        )
        bank = self.rows.views(gate_up, down)
        y = nvfp4_experts_forward(self.impl, x, bank, ids, topk_weights, shared, out)
        return y if host is None else self.offload.hybrid.finish(host, y)

    @torch.no_grad()
    def fill_dummy(self, std: float, gen: torch.Generator) -> None:
        """A few random experts (``Nvfp4Experts.fill_dummy``), their rows repeated over the layer."""
        n = min(self.num_experts, _DUMMY_DISTINCT)
        few = Nvfp4Experts(n, self.hidden_size, self.intermediate_size, device="cpu")
        few.fill_dummy(std, gen)
        src = self.rows.allocate(n, "cpu")
        for dst_view, part in zip(self.rows.views(*src), few.bank()):
            dst_view.copy_(part)
        for mine, theirs in zip(self.host_banks(), src):
            for start in range(0, self.num_experts, n):
                piece = mine[start : start + n]
                piece.copy_(theirs[: piece.shape[0]])
