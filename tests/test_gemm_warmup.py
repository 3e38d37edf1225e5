"""engine/gemm_warmup.py: the GEMMs a stretch of steps makes, recorded once per shape, and replayed at every row
step (cuBLAS's first call at each shape paid at start-up). Its device-side effect is for bench/gemm_first_call.py
on the GPU to measure; here the recording and the replay are checked on the CPU."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from freetoken.engine.gemm_warmup import MIN_ROWS, GemmRecorder, warm_gemms, warmup_rows, warmup_rows_step


class GemmCalls(TorchDispatchMode):
    """(operator, rows of its activation, weight data pointer) of every GEMM-like call (``test_gemm_rows`` too)."""

    def __init__(self):
        super().__init__()
        self.seen = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name in ("linear", "mm", "addmm"):
            x, w = (args[1], args[2]) if name == "addmm" else (args[0], args[1])
            self.seen.append((name, x.shape[0], w.data_ptr()))
        return func(*args, **(kwargs or {}))


def test_rows_are_the_multiples_of_the_step_from_the_first_prefill_sized_one():
    assert warmup_rows(300, 64) == [64, 128, 192, 256]
    assert warmup_rows(200, 48) == [96, 144, 192]  # the first multiple at or above MIN_ROWS
    assert warmup_rows(8192, 64)[-1] == 8192 and len(warmup_rows(8192, 64)) == 128
    assert warmup_rows(8192, 0) == [] and warmup_rows(32, 64) == []


def test_the_row_step_comes_from_the_environment(monkeypatch):
    monkeypatch.delenv("FREETOKEN_GEMM_WARMUP_ROWS", raising=False)
    assert warmup_rows_step() == 64
    monkeypatch.setenv("FREETOKEN_GEMM_WARMUP_ROWS", "0")
    assert warmup_rows_step() == 0
    monkeypatch.setenv("FREETOKEN_GEMM_WARMUP_ROWS", "many")
    with pytest.raises(ValueError, match="FREETOKEN_GEMM_WARMUP_ROWS"):
        warmup_rows_step()
    with pytest.raises(ValueError, match="expected 0"):
        warmup_rows_step(-64)


def test_records_each_shape_once_and_leaves_decode_sized_calls_out():
    torch.manual_seed(0)
    plain, biased = torch.nn.Linear(32, 48, bias=False), torch.nn.Linear(32, 16)
    other_w = torch.randn(24, 32)
    # one shape in several layers, their weights equally aligned (5,120 bytes apart: what cuBLAS sees is the same)
    stacked = torch.randn(3, 40, 32)
    layers = [torch.nn.Linear(32, 40, bias=False) for _ in range(3)]
    for layer, w in zip(layers, stacked):
        layer.weight = torch.nn.Parameter(w, requires_grad=False)
    with torch.inference_mode(), GemmRecorder() as rec:
        for rows in (100, 130, 8, MIN_ROWS - 1):  # two prompt lengths, then decode-sized steps
            x = torch.randn(rows, 32)
            plain(x), biased(x), torch.mm(x, other_w.t())
            for layer in layers:
                layer(x)
        torch.mm(torch.randn(32, 100).t(), other_w.t())  # a transposed activation: not what the model passes
    shapes = sorted(tuple(c.args[1].shape) for c in rec.calls.values())  # linear and mm: (activation, weight, ..)
    assert shapes == sorted([(48, 32), (16, 32), (32, 24), (40, 32)])
    assert all(c.args[c.act_index] is None and c.k == 32 for c in rec.calls.values())  # no activation kept


def test_replays_every_recorded_gemm_at_every_row_count():
    lin = torch.nn.Linear(32, 48)
    w2 = torch.randn(16, 32)
    with torch.inference_mode(), GemmRecorder() as rec:
        x = torch.randn(70, 32)
        lin(x), torch.mm(x, w2.t())
    with GemmCalls() as counter:
        made = warm_gemms(rec.calls.values(), [64, 128])
    assert made == 4
    seen = sorted((rows, ptr) for _, rows, ptr in counter.seen)
    want = sorted((rows, ptr) for rows in (64, 128) for ptr in (lin.weight.data_ptr(), w2.data_ptr()))
    assert seen == want
