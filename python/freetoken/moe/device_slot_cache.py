"""``DeviceExpertCache``: the expert cache with its bookkeeping on the device, so that a decode step's MoE layers
can be captured in a CUDA graph.

Same cache as ``ExpertSlotCache`` (one pool of slots shared by every MoE layer, each slot one expert's
``gate_up [2I, H]`` + ``down [H, I]``, the same eviction policy: ``lfu`` or ``lru``, see ``slot_cache.py``) and
the same decisions, lookup for lookup: same victims, same ``slot_of`` / ``owner`` / ``freq`` after every call,
same hit and miss counts. ``ExpertSlotCache`` stays as the host reference the tests compare against. Here nothing
reads device data on the host and every shape depends only on the routing's ``[T, k]``:

- state, all device tensors: ``slot_of [L*E + 1] int32`` (flat id ``layer*E + expert`` -> slot, -1 = not
  resident), ``owner [S + 1] int32`` (slot -> flat id, -1 = empty), ``stamp [S + 1] int64`` (the call that last
  used the slot, -1 = empty, so empty slots go first), ``clock [1] int64`` (one tick per ``ensure``),
  ``counts [2] int64`` (hits, misses), ``freq [L*E + 1] int32`` (routing counts, aged). The last entry of
  ``slot_of``, ``owner``, ``stamp`` and ``freq`` is a trash entry: updates that are masked out are redirected there
  instead of branching on the data.
- admission (``kernels/expert_admission.py``): one clock tick per call; hits are stamped with it; the missing
  experts, in ascending expert id, take the slots of smallest eviction key in ascending (key, slot index) order,
  the order of the host's stable argsort. A call never evicts what it uses itself. A slot used by an earlier layer
  of the same step can be evicted: that layer's kernel is already queued on the same stream, before the copy that
  overwrites it. On CUDA one single-program Triton kernel; the torch version
  (fixed-shape ops, about 45 small kernels) is its reference and the CPU path.
- fetch (``kernels/expert_gather.py``): on CUDA a Triton kernel reading the pinned host bank directly through its
  device address, the job count read on the device; on CPU the torch version (fixed shapes too).

The caller must make sure a call routes to at most ``num_slots`` distinct experts (more cannot be resident at once;
the result is then undefined, though no memory outside the cache is touched). Decide by shape: ``T * k <= S``
always qualifies; otherwise stream the layer (``OffloadedExperts`` does).

CUDA-graph padding: ``num_valid_tokens`` (a device int tensor) marks rows at or past it as padding: they count as
neither hit nor miss, fetch nothing, and get slot 0 (their output is discarded).
"""

from __future__ import annotations

from typing import Optional

import torch

from ..kernels.expert_admission import admit_experts_torch, admit_experts_triton
from ..kernels.expert_gather import gather_experts_torch, gather_experts_triton
from ..log import get_logger
from .fetch_cap import FetchCap
from .slot_cache import check_policy, default_age_every

logger = get_logger(__name__)


