"""The device timeline of a profiled step (``engine/device_timeline.py``): busy time as the union of overlapping
device work, the idle gaps between, and the work on either side of each gap."""

from types import SimpleNamespace

import torch

from freetoken.engine.device_timeline import device_intervals, format_timeline, timeline


def test_union_span_idle_and_the_longest_gaps_first():
    # a and b overlap (two streams), then c and d back to back, then e after a long wait; microseconds
    t = timeline([(20, 30, "c"), (0, 10, "a"), (5, 12, "b"), (30, 31, "d"), (100, 110, "e")])
    assert abs(t["span_ms"] - 0.110) < 1e-12
    assert abs(t["busy_ms"] - 0.033) < 1e-12  # 0-12, 20-31, 100-110
    assert abs(t["idle_ms"] - 0.077) < 1e-12
    assert t["num_gaps"] == 2
    assert [(round(ms, 6), a, b) for ms, a, b in t["gaps"]] == [(0.069, "d", "e"), (0.008, "b", "c")]


def test_a_gap_follows_the_work_that_ended_last():
    t = timeline([(0, 50, "long"), (10, 20, "short"), (60, 70, "next")])
    assert t["gaps"] == [(0.01, "long", "next")]
    assert abs(t["busy_ms"] - 0.06) < 1e-12


def test_top_keeps_the_longest_and_counts_all():
    intervals = [(i * 10, i * 10 + 10 - (i % 4), f"k{i}") for i in range(40)]  # gaps of 1-3 us, none after k39
    t = timeline(intervals, top=3)
    assert t["num_gaps"] == 29 and len(t["gaps"]) == 3
    assert all(abs(ms - 0.003) < 1e-12 for ms, _, _ in t["gaps"])


def test_nothing_on_the_device():
    assert timeline([]) is None
    assert format_timeline(None) == ""


def test_only_device_events_of_a_profile_count():
    from torch.autograd import DeviceType

    def event(device_type, start, end, name):
        return SimpleNamespace(device_type=device_type, time_range=SimpleNamespace(start=start, end=end), name=name)

    events = [
        event(DeviceType.CPU, 0, 100, "aten::mm"),
        event(DeviceType.CUDA, 10, 20, "kernel_a"),
        event(DeviceType.CUDA, 30, 30, "zero_length"),
        event(DeviceType.CUDA, 40, 45, "kernel_b"),
    ]
    assert device_intervals(events) == [(10.0, 20.0, "kernel_a"), (40.0, 45.0, "kernel_b")]
    line = format_timeline(timeline(device_intervals(events)))
    assert "span 0.0 ms" in line and "1 gaps" in line and "after kernel_a before kernel_b" in line


def test_a_cpu_profile_has_no_device_timeline():
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        torch.ones(64, 64) @ torch.ones(64, 64)
    assert device_intervals(prof.events()) == []
