"""``DeviceExpertCache``: the expert LRU cache with its bookkeeping on the device, so that a decode step's MoE
layers can be captured in a CUDA graph.

Same cache as ``ExpertSlotCache`` (one pool of slots shared by every MoE layer, each slot one expert's
``gate_up [2I, H]`` + ``down [H, I]``, exact LRU) and the same decisions, lookup for lookup: same victims, same
``slot_of`` / ``owner`` after every call, same hit and miss counts. ``ExpertSlotCache`` stays as the host reference
the tests compare against. Here nothing reads device data on the host and every shape depends only on the
routing's ``[T, k]``:

- state, all device tensors: ``slot_of [L*E + 1] int32`` (flat id ``layer*E + expert`` -> slot, -1 = not
  resident), ``owner [S + 1] int32`` (slot -> flat id, -1 = empty), ``stamp [S + 1] int64`` (LRU stamps, -1 =
  empty, so empty slots go first), ``clock [1] int64`` (one tick per ``ensure``), ``counts [2] int64`` (hits,
  misses). The last entry of ``slot_of``, ``owner`` and ``stamp`` is a trash entry: updates that are masked out are
  redirected there instead of branching on the data.
- admission (``ensure``), in plain torch ops over the ``P = T*k`` routed pairs: a pairwise P x P compare finds each
  expert's first occurrence and ranks the missing experts by expert id; ``topk`` over ``stamp * S + slot`` gives the
  oldest slots in (stamp, slot index) order, the order of the host's stable argsort; missing expert of rank r takes
  the r-th oldest slot. Hits are stamped first with the current clock, the newest stamp, so a call never evicts a
  slot it uses itself. A slot used by an earlier layer of the same step can be evicted: that layer's kernel is
  already queued on the same stream, before the copy that overwrites it.
- fetch: ``kernels/expert_gather.py``; on CUDA a Triton kernel reading the pinned host bank directly, with
  ``num_jobs`` read on the device (``gather_experts_torch`` on CPU, where nothing needs to be capturable).

The caller must make sure a call routes to at most ``num_slots`` distinct experts (more cannot be resident at once;
the result is then undefined, though no memory outside the cache is touched). Decide by shape: ``T * k <= S``
always qualifies; otherwise stream the layer (``OffloadedExperts`` does).

CUDA-graph padding: ``num_valid_tokens`` (a device int tensor) marks rows at or past it as padding: they count as
neither hit nor miss, fetch nothing, and get slot 0 (their output is discarded).
"""

from __future__ import annotations

from typing import Optional

import torch

from ..kernels.expert_gather import gather_experts_torch, gather_experts_triton
from ..log import get_logger

logger = get_logger(__name__)


