"""Opt-in profile of eager steps inside a running server: where a served prefill step's time goes, which an
in-process benchmark (``bench/profile_prefill.py``) cannot show when the server's step is slower than the same
chunk run alone (the plan the scheduler builds, snapshot captures and restores, the KV slots' layout).

    FREETOKEN_PROFILE_STEPS=1000 FREETOKEN_PROFILE_OUT=/tmp/steps.txt ft serve ...

profiles every eager step of at least ``FREETOKEN_PROFILE_STEPS`` new tokens (``MIN-MAX``: between the two, so that a
session's long uncached chunks are left out) under ``torch.profiler`` and appends
one block per step to ``FREETOKEN_PROFILE_OUT`` (default ``freetoken_steps_profile.txt``): the step's wall time
(profiler overhead included), the device's busy time, the top ops by device time and by self CPU time, and the
device's timeline over the step (``device_timeline.py``: span, busy, idle and the longest gaps). With
``FREETOKEN_PROFILE_MODE=host`` the step runs under cProfile instead: the top Python functions by own time, which
say where a host-bound served step's launch time goes (the wait for the device shows as the step's final
``tolist``). Off (no cost beyond one comparison a step) when the variable is unset. Decode graph replays are never
profiled.
"""

from __future__ import annotations

import os
import time
from typing import Callable, Optional

import torch

from .device_timeline import device_intervals, format_timeline, timeline
from .gc_control import GcClock

TOP = 14


class StepProfiler:
    def __init__(self, device: torch.device, env: Optional[dict] = None):
        env = os.environ if env is None else env
        self.min_tokens, self.max_tokens = parse_token_range(env.get("FREETOKEN_PROFILE_STEPS", ""))
        self.out = env.get("FREETOKEN_PROFILE_OUT", "freetoken_steps_profile.txt")
        self.mode = env.get("FREETOKEN_PROFILE_MODE", "device")
        if self.mode not in ("device", "host"):
            raise ValueError(f"FREETOKEN_PROFILE_MODE={self.mode!r}: expected device or host")
        self.device = device
        self.profiled = 0

    def wrap(self, step_id: int, num_tokens: int, run: Callable):
        """``run`` itself, or ``run`` under the profiler when this step qualifies."""
        if self.min_tokens is None or not self.min_tokens <= num_tokens <= self.max_tokens:
            return run
        return lambda: self._profiled(step_id, num_tokens, run)

    def _profiled(self, step_id: int, num_tokens: int, run: Callable):
        if self.mode == "host":
            return self._host_profiled(step_id, num_tokens, run)
        from torch.profiler import ProfilerActivity, profile

        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.device.type == "cuda" else [])
        clock = GcClock().start()
        t0 = time.perf_counter()
        with profile(activities=acts) as prof:
            out = run()  # ends with the sampled tokens on the host: the device work is inside
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
        wall_ms = (time.perf_counter() - t0) * 1e3
        clock.stop()
        self.profiled += 1
        with open(self.out, "a") as f:
            block = format_profile(prof.key_averages(), step_id, num_tokens, wall_ms, clock.summary())
            try:  # a diagnostic: never the step's failure
                gaps = format_timeline(timeline(device_intervals(prof.events())))
            except Exception as e:  # noqa: BLE001
                gaps = f"  device timeline unavailable: {type(e).__name__}: {e}"
            f.write(block + ("\n" + gaps if gaps else "") + "\n")
        return out

    def _host_profiled(self, step_id: int, num_tokens: int, run: Callable):
        box = []
        t0 = time.perf_counter()
        rows = host_profile(lambda: box.append(run()), lambda: None, TOP * 2)
        wall_ms = (time.perf_counter() - t0) * 1e3
        self.profiled += 1
        with open(self.out, "a") as f:
            f.write(format_host_profile(rows, step_id, num_tokens, wall_ms) + "\n")
        return box[0]


def parse_token_range(raw: str) -> tuple[Optional[int], Optional[int]]:
    """``""`` -> off (None, None); ``"N"`` -> (N, inf); ``"N-M"`` -> (N, M). Anything else is refused naming the
    variable, at start-up."""
    raw = raw.strip()
    if not raw:
        return None, None
    lo, sep, hi = raw.partition("-")
    try:
        bounds = int(lo), (int(hi) if sep else 1 << 62)
    except ValueError:
        raise ValueError(f"FREETOKEN_PROFILE_STEPS={raw!r}: expected a token count N or a range N-M") from None
    return bounds


