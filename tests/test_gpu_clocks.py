"""bench/gpu_clocks.py's summary of nvidia-smi samples over a window (no GPU needed: samples are fed by hand)."""

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench"))
from gpu_clocks import ClockSampler  # noqa: E402


def test_window_summarizes_the_samples_inside_it():
    c = ClockSampler()
    # (time, SM MHz, memory MHz, power W, temperature C, throttle reasons)
    c.samples = [
        (10.0, 1980.0, 3201.0, 300.0, 40.0, "0x0000000000000000"),
        (10.5, 1755.0, 3201.0, 690.0, 55.0, "0x0000000000000004"),
        (11.0, 1845.0, 3201.0, 650.0, 57.0, "0x0000000000000000"),
        (12.0, 345.0, 3201.0, 80.0, 45.0, "0x0000000000000001"),
    ]
    w = c.window(10.2, 11.2)
    assert w["samples"] == 2
    assert (w["sm_mhz_min"], w["sm_mhz_mean"], w["power_w_max"], w["temp_c_max"]) == (1755.0, 1800.0, 690.0, 57.0)
    assert w["reasons"] == "0x4"
    # a window shorter than the sampling interval takes the nearest sample
    near = c.window(11.9, 11.95)
    assert (near["samples"], near["sm_mhz_min"], near["reasons"]) == (1, 345.0, "0x1")


def test_no_samples_say_so():
    assert ClockSampler().window(0.0, 1.0) == {"samples": 0}
