"""``OffloadedExperts``: one MoE layer's routed experts kept in host memory (``--moe-backend offload``).

The layer's bank is the same pair of tensors ``FusedExperts`` holds (``gate_up_proj [E, 2I, H]``,
``down_proj [E, H, I]``, loaded by the same code), but on the host, pinned once filled. A step with few tokens
(decode) goes through the shared ``DeviceExpertCache``: the experts it routes to are made resident and the kernel
runs over the slot pool. A prefill-sized step, or one whose ``T * k`` pairs could need more distinct experts than
the cache has slots, streams the whole layer instead (``PrefillExpertStream``), leaving decode's working set in the
cache. The choice depends on shapes only, so a decode step's path is the same on every replay of a CUDA graph.
"""

from __future__ import annotations

from typing import Optional

import torch

from ..layers.moe import FusedExperts, run_experts


class OffloadedExperts(FusedExperts):
    def __init__(
        self,
        offload,
        index: int,
        num_experts: int,
        hidden_size: int,
        intermediate_size: int,
        dtype: torch.dtype,
        impl: Optional[str] = None,
    ):
        # the bank lives on the host, whatever the ambient device during model construction
        super().__init__(num_experts, hidden_size, intermediate_size, impl, device="cpu", dtype=dtype)
        self.offload = offload  # the ExpertOffload that owns the cache, the stream buffers and num_valid_tokens
        self.index = index  # position among the model's MoE layers (forward order)

    def host_banks(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer's host bank, one expert per index of the leading dim (what the cache and the stream copy)."""
        return self.gate_up_proj, self.down_proj

    def prefill_capturable(self, device: torch.device) -> bool:
        return False  # the cache and the layer stream are planned on the host, step by step

    def cpu_bank(self) -> tuple[torch.Tensor, ...]:
        """The bank as the CPU expert executor reads it (``moe/cpu_experts.py``)."""
        return self.gate_up_proj, self.down_proj

    def forward(self, x, topk_ids, topk_weights, shared=None, out=None):
        gate_up, down, ids, host = device_weights(
            self.offload, self.index, self.host_banks(), x, topk_ids, topk_weights
        )
        y = run_experts(self.impl, x, gate_up, down, ids, topk_weights, shared, out)
        return y if host is None else self.offload.hybrid.finish(host, y)


def device_weights(offload, index: int, banks, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor):
    """``(gate_up, down, ids, host)`` on the device for MoE layer ``index``: the slot pool and slot ids when the
    step's ``T * k`` pairs fit the cache (``ExpertOffload.uses_cache``), else the layer streamed whole with the
    expert ids. Decided by shapes only (see the module docstring); shared by the BF16 and NVFP4 banks. ``host``:
    with the hybrid backend, the pairs the cache left out, handed to the host before the misses are fetched (the
    caller adds them with ``offload.hybrid.finish``); else None."""
    cache = offload.cache
    if offload.uses_cache(topk_ids.shape[0] * topk_ids.shape[1], banks[0].shape[0]):
        slot_ids, job_src, job_dst, num_jobs = cache.admit(index, topk_ids, offload.num_valid_tokens)
        host = None
        if offload.hybrid is not None:
            host = offload.hybrid.start(index, x, topk_ids, slot_ids, topk_weights)
        cache.fetch(banks[0], banks[1], job_src, job_dst, num_jobs)
        return cache.gate_up, cache.down, slot_ids, host
    if offload.num_valid_tokens is not None:  # set only while decode CUDA graphs are captured
        raise RuntimeError(
            f"a decode CUDA graph of {topk_ids.shape[0]} tokens would stream MoE layer {index} (copy-stream events "
            "cannot be captured): the graphs must stop at ExpertOffload.max_cached_batch()"
        )
    gate_up, down = offload.stream.layer_weights(index)
    return gate_up, down, topk_ids, None
