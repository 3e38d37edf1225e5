"""What the GPU's clocks and power did while a benchmark timed something: ``nvidia-smi`` sampled in the background
(every ``interval_ms``), each sample stamped with this host's clock when it arrives, and summarized over a window.

Why: the same prefill step on the H200 has measured 80 ms and 109 ms minutes apart (2026-12-03 night, identical
inputs), and an agent turn's device time swung by 40 % between runs; a figure only means something beside the
clocks it ran at. Where ``nvidia-smi`` is missing (CPU runs) the sampler records nothing and ``window`` says so.

    with ClockSampler() as clocks:
        t0 = time.time(); ...; t1 = time.time()
        print(clocks.window(t0, t1))   # {'samples': 5, 'sm_mhz_min': 1755, 'sm_mhz_mean': 1890.2, 'power_w_max': 688.1, ...}
"""

from __future__ import annotations

import shutil
import subprocess
import threading
import time

_FIELDS = "clocks.sm,clocks.mem,power.draw,temperature.gpu,clocks_event_reasons.active"


class ClockSampler:
    def __init__(self, interval_ms: int = 20, gpu: int = 0):
        self.interval_ms = interval_ms
        self.samples: list[tuple[float, float, float, float, float, str]] = []  # (t, sm, mem, power, temp, reasons)
        self._cmd = [
            "nvidia-smi",
            f"--id={gpu}",
            f"--query-gpu={_FIELDS}",
            "--format=csv,noheader,nounits",
            f"-lms={interval_ms}",
        ]
        self._proc = None
        self._thread = None

    def __enter__(self) -> "ClockSampler":
        if shutil.which("nvidia-smi") is None or self.interval_ms <= 0:  # interval 0: off (A/B of the sampler itself)
            return self
        self._proc = subprocess.Popen(self._cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()
        return self

    def _read(self) -> None:
        for line in self._proc.stdout:
            parts = [p.strip() for p in line.split(",")]
            if len(parts) != 5:
                continue
            try:
                sm, mem, power, temp = (float(p) for p in parts[:4])
            except ValueError:  # "[N/A]" on a GPU that does not report a field
                continue
            self.samples.append((time.time(), sm, mem, power, temp, parts[4]))

    def __exit__(self, *exc) -> None:
        if self._proc is not None:
            self._proc.terminate()
            self._proc.wait(timeout=5)

    def window(self, t0: float, t1: float) -> dict:
        """Samples that arrived in ``[t0, t1]`` (host ``time.time()``), widened to the nearest one on each side when
        the window is shorter than the sampling interval: min/mean SM clock, max power and temperature, and the
        throttle reasons seen (``clocks_event_reasons.active`` bit masks, OR-ed; 0x0 = none, 0x1 = idle)."""
        inside = [s for s in self.samples if t0 <= s[0] <= t1]
        if not inside and self.samples:
            inside = [min(self.samples, key=lambda s: abs(s[0] - (t0 + t1) / 2))]
        if not inside:
            return {"samples": 0}
        reasons = 0
        for s in inside:
            try:
                reasons |= int(s[5], 16)
            except ValueError:
                pass
        return {
            "samples": len(inside),
            "sm_mhz_min": min(s[1] for s in inside),
            "sm_mhz_mean": round(sum(s[1] for s in inside) / len(inside), 1),
            "mem_mhz_min": min(s[2] for s in inside),
            "power_w_max": max(s[3] for s in inside),
            "temp_c_max": max(s[4] for s in inside),
            "reasons": hex(reasons),
        }
