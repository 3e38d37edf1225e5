"""Faults injected on purpose, for tests only: ``FREETOKEN_FAULT=<kind>@<step>[,<kind>@<step>...]``.

Kinds: ``oom`` (a CUDA-style out-of-memory error inside the step), ``hang`` (the step never returns, as a
kernel spinning on the wrong stream would), ``fatal`` (an unexpected exception), ``kill`` (the process dies
with SIGKILL mid-step), ``invalid`` (the plan is rejected as invalid). ``<step>`` counts executed steps from
1; ``oom@3+`` fires on step 3 and every step after it. The worker calls ``maybe_inject(step_index)`` at the
start of every step; without the variable it costs one dict lookup.
"""

from __future__ import annotations

import os
import signal
import time

import torch

from .errors import InvalidPlan

_KINDS = ("oom", "hang", "fatal", "kill", "invalid")


def parse_faults(spec: str | None) -> list[tuple[str, int, bool]]:
    """``"oom@3,hang@5+"`` -> ``[("oom", 3, False), ("hang", 5, True)]``."""
    faults = []
    for item in filter(None, (s.strip() for s in (spec or "").split(","))):
        kind, _, step = item.partition("@")
        repeat = step.endswith("+")
        step = step.rstrip("+")
        if kind not in _KINDS or not step.isdigit():
            raise ValueError(f"FREETOKEN_FAULT entry {item!r}: expected <{'|'.join(_KINDS)}>@<step>[+]")
        faults.append((kind, int(step), repeat))
    return faults


class FaultInjector:
    def __init__(self, spec: str | None = None):
        self.faults = parse_faults(os.environ.get("FREETOKEN_FAULT") if spec is None else spec)

    def maybe_inject(self, step_index: int) -> None:
        for kind, step, repeat in self.faults:
            if step_index == step or (repeat and step_index > step):
                _inject(kind, step_index)


def _inject(kind: str, step_index: int) -> None:
    if kind == "oom":
        raise torch.OutOfMemoryError(f"injected out-of-memory at step {step_index} (FREETOKEN_FAULT)")
    if kind == "invalid":
        raise InvalidPlan(f"injected invalid plan at step {step_index} (FREETOKEN_FAULT)")
    if kind == "fatal":
        raise RuntimeError(f"injected fatal error at step {step_index} (FREETOKEN_FAULT)")
    if kind == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    if kind == "hang":
        while True:  # never returns; the engine's watchdog must notice
            time.sleep(3600)
