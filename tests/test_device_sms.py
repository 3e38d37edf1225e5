"""Launch targets tuned on the H200 scale with the device's SM count (``kernels/device_sms.py``)."""

import pytest
import torch

pytest.importorskip("triton")


def test_off_cuda_the_h200_count_stands():
    from freetoken.kernels.device_sms import H200_SMS, scaled, sm_count

    assert sm_count(torch.device("cpu")) == H200_SMS == 132
    assert scaled(528, torch.device("cpu")) == 528


def _gemv_programs(N, K):
    from freetoken.kernels import nvfp4_linear

    _, bn, _, split = nvfp4_linear._gemv_config(1, N, K)
    return -(-N // bn) * split


def test_a_smaller_gpu_gets_a_smaller_grid(monkeypatch):
    """The shared expert's gate (512 x 2048) at M=1: the GEMV splits K until about four programs an SM; on a GPU of
    32 SMs it stops at a quarter of the H200's grid, and the few-rows rule of ``pick_path`` uses the same count."""
    from freetoken.kernels import device_sms, nvfp4_linear

    h200 = _gemv_programs(512, 2048)
    assert h200 >= 3 * 132  # "about": K splits and row blocks come in powers of two
    monkeypatch.setattr(device_sms, "sm_count", lambda device=None: 32)
    monkeypatch.setattr(nvfp4_linear, "sm_count", lambda device=None: 32)
    small = _gemv_programs(512, 2048)
    assert 4 * 32 <= small < h200
    # few rows: the shared expert's down (2,048 rows) gives 64 tensor-core programs at M=4, fewer than the H200's
    # 132 SMs (GEMV) but not fewer than 32 (tensor cores)
    assert nvfp4_linear.pick_path(4, 2048) == "dot"
    monkeypatch.setattr(nvfp4_linear, "sm_count", lambda device=None: 132)
    assert nvfp4_linear.pick_path(4, 2048) == "gemv"
