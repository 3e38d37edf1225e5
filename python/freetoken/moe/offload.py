"""``ExpertOffload``: what ``--moe-backend offload`` adds to a model, and the worker's one handle on it.

Lifecycle (``worker.py``):

1. ``model = cls(config, experts_factory=offload.make_experts)`` — every MoE block gets an ``OffloadedExperts``
   whose bank lives in host memory; nothing expert-sized touches the device. An NVFP4 checkpoint's experts come
   from ``make_nvfp4_experts`` instead (``OffloadedNvfp4Experts``: the bank in NVFP4 bytes, ``nvfp4_rows.py``);
   the cache, the gather and the stream below copy either kind the same way (each layer's ``host_banks()``).
2. Weights load (or the dummy fill) into the host banks through the usual ``load_expert_weight`` path.
3. ``finish_loading()`` pins the banks in place (pin-after-fill: registering filled pages is faster than a pinned
   allocation, and exact-size where torch's pinned allocator rounds up to a power of two) and allocates the
   prefill stream buffers.
4. After the start-up dry run has measured the workspace, ``allocate_cache(num_slots)`` creates the GPU slot
   cache (``DeviceExpertCache``: bookkeeping on the device, capturable in a CUDA graph) from what the memory plan
   leaves (``cache_slots``); with ``hit_d2d`` the prefill stream then copies the experts it holds from their slots.

CUDA graphs: a graph runner that pads a decode batch sets ``num_valid_tokens`` (a device int tensor, the number of
real tokens; the rows after them are padding) before capturing and leaves it set for the replays; every
``OffloadedExperts`` passes it to the cache, so padding rows neither count nor fetch experts. None (the default)
means every row is real. Set it back to None for eager steps.

Hit and miss counters feed each step's ``expert_hits`` / ``expert_misses`` / ``expert_host_misses``.

``--moe-backend hybrid`` / ``cpu`` (``enable_hybrid``): the cache admits the misses a ``FetchCap`` allows a layer
per decode step (``fetch_cap.py``; ``cpu``: none) and the host CPU computes the pairs of the others
(``hybrid_experts.py``); prefill steps stream layers as with ``offload``.
"""

from __future__ import annotations

import math
from typing import Optional

import torch

from ..log import get_logger
from ..tuning_env import choice_from_env
from .backend_choice import AUTO_ONE_TOKEN_FETCH
from .device_slot_cache import DeviceExpertCache
from .fetch_cap import FetchCap
from .host_pinning import pin_in_place
from .offloaded_experts import OffloadedExperts
from .prefill_stream import PrefillExpertStream
from .slot_cache import POLICIES

logger = get_logger(__name__)

GiB = 1 << 30


