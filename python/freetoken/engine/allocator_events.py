"""What a served step made PyTorch's CUDA caching allocator do, reported in the log.

A step whose tensors do not fit the allocator's cached segments asks the driver for a new one (``cudaMalloc``); when
the driver has no room left (the KV pool takes what the memory plan leaves), the allocator frees every cached
segment it is not using (a device-wide sync and a ``cudaFree`` each) and retries. Either can cost a served step
milliseconds to tens of milliseconds that its kernels do not explain (on the H200 the first ~1,100-token turn of an
agent session took 113 ms where the next took 77, 2026-12-03: not yet attributed). The worker reads the allocator's
counters around each eager step (~0.1 ms of host, prefill-sized steps only) and logs steps that grew or flushed it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from ..log import get_logger

logger = get_logger(__name__)


@dataclass(frozen=True)
class AllocatorCounters:
    segments_allocated: int  # cudaMalloc calls since start (the allocator's "segment.all.allocated")
    alloc_retries: int  # times it freed its cached segments and retried ("num_alloc_retries")


def read_counters(device: torch.device) -> Optional[AllocatorCounters]:
    """The allocator's counters on a CUDA ``device``; None elsewhere."""
    if device.type != "cuda":
        return None
    # the nested form: torch.cuda.memory_stats flattens and sorts ~300 entries in Python (~0.5 ms of host time a
    # read, twice a prefill step, on a step the host already paces)
    stats = torch.cuda.memory_stats_as_nested_dict(device)
    segments = stats.get("segment", {}).get("all", {}).get("allocated", 0)
    return AllocatorCounters(int(segments), int(stats.get("num_alloc_retries", 0)))


def report_step_allocations(
    before: Optional[AllocatorCounters],
    after: Optional[AllocatorCounters],
    step_id: int,
    num_tokens: int,
    step_ms: float,
) -> tuple[int, int]:
    """Logs a served step that asked the driver for memory (info) or flushed the allocator's cache (warning);
    returns ``(new segments, retries)``."""
    if before is None or after is None:
        return 0, 0
    grown = after.segments_allocated - before.segments_allocated
    retries = after.alloc_retries - before.alloc_retries
    if retries > 0:
        logger.warning(
            f"Step {step_id} ({num_tokens} tokens, {step_ms:.0f} ms): the CUDA caching allocator freed its cache and "
            f"retried {retries} allocation(s) (each a device-wide sync), {grown} new segment(s): the step needed more "
            "than the allocator had cached and the driver had no room left"
        )
    elif grown > 0:
        logger.info(f"Step {step_id} ({num_tokens} tokens, {step_ms:.0f} ms) allocated {grown} new CUDA segment(s)")
    return grown, retries
