"""The hybrid backend's auto cap (``--moe-hybrid-max-fetch -1``): what share of a layer's misses to fetch over PCIe
so that the fetch and the host CPU's part of the layer finish together.

A layer with ``m`` misses fetches ``f`` of them (``f * bytes / pcie``) while the host computes the other ``m - f``
(``(m - f) * bytes / cpu``): both end together at ``f = m * pcie / (pcie + cpu)`` (FreeToken's q*). A fixed cap
cannot follow ``m``: one stream misses a few experts a layer, 32 streams dozens, and a cap of 3 sends all but 3 of
those to the host. So the cache admits ``max(AUTO_MAX_FETCH, ceil(q* * m))`` (``slot_cache.fetch_cap``): the fixed
cap measured best at one stream stays the floor, and many streams split their misses by the two bandwidths.

``measure`` takes both bandwidths side by side at start-up, as a decode step loads them (both read host memory): a
copy of one layer's whole host bank to the device (the prefill stream's buffer, idle then) on a side stream, and
meanwhile the CPU experts of the next layer, ``k`` distinct experts a call for one token, repeated until the copy is
done. A few tens of milliseconds.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch


@dataclass
class FetchShare:
    per_mille: int  # of a layer's misses fetched (slot_cache.fetch_cap)
    pcie_gb_s: float  # host-to-device copy of expert bytes, measured beside ...
    cpu_gb_s: float  # ... the CPU experts' weight bytes read per second

    def describe(self) -> str:
        return (
            f"or {self.per_mille / 10:.0f}% of its misses where more (PCIe {self.pcie_gb_s:.1f} GB/s beside the CPU "
            f"experts' {self.cpu_gb_s:.1f} GB/s, measured at start-up)"
        )


def share_of(pcie_gb_s: float, cpu_gb_s: float) -> int:
    """q* = pcie / (pcie + cpu), per mille (0: no PCIe; 1000: no CPU)."""
    total = pcie_gb_s + cpu_gb_s
    return 1000 if total <= 0 else round(1000 * pcie_gb_s / total)


@torch.no_grad()
def measure(offload, k: int, rounds: int = 2) -> FetchShare:
    """Both bandwidths side by side on ``offload`` (an ``ExpertOffload`` with hybrid enabled, on CUDA, after
    ``finish_loading``); ``k``: experts a CPU call computes (the model's top-k). The best of ``rounds``."""
    hybrid, stream = offload.hybrid, offload.stream
    banks = offload.layers[0].host_banks()
    host_layer = hybrid.layers[1 % len(hybrid.layers)]
    expert_bytes = offload.expert_bytes
    E = banks[0].shape[0]
    k = max(1, min(k, E))
    x = torch.randn(1, host_layer.hidden_size).to(torch.bfloat16)
    weights = torch.full((1, k), 1.0 / k)
    side = torch.cuda.Stream(offload.device)
    best_pcie = best_cpu = 0.0
    host_layer.forward(x, torch.arange(k).view(1, k), weights)  # its first call (buffers, thread wake-up)
    for _ in range(rounds):
        torch.cuda.synchronize(offload.device)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(side):
            start.record(side)
            stream.gate_up[0].copy_(banks[0], non_blocking=True)
            stream.down[0].copy_(banks[1], non_blocking=True)
            end.record(side)
        calls, first, t0 = 0, 0, time.perf_counter()
        while calls == 0 or not end.query():
            ids = (torch.arange(k) + first) % E
            host_layer.forward(x, ids.view(1, k), weights)
            calls, first = calls + 1, first + k
        cpu_s = time.perf_counter() - t0
        end.synchronize()
        best_pcie = max(best_pcie, E * expert_bytes / (start.elapsed_time(end) * 1e-3) / 1e9)
        best_cpu = max(best_cpu, calls * k * expert_bytes / cpu_s / 1e9)
    return FetchShare(share_of(best_pcie, best_cpu), best_pcie, best_cpu)
