"""``ExpertSlotCache``: the GPU's cache of routed experts, one pool of slots shared by every MoE layer.

Each slot holds one expert's ``gate_up [2I, H]`` and ``down [H, I]``. ``lookup(layer, ...)`` makes every expert a
step routes to in that layer resident (copying misses from the layer's pinned host bank into the slots the policy
evicts) and returns the routing rewritten from expert ids to slot ids, so the grouped MoE kernel runs over the
slot pool unchanged. Slots used by the current lookup are never evicted by it; a slot used earlier in the same
step can be, because its kernel is already queued on the same stream before the copy that overwrites it.

Eviction (``policy``): ``lfu`` (the default) evicts the slot whose expert was routed to least often, counting every
routing since start-up, resident or not, halved every ``age_every`` lookups (about 256 decode steps) so the
counts follow a changing workload; ties go to the lowest slot. ``lru`` evicts the least recently used slot. Every
miss is admitted either way (the kernels read experts from slots only), unless ``fetch_cap`` (``fetch_cap.py``, the
hybrid backend: the rest are computed on the host CPU) caps the misses a lookup admits: then the most often routed
misses are fetched (ties: lowest expert id) and the others keep slot id -1. Under skewed routing LFU keeps each
layer's popular experts: on ``FREETOKEN_BENCH_ROUTING=zipf`` (40 layers x 256 experts, top-8, 1,024 slots) it hits
0.565 of lookups against LRU's 0.41, the best fixed choice of experts being 0.568 (a replay of the bench's draws,
2026-12-02); under uniform routing the two are alike. ``FREETOKEN_MOE_CACHE_POLICY`` picks it (benchmarks A/B).

The bookkeeping is on the host (one device-to-host copy of the routing per MoE layer per step): simple and exact,
not CUDA-graph capturable. ``slot_of[layer, expert]`` is −1 for an expert not resident. The engine runs
``DeviceExpertCache`` (``device_slot_cache.py``: the same decisions with the bookkeeping on the device); this class
is the reference its tests replay every lookup against.
"""

from __future__ import annotations

from typing import Optional

import numpy as np
import torch

from .fetch_cap import FetchCap

POLICIES = ("lfu", "lru")


def check_policy(policy: str) -> str:
    if policy not in POLICIES:
        raise ValueError(f"unknown expert cache policy {policy!r}: expected one of {', '.join(POLICIES)}")
    return policy


def default_age_every(num_layers: int) -> int:
    """Lookups between two halvings of the routing counts: 256 decode steps (one lookup per MoE layer a step)."""
    return 256 * max(1, num_layers)


class ExpertSlotCache:
    def __init__(
        self,
        num_slots: int,
        num_layers: int,
        num_experts: int,
        gate_up_shape: tuple,
        down_shape: tuple,
        dtype: torch.dtype,
        device: torch.device,
        policy: str = "lfu",
        age_every: Optional[int] = None,
        fetch_cap: Optional[FetchCap] = None,
    ):
        if num_slots < 1:
            raise ValueError("the expert cache needs at least one slot")
        self.policy = check_policy(policy)
        self.fetch_cap = fetch_cap
        self.age_every = age_every or default_age_every(num_layers)
        self.num_slots, self.num_layers, self.num_experts = num_slots, num_layers, num_experts
        self.device = device
        self.gate_up = torch.empty((num_slots, *gate_up_shape), dtype=dtype, device=device)
        self.down = torch.empty((num_slots, *down_shape), dtype=dtype, device=device)
        self.slot_of = np.full((num_layers, num_experts), -1, dtype=np.int64)
        self.owner = np.full(num_slots, -1, dtype=np.int64)  # layer * num_experts + expert, −1 = empty
        self.last_used = np.full(num_slots, -1, dtype=np.int64)  # the lookup that last used the slot; -1 = empty
        self.freq = np.zeros(num_layers * num_experts, dtype=np.int64)  # routing counts (lfu), aged
        self.clock = 0
        self.hits = 0
        self.misses = 0
        self.spilled = 0  # misses left to the host (fetch_cap), counted among the misses too

    @property
    def nbytes(self) -> int:
        return self.gate_up.numel() * self.gate_up.element_size() + self.down.numel() * self.down.element_size()

    def lookup(
        self, layer: int, bank_gate_up: torch.Tensor, bank_down: torch.Tensor, topk_ids: torch.Tensor
    ) -> Optional[torch.Tensor]:
        """``topk_ids [T, k]`` (expert ids of ``layer``) -> slot ids of the same shape, every expert resident
        (but those past ``fetch_cap``: -1). None when the layer needs more distinct experts than there are slots
        (the caller streams the layer)."""
        needed = np.unique(topk_ids.detach().cpu().numpy())
        if len(needed) > self.num_slots:
            return None
        self.clock += 1
        if self.clock % self.age_every == 0:
            self.freq //= 2
        self.freq[layer * self.num_experts + needed] += 1
        slots = self.slot_of[layer, needed]
        hit = slots >= 0
        self.last_used[slots[hit]] = self.clock
        missing = needed[~hit]
        self.hits += int(hit.sum())
        self.misses += len(missing)
        cap = None if self.fetch_cap is None else self.fetch_cap.of(len(missing), topk_ids.shape[0])
        if cap is not None and len(missing) > cap:
            flat = layer * self.num_experts + missing
            fetched = np.lexsort((missing, -self.freq[flat]))[:cap]  # most routed first, then lowest id
            self.spilled += len(missing) - cap
            missing = np.sort(missing[fetched])
        if len(missing):
            # Everything this lookup uses is stamped with the current clock and sorts last: the len(missing) first
            # slots are all free to take (len(needed) <= num_slots guarantees there are that many).
            victims = np.argsort(self._eviction_key(), kind="stable")[: len(missing)]
            for expert, slot in zip(missing.tolist(), victims.tolist()):
                old = int(self.owner[slot])
                if old >= 0:
                    self.slot_of[old // self.num_experts, old % self.num_experts] = -1
                self.owner[slot] = layer * self.num_experts + expert
                self.slot_of[layer, expert] = slot
                self.last_used[slot] = self.clock
                self.gate_up[slot].copy_(bank_gate_up[expert], non_blocking=True)
                self.down[slot].copy_(bank_down[expert], non_blocking=True)
        lut = torch.tensor(self.slot_of[layer], dtype=torch.int64, device=self.device)
        return lut[topk_ids]

    def _eviction_key(self) -> np.ndarray:
        if self.policy == "lru":
            return self.last_used
        score = np.where(self.owner >= 0, self.freq[np.maximum(self.owner, 0)], -1)
        return np.where(self.last_used == self.clock, np.iinfo(np.int64).max, score)

    def resident(self, layer: int) -> list[int]:
        """The experts of ``layer`` that are resident now (tests, stats)."""
        return np.flatnonzero(self.slot_of[layer] >= 0).tolist()

    def check_integrity(self) -> None:
        """``slot_of`` and ``owner`` describe the same mapping (tests)."""
        for slot, flat in enumerate(self.owner.tolist()):
            if flat >= 0:
                assert self.slot_of[flat // self.num_experts, flat % self.num_experts] == slot
        layers, experts = np.nonzero(self.slot_of >= 0)
        for layer, expert in zip(layers.tolist(), experts.tolist()):
            assert self.owner[self.slot_of[layer, expert]] == layer * self.num_experts + expert
