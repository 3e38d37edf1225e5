"""Python's cyclic garbage collector, kept out of the steps.

A full (generation-2) collection walks every tracked object of the process: torch, triton, fla, the model's modules
and the compiled kernels make that ~0.2-1 M objects, 50-100 ms of one core (67 ms for 235 k objects on the 2-core
CI machine), and it fires inside whatever step allocates the object that crosses its threshold. Everything alive
at the end of start-up lives as long as the server, so after start-up it is collected once and moved out of the
collector's sight (``gc.freeze``; vLLM does the same after its start-up): later collections only walk what the steps allocated.
``FREETOKEN_GC_FREEZE=0`` keeps the default behaviour. Measured on the H200 (2026-12-01, the agent session through
the offline engine): without the freeze the cached turns' prefill steps spent 0-1.8 ms in the collector, so it was
not what made those steps vary (122-199 ms); the freeze is insurance for a long-running server, not a speed-up.

``GcClock`` counts the collections and the time spent in them (``gc.callbacks``), so a step profile or a benchmark
can say how much of a step was the collector's.
"""

from __future__ import annotations

import gc
import time
from typing import Optional

from ..log import get_logger
from ..tuning_env import switch_from_env

logger = get_logger(__name__)


def freeze_startup_objects(env: Optional[dict] = None) -> int:
    """Collect, then freeze everything that survives; returns the number of objects frozen (0 when disabled)."""
    if not switch_from_env("FREETOKEN_GC_FREEZE", env):
        return 0
    t0 = time.perf_counter()
    gc.collect()
    gc.freeze()
    frozen = gc.get_freeze_count()
    logger.info(
        f"Froze {frozen} start-up objects out of the garbage collector ({(time.perf_counter() - t0) * 1e3:.0f} ms)"
    )
    return frozen


class GcClock:
    """Collections and milliseconds spent in them since ``start()``, per generation; ``stop()`` detaches it."""

    def __init__(self):
        self.ms = [0.0, 0.0, 0.0]
        self.count = [0, 0, 0]
        self._t0: Optional[float] = None

    def _callback(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._t0 = time.perf_counter()
        elif self._t0 is not None:
            gen = info.get("generation", 2)
            self.ms[gen] += (time.perf_counter() - self._t0) * 1e3
            self.count[gen] += 1
            self._t0 = None

    def start(self) -> "GcClock":
        gc.callbacks.append(self._callback)
        return self

    def stop(self) -> "GcClock":
        if self._callback in gc.callbacks:
            gc.callbacks.remove(self._callback)
        return self

    def total_ms(self) -> float:
        return sum(self.ms)

    def summary(self) -> str:
        return f"gc {self.total_ms():.1f} ms ({'/'.join(str(c) for c in self.count)} collections of gen 0/1/2)"
