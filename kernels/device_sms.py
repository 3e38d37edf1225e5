"""How many SMs the launch heuristics scale by.

The kernels' grid targets ("about four programs per SM", "a wave of the whole GPU") were tuned on the H200, 132 SMs.
``scaled`` turns such a target into the current CUDA device's (an A100 has 108 SMs, an L40S 142, an RTX 4090 128),
so a smaller GPU does not get a grid sized for a larger one. Without CUDA (the CPU, the Triton interpreter) the
H200's count stands, so the CPU tests pick the configurations the H200 runs.
"""

from __future__ import annotations

import functools

import torch

H200_SMS = 132


@functools.lru_cache(maxsize=None)
def _sms_of(index: int) -> int:
    return int(torch.cuda.get_device_properties(index).multi_processor_count)


def sm_count(device: torch.device | None = None) -> int:
    """SMs of ``device`` (default: the current CUDA device), or the H200's 132 off CUDA."""
    if device is not None and device.type != "cuda":
        return H200_SMS
    if not torch.cuda.is_available():
        return H200_SMS
    return _sms_of(torch.cuda.current_device() if device is None or device.index is None else device.index)


def scaled(h200_value: int, device: torch.device | None = None) -> int:
    """A launch target tuned on the H200, for ``device``: ``h200_value * SMs / 132`` (at least 1)."""
    return max(1, h200_value * sm_count(device) // H200_SMS)