def top_ops(averages, n_steps: int, top: int) -> tuple[list[dict], list[dict], float]:
    """A profile's ``key_averages()`` per step: the ``top`` ops by self CPU time and by device time (dicts of op,
    calls, self CPU ms, self device ms) and the device's busy ms. Shared with ``bench/profile_decode.py``."""
    dev_attr = "self_device_time_total" if hasattr(averages[0], "self_device_time_total") else "self_cuda_time_total"

    def rows(attr):
        ranked = sorted(averages, key=lambda e: getattr(e, attr, 0), reverse=True)[:top]
        return [
            {
                "op": e.key,
                "calls_per_step": e.count / n_steps,
                "self_cpu_ms_per_step": e.self_cpu_time_total / 1e3 / n_steps,
                "self_device_ms_per_step": getattr(e, dev_attr, 0) / 1e3 / n_steps,
            }
            for e in ranked
        ]

    device_ms = sum(getattr(e, dev_attr, 0) for e in averages) / 1e3 / n_steps
    return rows("self_cpu_time_total"), rows(dev_attr), device_ms


def format_profile(averages, step_id: int, num_tokens: int, wall_ms: float, gc_summary: str = "") -> str:
    """One step's block: header line (with the garbage collector's share), then the top ops by device time and by
    self CPU time (ms)."""
    by_cpu, by_dev, busy_ms = top_ops(averages, 1, TOP)
    gc_part = f", {gc_summary}" if gc_summary else ""
    lines = [
        f"step {step_id}: {num_tokens} new tokens, wall {wall_ms:.1f} ms (profiled), device busy {busy_ms:.1f} ms{gc_part}"
    ]
    for title, table in (("device", by_dev), ("self CPU", by_cpu)):
        lines.append(f"  top by {title} time:{'calls':>43}{'cpu ms':>10}{'dev ms':>10}")
        for r in table:
            lines.append(
                f"    {r['op'][:56]:<56}{r['calls_per_step']:>8.0f}{r['self_cpu_ms_per_step']:>10.3f}"
                f"{r['self_device_ms_per_step']:>10.3f}"
            )
    return "\n".join(lines)


def host_profile(step: Callable, sync: Callable, top: int, repeats: int = 1) -> list[dict]:
    """``step()`` run ``repeats`` times under cProfile: the ``top`` functions by own (exclusive) host time, per run,
    with their calls per run: where a host-bound step's launch-side time goes (Python of ours, fla's, Triton's
    launcher, torch's wrappers). A function is named by its file's last two path parts, line and name."""
    import cProfile
    import pstats

    prof = cProfile.Profile()
    sync()
    prof.enable()
    for _ in range(repeats):
        step()
    prof.disable()
    sync()
    stats = pstats.Stats(prof).stats  # {(file, line, name): (prim calls, calls, own s, cumulative s, callers)}
    rows = sorted(stats.items(), key=lambda kv: -kv[1][2])[:top]

    def named(f: str, line: int, name: str) -> str:
        return f"{'/'.join(f.split('/')[-2:])}:{line} {name}"

    def top_callers(callers: dict) -> list[str]:  # a builtin is only placed by who calls it
        ranked = sorted(callers.items(), key=lambda kv: -kv[1][2])[:3]
        return [f"{named(*k)} ({v[2] * 1e3 / repeats:.2f} ms)" for k, v in ranked]

    return [
        {
            "function": named(f, line, name),
            "calls": c / repeats,
            "own_ms": own * 1e3 / repeats,
            "cum_ms": cum * 1e3 / repeats,
            "callers": top_callers(callers) if f == "~" else [],
        }
        for (f, line, name), (_, c, own, cum, callers) in rows
    ]


def format_host_profile(rows: list[dict], step_id: int, num_tokens: int, wall_ms: float) -> str:
    """One step's block for ``FREETOKEN_PROFILE_MODE=host``: header line, then the functions by own time."""
    lines = [f"step {step_id}: {num_tokens} new tokens, wall {wall_ms:.1f} ms (under cProfile)"]
    lines.append(f"  top by own host time:{'own ms':>12}{'cum ms':>10}{'calls':>8}")
    for r in rows:
        lines.append(f"    {r['function'][:64]:<64}{r['own_ms']:>9.2f}{r['cum_ms']:>10.2f}{r['calls']:>8.0f}")
        lines.extend(f"        from {c}" for c in r.get("callers", []))
    return "\n".join(lines)
