"""``ResidentExperts``: which experts of each MoE layer the decode cache holds, so that a streamed prefill layer
copies those device-to-device from their slots and only the rest over PCIe (``--moe-prefill-hit-d2d``).

A prefill chunk routes to nearly every expert, so ``PrefillExpertStream`` copies whole layers; the experts decode
keeps in the slot cache are on the device already, and a D2D copy of one costs ~1/50 of its PCIe copy. On a GPU
whose cache holds half the experts, that halves the prefill's PCIe bytes.

The map is read on the host once per streamed forward (``refresh``, one sync: the ``slot_of`` table of every
layer, a few KiB), at its first MoE layer. Within a streamed step nothing admits or evicts (a step either streams
every layer or uses the cache in every layer), and the sync orders the earlier decode steps' fetches before any
read of their slots, so a slot read from the copy stream holds the expert the map says until the step ends.

Per layer it gives the resident experts as a job list for the expert gather kernel (source: slots of the pool,
destination: expert rows of the stream buffer) and the missing experts as runs of consecutive ids, each one
``cudaMemcpyAsync`` at the link's full rate (the gather kernel reads host memory at ~0.9 of it).
"""

from __future__ import annotations

import torch


class ResidentExperts:
    def __init__(self, cache):
        """``cache``: the ``DeviceExpertCache`` (its ``slot_of`` table, pool ``gate_up`` / ``down``, its layers and
        experts are the stream's)."""
        self.cache = cache
        L, E = cache.num_layers, cache.num_experts
        self.slots: list[list[tuple[int, int]]] = [[] for _ in range(L)]  # (expert, slot) per layer
        self.runs: list[list[tuple[int, int]]] = [[(0, E)] for _ in range(L)]  # [lo, hi) of missing experts
        self._jobs: list = [None] * L  # device (slot ids, expert ids, count) per layer, built on demand
        self.refreshes = 0

    @torch.no_grad()
    def refresh(self) -> None:
        """Reads the cache's map (syncs the current stream). Call before the first layer of a streamed forward."""
        L, E = self.cache.num_layers, self.cache.num_experts
        table = self.cache.slot_of[: L * E].view(L, E).cpu().tolist()
        for layer, row in enumerate(table):
            self.slots[layer] = [(e, s) for e, s in enumerate(row) if s >= 0]
            self.runs[layer] = _missing_runs(row)
            self._jobs[layer] = None
        self.refreshes += 1

    def jobs(self, layer: int):
        """``(job_src, job_dst, num_jobs)`` device tensors for the gather kernel: slot ids, expert ids, their count
        (``kernels/expert_gather.py``); None when the layer has no resident expert."""
        pairs = self.slots[layer]
        if not pairs:
            return None
        if self._jobs[layer] is None:
            dev = self.cache.slot_of.device
            experts, slots = zip(*pairs)
            self._jobs[layer] = (
                torch.tensor(slots, dtype=torch.int64).to(dev, non_blocking=True),
                torch.tensor(experts, dtype=torch.int64).to(dev, non_blocking=True),
                torch.tensor([len(pairs)], dtype=torch.int64).to(dev, non_blocking=True),
            )
        return self._jobs[layer]


def _missing_runs(slot_row: list[int]) -> list[tuple[int, int]]:
    """``[lo, hi)`` runs of consecutive experts whose slot is -1 (not resident)."""
    runs, start = [], None
    for e, s in enumerate(slot_row):
        if s < 0 and start is None:
            start = e
        elif s >= 0 and start is not None:
            runs.append((start, e))
            start = None
    if start is not None:
        runs.append((start, len(slot_row)))
    return runs