class DeviceExpertCache:
    def __init__(self, num_slots: int, num_layers: int, num_experts: int, gate_up_shape: tuple, down_shape: tuple,
                 dtype: torch.dtype, device: torch.device, gather: str = "auto"):
        """``gather``: how misses are copied: ``auto`` (Triton on CUDA, torch elsewhere), ``triton`` or ``torch``."""
        if num_slots < 1:
            raise ValueError("the expert cache needs at least one slot")
        if gather not in ("auto", "triton", "torch"):
            raise ValueError(f"unknown expert gather {gather!r}")
        self.num_slots, self.num_layers, self.num_experts = num_slots, num_layers, num_experts
        self.device = torch.device(device)
        self.gather = ("triton" if self.device.type == "cuda" else "torch") if gather == "auto" else gather
        S, dev = num_slots, self.device
        self.gate_up = torch.empty((S, *gate_up_shape), dtype=dtype, device=dev)
        self.down = torch.empty((S, *down_shape), dtype=dtype, device=dev)
        self.trash_id = num_layers * num_experts  # slot_of's trash entry; owner's and stamp's is S
        self.slot_of = torch.full((self.trash_id + 1,), -1, dtype=torch.int32, device=dev)
        self.owner = torch.full((S + 1,), -1, dtype=torch.int32, device=dev)
        self.stamp = torch.full((S + 1,), -1, dtype=torch.int64, device=dev)
        self.clock = torch.zeros(1, dtype=torch.int64, device=dev)
        self.counts = torch.zeros(2, dtype=torch.int64, device=dev)  # hits, misses
        self.slot_index = torch.arange(S, dtype=torch.int64, device=dev)
        self._pinned: dict[int, bool] = {}  # bank data_ptr -> readable by the gather kernel

    # ------------------------------------------------------------------ host-side reads (each one syncs)

    @property
    def hits(self) -> int:
        return int(self.counts[0])

    @property
    def misses(self) -> int:
        return int(self.counts[1])

    @property
    def nbytes(self) -> int:
        return self.gate_up.numel() * self.gate_up.element_size() + self.down.numel() * self.down.element_size()

    def resident(self, layer: int) -> list[int]:
        """The experts of ``layer`` that are resident now (tests, stats)."""
        E = self.num_experts
        return torch.nonzero(self.slot_of[layer * E:(layer + 1) * E] >= 0).flatten().tolist()

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
    def ensure(self, layer: int, bank_gate_up: torch.Tensor, bank_down: torch.Tensor, topk_ids: torch.Tensor,
               num_valid_tokens: Optional[torch.Tensor] = None) -> torch.Tensor:
        """``topk_ids [T, k]`` (expert ids of ``layer``) -> slot ids ``[T, k]`` int64, every expert of the first
        ``num_valid_tokens`` rows resident (all rows when None). No host sync; capturable on CUDA."""
        slot_ids, job_src, job_dst, num_jobs = self.admit(layer, topk_ids, num_valid_tokens)
        self.fetch(bank_gate_up, bank_down, job_src, job_dst, num_jobs)
        return slot_ids

    @torch.no_grad()
    def admit(self, layer: int, topk_ids: torch.Tensor, num_valid_tokens: Optional[torch.Tensor] = None):
        """The bookkeeping half of ``ensure``: updates the state and returns ``(slot_ids [T, k] int64, job_src [P],
        job_dst [P], num_jobs)``, the misses to copy (expert of the bank -> slot), in ascending expert order."""
        T, k = topk_ids.shape
        P, S, E, dev = T * k, self.num_slots, self.num_experts, self.device
        self.clock += 1
        if P == 0:
            empty = torch.zeros(0, dtype=torch.int64, device=dev)
            return empty.view(T, k), empty, empty, torch.zeros((), dtype=torch.int64, device=dev)
        expert = topk_ids.reshape(-1).to(device=dev, dtype=torch.int64)
        position = torch.arange(P, device=dev)
        if num_valid_tokens is None:
            valid = torch.ones(P, dtype=torch.bool, device=dev)
        else:
            valid = position // k < num_valid_tokens.reshape(()).to(dev)
        flat = torch.where(valid, expert + layer * E, self.trash_id)

        # the first occurrence of each expert counts (the host looks at the unique ids)
        earlier = torch.ones(P, P, dtype=torch.bool, device=dev).tril(-1)  # [i, j]: j < i
        repeated = ((flat[:, None] == flat[None, :]) & earlier).any(1)
        first = valid & ~repeated
        current = self.slot_of[flat].long()
        hit = first & (current >= 0)
        miss = first & (current < 0)
        self.counts += torch.stack((hit.sum(), miss.sum()))
        self.stamp.index_put_((torch.where(hit, current, S),), self.clock)

        # missing expert of rank r (ascending expert id) takes the r-th oldest slot (ascending stamp, then slot)
        rank = (miss[None, :] & (expert[None, :] < expert[:, None])).sum(1)
        candidates = min(P, S)
        oldest = torch.topk(self.stamp[:S] * S + self.slot_index, candidates, largest=False, sorted=True).indices
        victim = oldest[rank.clamp(max=candidates - 1)]
        evicted = self.owner[victim].long()
        self.slot_of.index_fill_(0, torch.where(miss & (evicted >= 0), evicted, self.trash_id), -1)
        self.slot_of.index_put_((torch.where(miss, flat, self.trash_id),), victim.to(torch.int32))
        taken = torch.where(miss, victim, S)
        self.owner.index_put_((taken,), flat.to(torch.int32))
        self.stamp.index_put_((taken,), self.clock)

        job_src = torch.zeros(P + 1, dtype=torch.int64, device=dev)
        job_src.index_put_((torch.where(miss, rank, P),), expert)
        job_dst = oldest[position.clamp(max=candidates - 1)]
        slot_ids = torch.where(valid, self.slot_of[flat].long(), 0).view(T, k)
        return slot_ids, job_src[:P], job_dst, miss.sum()

    @torch.no_grad()
    def fetch(self, bank_gate_up, bank_down, job_src, job_dst, num_jobs) -> None:
        """Copies the jobs ``admit`` returned from the layer's bank into their slots."""
        if self.gather == "torch":
            gather_experts_torch(bank_gate_up, bank_down, self.gate_up, self.down, job_src, job_dst, num_jobs)
        elif self.device.type != "cuda" or self._readable_from_device(bank_gate_up, bank_down):
            gather_experts_triton(bank_gate_up, bank_down, self.gate_up, self.down, job_src, job_dst, num_jobs)
        else:
            self._fetch_unpinned(bank_gate_up, bank_down, job_src, job_dst, num_jobs)

    def _readable_from_device(self, *banks) -> bool:
        key = banks[0].data_ptr()
        if key not in self._pinned:
            self._pinned[key] = all(b.is_cuda or b.is_pinned() for b in banks)
            if not self._pinned[key]:
                logger.warning("An expert bank is not pinned: expert misses are copied after a host sync "
                               "(not capturable in a CUDA graph)")
        return self._pinned[key]

    def _fetch_unpinned(self, bank_gate_up, bank_down, job_src, job_dst, num_jobs) -> None:
        # pageable host memory is not addressable by a kernel: read the job list on the host and copy row by row
        n = int(num_jobs)
        src, dst = job_src[:n].cpu(), job_dst[:n]
        self.gate_up[dst] = bank_gate_up[src].to(self.device)
        self.down[dst] = bank_down[src].to(self.device)
