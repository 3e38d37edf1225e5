"""``HybridExperts``: the host half of ``--moe-backend hybrid`` and ``cpu``: the misses the expert cache does not
fetch are computed on the host CPU, beside the GPU, inside the decode step (and its CUDA graph).

A decode step's MoE layer with hybrid on (``OffloadedExperts.forward`` through ``device_weights``):

1. the cache admits the misses its ``FetchCap`` allows (``fetch_cap.py``, ``DeviceExpertCache``; ``cpu``: none); the
   pairs of the others get slot id -1;
2. ``start``: those pairs' expert ids, their weights and x go to pinned host buffers and the host is told; it
   computes (the CPU expert executor, native, no GIL) while the GPU fetches its misses and runs the other pairs;
3. ``finish``: the GPU waits for the host's fp32 sums and adds them to the layer's output.

How the GPU and the host signal each other: a mailbox. One kernel packs the buffers through UVA and writes a
request into a pinned control block that a polling thread of ours reads (``freetoken._core.CpuExpertMailbox``); one
kernel spins until the host answered and adds its sums (``kernels/host_expert_mailbox.py``). A layer without host
pairs rings nothing and waits for nothing: two short kernels a layer. (Until 2026-12-07 a CUDA host node on a side
stream, ``cuLaunchHostFunc``, could do it instead, at ~49 us a layer even with nothing for the host; beside it on an
H100 the mailbox decoded 23 % faster under Zipf routing, 25 % under uniform, 96 % when every expert hits:
``bench/results/2026-12-07-h100-qwen3.6-35b-a3b-nvfp4-decode-hybrid-mailbox.txt``.)

Every buffer and native call has a fixed address per (layer, batch size), so both kernels are captured once in a
decode CUDA graph and replay with new routing. Consecutive layers share the pinned buffers: a layer writes them only
after the previous layer's ``finish`` waited for the host. On a CPU device there is no mailbox: ``start`` computes at
once and ``finish`` adds.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Optional

import torch

from .cpu_experts import CpuExperts, physical_cores
from .fetch_cap import FetchCap

# cores left to the engine beside a GPU (its step thread, the HTTP server, the CUDA driver's threads) when
# --moe-cpu-threads is 0: the executor's workers spin between calls (the mailbox's polling thread is the executor's
# calling thread, one of its threads). 12 of 16 ran the H100 host's better hybrid decode
# (bench/results/2026-12-06-h100-qwen3.6-35b-a3b-nvfp4-decode-hybrid.txt; not isolated from its cap of 3)
ENGINE_CORES = 4


def engine_side_threads() -> int:
    """The executor's threads beside a GPU: the physical cores less ``ENGINE_CORES`` (at least 1)."""
    return max(1, physical_cores() - ENGINE_CORES)


@dataclass
class _Buffers:
    """One batch size's host inputs and output (pinned on CUDA: the mailbox's kernels read and write them)."""

    x: torch.Tensor  # [T, H] bf16
    ids: torch.Tensor  # [T, k] int64, -1: not the host's pair
    weights: torch.Tensor  # [T, k] fp32
    out: torch.Tensor  # [T, H] fp32, written by the host's call


@dataclass
class HostWork:
    """What ``start`` leaves for ``finish``: the host's sums (CPU device), or the buffers whose ``out`` the host's
    call writes (CUDA)."""

    out: Optional[torch.Tensor] = None
    buffers: Optional[_Buffers] = None


