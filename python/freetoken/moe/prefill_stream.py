"""``PrefillExpertStream``: whole MoE layers copied from pinned host banks to the device for prefill-sized steps.

A prefill chunk routes its tokens to nearly every expert of every layer, so instead of going through the slot
cache (and flushing decode's working set out of it) the layer's whole bank is copied into a device buffer of
``[E, ...]`` and the grouped kernel runs over it with the original expert ids.

With two buffers on CUDA the copies overlap compute: while layer i computes from buffer ``i % 2``, layer i+1 is
copied into the other buffer on a side stream. Events order it::

    copy stream:   wait release[b] -> copy layer -> record ready[b]
    compute:       wait ready[b] -> MoE of the layer (its release[b] is recorded when the next layer asks)

PCIe is the limit either way (a BF16 Qwen3.6-35B-A3B layer is 1.6 GB, ≈ 30 ms at 55 GB/s); the overlap hides the
compute behind it. On CPU, or with one buffer, the copy is synchronous on the current stream.

With ``use_cache`` (``--moe-prefill-hit-d2d``) the experts the decode cache holds are copied from their slots on the
device and only the others cross PCIe (``resident_experts.py``).
"""

from __future__ import annotations

from typing import Optional

import torch

from ..kernels.expert_gather import gather_experts_torch, gather_experts_triton
from .resident_experts import ResidentExperts


class PrefillExpertStream:
    def __init__(
        self,
        banks: list,
        gate_up_shape: tuple,
        down_shape: tuple,
        dtype: torch.dtype,
        device: torch.device,
        overlap: bool = True,
    ):
        """``banks[i]`` = ``(gate_up [E, 2I, H], down [E, H, I])`` host tensors of the i-th MoE layer."""
        self.banks = banks
        self.device = device
        self.overlap = bool(overlap) and device.type == "cuda" and len(banks) > 1
        n = 2 if self.overlap else 1
        self.gate_up = [torch.empty(gate_up_shape, dtype=dtype, device=device) for _ in range(n)]
        self.down = [torch.empty(down_shape, dtype=dtype, device=device) for _ in range(n)]
        self.holds: list[Optional[int]] = [None] * n  # which layer each buffer holds (or is being filled with)
        self.last: Optional[int] = None  # the layer whose MoE was queued last
        if self.overlap:
            self.copy_stream = torch.cuda.Stream(device=device)
            self.ready = [torch.cuda.Event() for _ in range(n)]
            self.released = [torch.cuda.Event() for _ in range(n)]
        self.layers_copied = 0
        self.resident: Optional[ResidentExperts] = None  # use_cache: copy the cache's experts device-to-device
        self.experts_from_cache = 0  # experts copied from the slot cache (use_cache) ...
        self.experts_from_host = 0  # ... and over PCIe

    def use_cache(self, cache) -> None:
        """Copy the experts ``cache`` (a ``DeviceExpertCache`` over the same layers) holds from its slots."""
        if (cache.num_layers, cache.num_experts) != (len(self.banks), self.gate_up[0].shape[0]):
            raise ValueError("the expert cache's layers and experts are not the stream's")
        self.resident = ResidentExperts(cache)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.gate_up + self.down)

    def layer_weights(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Device copies of ``layer``'s whole bank, ready for kernels queued on the current stream next."""
        if layer == 0 and self.resident is not None:
            self.resident.refresh()  # a new forward: decode steps since the last one may have moved the cache
        if not self.overlap:
            if self.holds[0] != layer:
                self._fill(layer, 0)
                self.holds[0] = layer
                self.layers_copied += 1
            return self.gate_up[0], self.down[0]
        current = torch.cuda.current_stream(self.device)
        if self.last is not None:
            # the previous layer's MoE is queued: its buffer may be refilled once that work is done
            self.released[self.last % 2].record(current)
        b = layer % 2
        if self.holds[b] != layer:
            self._copy(layer, b)
        current.wait_event(self.ready[b])
        nxt = layer + 1
        if nxt < len(self.banks) and self.holds[nxt % 2] != nxt:
            self._copy(nxt, nxt % 2)  # prefetch while this layer computes
        self.last = layer
        return self.gate_up[b], self.down[b]

    def _copy(self, layer: int, b: int) -> None:
        with torch.cuda.stream(self.copy_stream):
            self.copy_stream.wait_event(self.released[b])
            self._fill(layer, b)
            self.ready[b].record(self.copy_stream)
        self.holds[b] = layer
        self.layers_copied += 1

    def _fill(self, layer: int, b: int) -> None:
        """Queues the copies of ``layer``'s bank into buffer ``b`` on the current stream."""
        gate_up, down = self.banks[layer]
        if self.resident is None:
            self.gate_up[b].copy_(gate_up, non_blocking=True)
            self.down[b].copy_(down, non_blocking=True)
            self.experts_from_host += gate_up.shape[0]
            return
        jobs = self.resident.jobs(layer)
        if jobs is not None:
            cache = self.resident.cache
            gather = gather_experts_triton if self.device.type == "cuda" else gather_experts_torch
            gather(cache.gate_up, cache.down, self.gate_up[b], self.down[b], *jobs)
            self.experts_from_cache += len(self.resident.slots[layer])
        for lo, hi in self.resident.runs[layer]:
            self.gate_up[b][lo:hi].copy_(gate_up[lo:hi], non_blocking=True)
            self.down[b][lo:hi].copy_(down[lo:hi], non_blocking=True)
            self.experts_from_host += hi - lo
