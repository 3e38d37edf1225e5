"""The report of what a served step made the CUDA caching allocator do (``engine/allocator_events.py``): new
segments are logged as information, a flush-and-retry as a warning; nothing is read off CUDA."""

from __future__ import annotations

import logging

import pytest
import torch

from freetoken.engine.allocator_events import AllocatorCounters, read_counters, report_step_allocations


def test_nothing_is_read_off_cuda():
    assert read_counters(torch.device("cpu")) is None
    assert report_step_allocations(None, None, 1, 10, 1.0) == (0, 0)


def test_growth_is_information_and_a_retry_a_warning(caplog):
    a = AllocatorCounters(segments_allocated=10, alloc_retries=0)
    with caplog.at_level(logging.INFO):
        assert report_step_allocations(a, a, 1, 1090, 77.0) == (0, 0)
        assert caplog.text == ""
        assert report_step_allocations(a, AllocatorCounters(12, 0), 2, 1090, 80.0) == (2, 0)
    assert "Step 2 (1090 tokens, 80 ms) allocated 2 new CUDA segment(s)" in caplog.text
    assert "WARNING" not in caplog.text
    caplog.clear()
    with caplog.at_level(logging.INFO):
        assert report_step_allocations(a, AllocatorCounters(13, 1), 3, 1090, 113.0) == (3, 1)
    assert "Step 3 (1090 tokens, 113 ms): the CUDA caching allocator freed its cache and retried 1" in caplog.text
    assert "WARNING" in caplog.text


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_counters_on_cuda_see_a_new_segment():
    dev = torch.device("cuda")
    torch.cuda.empty_cache()  # no cached segment left to serve the next allocation: it is a cudaMalloc
    before = read_counters(dev)
    x = torch.empty(1 << 30, dtype=torch.uint8, device=dev)
    after = read_counters(dev)
    del x
    assert after.segments_allocated > before.segments_allocated and after.alloc_retries >= before.alloc_retries