class HybridExperts:
    def __init__(self, banks: list, device: torch.device, max_fetch: int, threads: int = 0):
        """``banks``: each MoE layer's host bank (``OffloadedExperts.cpu_bank()``), in order. ``max_fetch``: misses
        a layer's cache admits per step (0: the ``cpu`` backend). ``threads``: ``--moe-cpu-threads``."""
        self.device = torch.device(device)
        if threads == 0 and self.device.type == "cuda":
            threads = engine_side_threads()
        self.layers = [CpuExperts(bank, threads) for bank in banks]
        self.threads = self.layers[0].executor.threads if self.layers else 0
        self.fetch_cap = FetchCap(max_fetch)  # the auto cap's share and one-token cap added by offload.py
        self._buffers: dict[tuple[int, int], _Buffers] = {}
        self._calls: dict[tuple[int, int, int], int] = {}  # (layer, T, k) -> the call's index in the mailbox
        self._direct_seconds = 0.0  # the direct path's host time (no mailbox)
        self.mailbox = None
        if self.device.type == "cuda":
            self._open_mailbox(self.device)

    def _open_mailbox(self, device: torch.device, start: bool = True) -> None:
        """The control block (pinned), the device's words and the polling thread (``start``; tests leave it off
        for a host that never answers, or open one on the CPU under ``TRITON_INTERPRET=1``): the experts then
        hand off to ``device`` (their buffers pinned where it is CUDA)."""
        from .. import _core
        from ..kernels import host_expert_mailbox

        self.device = torch.device(device)
        self.control = torch.zeros(3, dtype=torch.int64, pin_memory=self.device.type == "cuda")
        self.state = host_expert_mailbox.new_state(device)
        self.mailbox = _core.CpuExpertMailbox(self.control, self.control.data_ptr(), start)

    def start(self, index: int, x: torch.Tensor, topk_ids: torch.Tensor, slot_ids: torch.Tensor, topk_weights):
        """Hands layer ``index``'s pairs whose slot id is -1 to the host (see the module docstring)."""
        if self.mailbox is not None:
            return self._pack(index, x, topk_ids, slot_ids, topk_weights)
        host_ids = torch.where(slot_ids < 0, topk_ids.to(slot_ids.dtype), -1)
        t0 = time.perf_counter()
        out = self.layers[index].forward(x.to(torch.bfloat16).contiguous(), host_ids, topk_weights)
        self._direct_seconds += time.perf_counter() - t0
        return HostWork(out=out)

    @property
    def busy_seconds(self) -> float:
        """Seconds the host has spent computing its pairs so far (the mailbox thread's calls, or the direct ones):
        beside the steps' time it says whether the host is what a decode step waits on."""
        return self.mailbox.busy_seconds if self.mailbox is not None else self._direct_seconds

    def finish(self, work: HostWork, y: torch.Tensor) -> torch.Tensor:
        """Adds the host's sums to the layer's output ``y [T, H]`` (in place) and returns it."""
        if work.out is not None:
            return y.add_(work.out.to(y.dtype))
        from ..kernels.host_expert_mailbox import wait_and_add

        return wait_and_add(y, work.buffers.out, self.control, self.state)

    def check_errors(self) -> None:
        """Raises what the host's calls met since the last check (the mailbox's thread cannot raise; a failed call
        wrote zeros instead), or a mailbox that stopped answering. Each step: two word reads when nothing failed."""
        from .. import _core

        if self.mailbox is not None and int(self.control[2]) != 0:
            raise RuntimeError(
                "the CPU experts' mailbox thread did not answer a MoE layer's request in time: hybrid MoE is stuck "
                f"(thread running: {self.mailbox.polling})"
            )
        if self.mailbox is None or not _core.cpu_expert_call_failed():
            return  # (without a mailbox the host's experts run in ``start`` and raise there)
        errors = dict(self.mailbox.take_errors())
        where = {call: (layer, T) for (layer, T, _), call in self._calls.items()}
        for call, message in errors.items():
            layer, T = where.get(call, ("?", "?"))
            raise RuntimeError(f"CPU experts of MoE layer {layer} ({T} tokens): {message}")

    def _pack(self, index: int, x, topk_ids, slot_ids, topk_weights) -> HostWork:
        from ..kernels.host_expert_mailbox import pack_for_host

        T, k = topk_ids.shape
        buf = self._buffers_for(T, k, x.shape[1])
        pack_for_host(x, topk_ids.contiguous(), slot_ids.contiguous(), topk_weights.contiguous(), buf.x, buf.ids,
                      buf.weights, self.control, self.state, self._call_for(index, buf))  # fmt: skip
        return HostWork(buffers=buf)

    def _buffers_for(self, T: int, k: int, H: int) -> _Buffers:
        key = (T, k)
        if key not in self._buffers:
            pinned = dict(pin_memory=self.device.type == "cuda")
            self._buffers[key] = _Buffers(
                x=torch.empty(T, H, dtype=torch.bfloat16, **pinned),
                ids=torch.empty(T, k, dtype=torch.int64, **pinned),
                weights=torch.empty(T, k, dtype=torch.float32, **pinned),
                out=torch.zeros(T, H, dtype=torch.float32, **pinned),
            )
        return self._buffers[key]

    def _call_for(self, index: int, buf: _Buffers) -> int:
        """Layer ``index``'s native call over ``buf``, registered once: its index in the mailbox."""
        T, k = buf.ids.shape
        key = (index, T, k)
        if key not in self._calls:
            self._calls[key] = self.layers[index].mailbox_call(self.mailbox, buf.x, buf.ids, buf.weights, buf.out)
        return self._calls[key]