class ExpertOffload:
    def __init__(
        self, device: torch.device, dtype: torch.dtype, top_k: int, overlap: bool = True, hit_d2d: bool = False
    ):
        """``overlap``: two prefill stream buffers, copies beside compute; ``hit_d2d`` (``--moe-prefill-hit-d2d``):
        the prefill stream copies the experts the cache holds from their slots (``resident_experts.py``)."""
        self.device, self.dtype, self.top_k, self.overlap, self.hit_d2d = device, dtype, top_k, overlap, hit_d2d
        self.layers: list[OffloadedExperts] = []
        self.cache: Optional[DeviceExpertCache] = None
        self.num_valid_tokens: Optional[torch.Tensor] = None  # CUDA-graph padding: see the module docstring
        self.stream: Optional[PrefillExpertStream] = None
        self.pinned = False
        self.hybrid = None  # HybridExperts (enable_hybrid): --moe-backend hybrid / cpu
        # read before any weight loads, so a bad value is refused at once
        self.cache_policy = choice_from_env("FREETOKEN_MOE_CACHE_POLICY", "lfu", POLICIES)

    # ------------------------------------------------------------------ construction

    def make_experts(self, layer_id: int, num_experts: int, hidden_size: int, intermediate_size: int):
        """The ``experts_factory`` for model construction: one host-resident bank per MoE layer, in order."""
        experts = OffloadedExperts(self, len(self.layers), num_experts, hidden_size, intermediate_size, self.dtype)
        self.layers.append(experts)
        return experts

    def make_nvfp4_experts(self, layer_id: int, num_experts: int, hidden_size: int, intermediate_size: int):
        """``make_experts`` for NVFP4 experts: the host bank in NVFP4 bytes."""
        from .offloaded_nvfp4_experts import OffloadedNvfp4Experts

        experts = OffloadedNvfp4Experts(self, len(self.layers), num_experts, hidden_size, intermediate_size)
        self.layers.append(experts)
        return experts

    def finish_loading(self) -> None:
        if not self.layers:
            raise ValueError("--moe-backend offload: the model has no MoE layers")
        gate_up, down = self.layers[0].host_banks()
        if any(_layout(e.host_banks()) != _layout((gate_up, down)) for e in self.layers):
            raise ValueError("--moe-backend offload: the MoE layers' experts differ in shape or quantization")
        if self.device.type == "cuda":
            self.pinned = all(pin_in_place(t, self.device) for e in self.layers for t in e.host_banks())
            if not self.pinned:
                logger.warning("Could not pin the host expert banks; expert copies will be synchronous and slower")
        self.stream = PrefillExpertStream(
            [e.host_banks() for e in self.layers],
            tuple(gate_up.shape),
            tuple(down.shape),
            gate_up.dtype,
            self.device,
            overlap=self.overlap,
        )

    def enable_hybrid(self, max_fetch: int, threads: int = 0, auto_share: bool = False):
        """After ``finish_loading``: decode misses past ``max_fetch`` a layer go to the host CPU (``threads``:
        ``--moe-cpu-threads``, 0 = the physical cores less ``hybrid_experts.ENGINE_CORES`` beside a GPU).
        ``auto_share`` (on CUDA): ``max_fetch`` becomes the floor of a cap that follows each layer's misses by the
        measured bandwidths (``hybrid_fetch_share.py``), and a one-token step fetches at most ``AUTO_ONE_TOKEN_FETCH``;
        returns that ``FetchShare``, else None."""
        from .hybrid_experts import HybridExperts

        self.hybrid = HybridExperts([e.cpu_bank() for e in self.layers], self.device, max_fetch, threads)
        if not (auto_share and self.device.type == "cuda" and max_fetch > 0):
            return None
        return self._measure_fetch_share(max_fetch)

    def _measure_fetch_share(self, max_fetch: int):
        """The auto cap's share, measured and set on the hybrid experts; None (and a warning) when the measurement
        fails: it must not stop the server, the fixed cap still serves."""
        from . import hybrid_fetch_share

        try:
            share = hybrid_fetch_share.measure(self, self.top_k)
        except Exception as e:
            logger.warning(f"Hybrid experts: measuring the fetch share failed ({e!r}); the cap stays {max_fetch}")
            return None
        self.hybrid.fetch_cap = FetchCap(max_fetch, share.per_mille, min(max_fetch, AUTO_ONE_TOKEN_FETCH))
        return share

    def allocate_cache(self, num_slots: int) -> None:
        first = self.layers[0]
        gate_up, down = first.host_banks()
        self.cache = DeviceExpertCache(
            num_slots,
            len(self.layers),
            first.num_experts,
            tuple(gate_up.shape[1:]),
            tuple(down.shape[1:]),
            gate_up.dtype,
            self.device,
            policy=self.cache_policy,
            fetch_cap=self.hybrid.fetch_cap if self.hybrid is not None else None,
        )
        if self.hit_d2d and self.cache.fetch_cap != FetchCap(0):  # (--moe-backend cpu: the cache stays empty)
            self.stream.use_cache(self.cache)

    @property
    def format(self) -> str:
        """What one expert is stored as: ``nvfp4`` or the model dtype (``bfloat16``, ...)."""
        if hasattr(self.layers[0], "rows"):
            return "nvfp4"
        return str(self.dtype).removeprefix("torch.")

    # ------------------------------------------------------------------ sizes

    @property
    def total_experts(self) -> int:
        return sum(e.num_experts for e in self.layers)

    @property
    def expert_bytes(self) -> int:
        """Bytes of one expert (gate_up + down)."""
        return sum(t[0].numel() * t.element_size() for t in self.layers[0].host_banks())

    @property
    def host_bytes(self) -> int:
        return self.total_experts * self.expert_bytes

    @property
    def min_useful_slots(self) -> int:
        """REFERENCES §7.4: below 3 × top_k slots per layer an LRU expert cache hits almost never."""
        return 3 * self.top_k * len(self.layers)

    def cache_slots(self, args: dict, budget_bytes: Optional[int]) -> tuple[int, str]:
        """Slots for ``--moe-cache-size`` / ``--moe-cache-rate`` / auto (what ``budget_bytes`` holds; every expert
        when no budget is known, as on CPU). Returns (slots, how it was chosen)."""
        total = self.total_experts
        if args.get("moe_cache_size"):
            return min(int(args["moe_cache_size"]), total), "--moe-cache-size"
        if args.get("moe_cache_rate"):
            return max(1, min(total, math.ceil(float(args["moe_cache_rate"]) * total))), "--moe-cache-rate"
        if budget_bytes is None:
            return total, "auto (every expert)"
        slots = min(total, budget_bytes // self.expert_bytes)
        if slots < 1:
            raise MemoryError(
                f"no device memory left for the expert cache ({budget_bytes / GiB:.2f} GiB after the KV floor: "
                "--kv-reserve-tokens, at least one full context); lower --kv-reserve-tokens, --max-seq-len-override "
                "or --max-prefill-length, or set --moe-cache-size"
            )
        return int(slots), "auto"

    # ------------------------------------------------------------------ the cache or the stream

    def uses_cache(self, pairs: int, num_experts: int) -> bool:
        """Whether a step of ``pairs`` (token, expert) pairs on a layer of ``num_experts`` runs over the slot cache:
        when even all-distinct experts fit the slots and are no more than the layer has (then the misses the cache
        fetches are never more experts than streaming the whole layer copies, and usually far fewer: 32 tokens at
        top-8 of 256 experts route to ~163 distinct under uniform routing, and hits cost nothing). Shapes only, so
        a CUDA graph's replays take the path its capture took."""
        return self.cache is not None and pairs <= num_experts and pairs <= self.cache.num_slots

    def max_cached_batch(self) -> int:
        """The largest decode batch (one token a sequence) whose every MoE layer runs over the slot cache. Decode
        CUDA graphs stop there: the layer stream's copy-stream events cannot be captured, and its bytes per
        step (every expert of every layer over PCIe) dwarf a launch overhead anyway."""
        t = 0
        while all(self.uses_cache((t + 1) * self.top_k, e.num_experts) for e in self.layers):
            t += 1
        return t

    # ------------------------------------------------------------------ counters

    def counters(self) -> tuple[int, int]:
        """(hits, misses) so far (reads the device counters: one sync)."""
        return self.cache.counters() if self.cache is not None else (0, 0)

    def streamed_counters(self) -> tuple[int, int]:
        """Experts the prefill stream copied so far: (from the cache's slots, over PCIe); host counters."""
        return self.stream.experts_from_cache, self.stream.experts_from_host

    def all_counters(self) -> tuple[int, int, int]:
        """(hits, misses, misses computed on the host) so far: the cache's ``counts`` (one sync)."""
        return tuple(self.cache.counts.tolist()) if self.cache is not None else (0, 0, 0)


def _layout(banks) -> tuple:
    return tuple((tuple(t.shape), t.dtype) for t in banks)
