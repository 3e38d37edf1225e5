"""``OffloadedExperts``: one MoE layer's routed experts kept in host memory (``--moe-backend offload``).

The layer's bank is the same pair of tensors ``FusedExperts`` holds (``gate_up_proj [E, 2I, H]``,
``down_proj [E, H, I]``, loaded by the same code), but on the host, pinned once filled. A step with few tokens
(decode) goes through the shared ``ExpertSlotCache``: the experts it routes to are made resident and the kernel
runs over the slot pool. A prefill-sized step, or one needing more distinct experts than the cache has slots,
streams the whole layer instead (``PrefillExpertStream``), leaving decode's working set in the cache.
"""

from __future__ import annotations

from typing import Optional

import torch

from ..layers.moe import FusedExperts, run_experts


class OffloadedExperts(FusedExperts):
    def __init__(self, offload, index: int, num_experts: int, hidden_size: int, intermediate_size: int,
                 dtype: torch.dtype, impl: Optional[str] = None):
        # the bank lives on the host, whatever the ambient device during model construction
        super().__init__(num_experts, hidden_size, intermediate_size, impl, device="cpu", dtype=dtype)
        self.offload = offload  # the ExpertOffload that owns the cache and the stream buffers
        self.index = index  # position among the model's MoE layers (forward order)

    def forward(self, x, topk_ids, topk_weights):
        cache = self.offload.cache
        slot_ids = None
        if cache is not None and x.shape[0] * topk_ids.shape[1] < self.num_experts:
            slot_ids = cache.lookup(self.index, self.gate_up_proj, self.down_proj, topk_ids)
        if slot_ids is not None:
            return run_experts(self.impl, x, cache.gate_up, cache.down, slot_ids, topk_weights)
        gate_up, down = self.offload.stream.layer_weights(self.index)
        return run_experts(self.impl, x, gate_up, down, topk_ids, topk_weights)