class DeviceExpertCache:
    def __init__(
        self,
        num_slots: int,
        num_layers: int,
        num_experts: int,
        gate_up_shape: tuple,
        down_shape: tuple,
        dtype: torch.dtype,
        device: torch.device,
        impl: str = "auto",
        policy: str = "lfu",
        age_every: Optional[int] = None,
        fetch_cap: Optional[FetchCap] = None,
    ):
        """``impl``: ``auto`` (Triton on CUDA, torch elsewhere), ``triton`` (also on CPU under TRITON_INTERPRET=1,
        in tests) or ``torch``: the admission, and on CPU the gather too (on CUDA the gather is always the Triton
        kernel: nothing else reads a host bank without the host). ``policy``, ``age_every``, ``fetch_cap``:
        ``ExpertSlotCache``."""
        if num_slots < 1:
            raise ValueError("the expert cache needs at least one slot")
        if impl not in ("auto", "triton", "torch"):
            raise ValueError(f"unknown expert cache implementation {impl!r}")
        self.policy = check_policy(policy)
        self.fetch_cap = fetch_cap
        self.age_every = age_every or default_age_every(num_layers)
        self.num_slots, self.num_layers, self.num_experts = num_slots, num_layers, num_experts
        self.device = torch.device(device)
        self.impl = ("triton" if self.device.type == "cuda" else "torch") if impl == "auto" else impl
        S, dev = num_slots, self.device
        self.gate_up = torch.empty((S, *gate_up_shape), dtype=dtype, device=dev)
        self.down = torch.empty((S, *down_shape), dtype=dtype, device=dev)
        self.trash_id = num_layers * num_experts  # slot_of's trash entry; owner's and stamp's is S
        self.slot_of = torch.full((self.trash_id + 1,), -1, dtype=torch.int32, device=dev)
        self.owner = torch.full((S + 1,), -1, dtype=torch.int32, device=dev)
        self.stamp = torch.full((S + 1,), -1, dtype=torch.int64, device=dev)
        self.clock = torch.zeros(1, dtype=torch.int64, device=dev)
        # hits, misses, and of the misses those left to the host (fetch_cap): one tensor, so that the decode
        # graphs copy all three out behind each step
        self.counts = torch.zeros(3, dtype=torch.int64, device=dev)
        self.freq = torch.zeros(self.trash_id + 1, dtype=torch.int32, device=dev)
        self._pinned: dict[int, bool] = {}  # bank data_ptr -> readable by the gather kernel

    # ------------------------------------------------------------------ host-side reads (each one syncs)

    @property
    def hits(self) -> int:
        return int(self.counts[0])

    @property
    def misses(self) -> int:
        return int(self.counts[1])

    @property
    def spilled(self) -> int:
        return int(self.counts[2])

    def counters(self) -> tuple[int, int]:
        """(hits, misses) in one read."""
        hits, misses, _ = self.counts.tolist()
        return hits, misses

    @property
    def nbytes(self) -> int:
        return self.gate_up.numel() * self.gate_up.element_size() + self.down.numel() * self.down.element_size()

    def resident(self, layer: int) -> list[int]:
        """The experts of ``layer`` that are resident now (tests, stats)."""
        E = self.num_experts
        return torch.nonzero(self.slot_of[layer * E : (layer + 1) * E] >= 0).flatten().tolist()

    def check_integrity(self) -> None:
        """``slot_of`` and ``owner`` describe the same mapping (tests)."""
        slot_of = self.slot_of[: self.trash_id].tolist()
        owner = self.owner[: self.num_slots].tolist()
        for slot, flat in enumerate(owner):
            if flat >= 0:
                assert slot_of[flat] == slot, (slot, flat)
        for flat, slot in enumerate(slot_of):
            if slot >= 0:
                assert owner[slot] == flat, (flat, slot)

    # ------------------------------------------------------------------ the step's path

    @torch.no_grad()
    def ensure(
        self,
        layer: int,
        bank_gate_up: torch.Tensor,
        bank_down: torch.Tensor,
        topk_ids: torch.Tensor,
        num_valid_tokens: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        """``topk_ids [T, k]`` (expert ids of ``layer``) -> slot ids ``[T, k]`` int64, every expert of the first
        ``num_valid_tokens`` rows resident (all rows when None; with ``fetch_cap``, those it spills get slot id -1).
        No host sync; capturable on CUDA."""
        slot_ids, job_src, job_dst, num_jobs = self.admit(layer, topk_ids, num_valid_tokens)
        self.fetch(bank_gate_up, bank_down, job_src, job_dst, num_jobs)
        return slot_ids

    @torch.no_grad()
    def admit(self, layer: int, topk_ids: torch.Tensor, num_valid_tokens: Optional[torch.Tensor] = None):
        """The bookkeeping half of ``ensure``: updates the state and returns ``(slot_ids [T, k] int64, job_src [P],
        job_dst [P], num_jobs)``, the misses to copy (``kernels/expert_admission.py``)."""
        admit = admit_experts_triton if self.impl == "triton" else admit_experts_torch
        return admit(
            self.slot_of,
            self.owner,
            self.stamp,
            self.clock,
            self.counts,
            self.freq,
            topk_ids,
            layer,
            self.num_experts,
            num_valid_tokens,
            lfu=self.policy == "lfu",
            age_every=self.age_every,
            fetch_cap=self.fetch_cap,
            spilled=self.counts[2:],
        )

    @torch.no_grad()
    def fetch(self, bank_gate_up, bank_down, job_src, job_dst, num_jobs) -> None:
        """Copies the jobs ``admit`` returned from the layer's bank into their slots."""
        if self.device.type == "cuda" and not self._readable_from_device(bank_gate_up, bank_down):
            self._fetch_unpinned(bank_gate_up, bank_down, job_src, job_dst, num_jobs)
        elif self.device.type == "cuda" or self.impl == "triton":
            gather_experts_triton(bank_gate_up, bank_down, self.gate_up, self.down, job_src, job_dst, num_jobs)
        else:
            gather_experts_torch(bank_gate_up, bank_down, self.gate_up, self.down, job_src, job_dst, num_jobs)

    def _readable_from_device(self, *banks) -> bool:
        key = banks[0].data_ptr()
        if key not in self._pinned:
            self._pinned[key] = all(b.is_cuda or b.is_pinned() for b in banks)
            if not self._pinned[key]:
                logger.warning(
                    "An expert bank is not pinned: expert misses are copied after a host sync "
                    "(not capturable in a CUDA graph)"
                )
        return self._pinned[key]

    def _fetch_unpinned(self, bank_gate_up, bank_down, job_src, job_dst, num_jobs) -> None:
        # pageable host memory is not addressable by a kernel: read the job list on the host, copy the rows over
        n = int(num_jobs)
        src, dst = job_src[:n].cpu(), job_dst[:n]
        self.gate_up[dst] = bank_gate_up[src].to(self.device)
        self.down[dst] = bank_down[src].to(self.device)
