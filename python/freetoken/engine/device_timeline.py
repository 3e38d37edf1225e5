"""Where the device sat idle inside a profiled step: the step's device activity as intervals, their union (busy), the
span from the first to the last, and the longest gaps with the work on either side.

Why: a served agent turn's prefill step spans 82-104 ms of the device's timeline where the same chunk in process
spans 75-78, with the same kernels for the same time (H200, 2026-12-04: `bench/results/...-served-steps-profile.txt`).
If the host enqueues a Gated DeltaNet layer no faster than the device runs it, the device waits through those layers
even when the whole step's launches take less time than its kernels; the gaps say where. Under ``torch.profiler``
the host launches more slowly than unprofiled, so the idle time is an upper bound; comparing two profiled runs (served
and in process) is what it is for.
"""

from __future__ import annotations

from typing import Iterable, Optional

TOP_GAPS = 5


def device_intervals(events) -> list[tuple[float, float, str]]:
    """``(start_us, end_us, name)`` of every device-side event of a ``torch.profiler`` run (``prof.events()``:
    kernels, copies and sets on the GPU's timeline); empty for a CPU-only profile."""
    from torch.autograd import DeviceType

    out = []
    for e in events:
        if getattr(e, "device_type", None) == DeviceType.CUDA and e.time_range.end > e.time_range.start:
            out.append((float(e.time_range.start), float(e.time_range.end), e.name))
    return out


def timeline(intervals: Iterable[tuple[float, float, str]], top: int = TOP_GAPS) -> Optional[dict]:
    """``{"span_ms", "busy_ms", "idle_ms", "num_gaps", "gaps"}`` over intervals in microseconds (overlaps, as from two
    streams, count once); ``gaps``: the ``top`` longest idle stretches, longest first, as ``(ms, work before, work
    after)``. None without intervals."""
    ordered = sorted(intervals)
    if not ordered:
        return None
    busy = 0.0
    gaps = []
    run_start, run_end, last_name = ordered[0]
    for start, end, name in ordered[1:]:
        if start > run_end:  # the device went idle: close the busy run
            busy += run_end - run_start
            gaps.append(((start - run_end) / 1e3, last_name, name))
            run_start, run_end = start, end
        else:
            run_end = max(run_end, end)
        if end >= run_end:
            last_name = name
    busy += run_end - run_start
    span = run_end - ordered[0][0]
    gaps.sort(key=lambda g: -g[0])
    return {
        "span_ms": span / 1e3,
        "busy_ms": busy / 1e3,
        "idle_ms": (span - busy) / 1e3,
        "num_gaps": len(gaps),
        "gaps": gaps[:top],
    }


def format_timeline(t: Optional[dict]) -> str:
    """One line (two with gaps) for a profile block; empty without device events."""
    if t is None:
        return ""
    line = (
        f"  device timeline: span {t['span_ms']:.1f} ms, busy {t['busy_ms']:.1f} ms (union), "
        f"idle {t['idle_ms']:.1f} ms in {t['num_gaps']} gaps"
    )
    if t["gaps"]:
        longest = "; ".join(f"{ms:.2f} ms after {a[:40]} before {b[:40]}" for ms, a, b in t["gaps"])
        line += f"\n    longest gaps: {longest}"
    return line
