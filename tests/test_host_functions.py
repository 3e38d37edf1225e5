"""Host functions on a CUDA stream (``engine/host_functions.py``): ordered between the kernels around them, eagerly
and as host nodes of a replayed CUDA graph (what the hybrid MoE backend's CPU experts need)."""

import time

import pytest
import torch

from freetoken.engine.host_functions import PythonHostFunction, launch_host_function, native_no_op_address


def test_a_null_function_is_refused_before_cuda_is_touched():
    with pytest.raises(ValueError, match="function address"):
        launch_host_function(0)


def test_an_exception_in_a_python_host_function_is_kept_not_raised_on_the_driver_thread():
    def boom():
        raise KeyError("x")

    fn = PythonHostFunction(boom)
    fn._call(None)  # what the driver calls
    assert isinstance(fn.error, KeyError)
    assert fn.address and native_no_op_address()


def _round_trip(x_dev, h_in, h_out, y_dev, fn):
    """x -> pinned h_in (copy), fn on the host (h_out = h_in * 3 + 1), pinned h_out -> y (copy): one stream."""
    h_in.copy_(x_dev * 2, non_blocking=True)
    fn.launch()
    y_dev.copy_(h_out, non_blocking=True)


def _buffers(n=1024):
    x = torch.zeros(n, device="cuda")
    h_in = torch.empty(n, pin_memory=True)
    h_out = torch.empty(n, pin_memory=True)
    y = torch.zeros(n, device="cuda")
    fn = PythonHostFunction(lambda: torch.mul(h_in, 3, out=h_out).add_(1))
    return x, h_in, h_out, y, fn


@pytest.mark.gpu
def test_a_host_function_runs_between_the_copies_around_it():
    x, h_in, h_out, y, fn = _buffers()
    for i in range(3):
        x.fill_(float(i))
        _round_trip(x, h_in, h_out, y, fn)
        torch.cuda.synchronize()
        assert fn.error is None
        torch.testing.assert_close(y, torch.full_like(y, 6.0 * i + 1))


@pytest.mark.gpu
def test_a_captured_host_function_runs_on_every_replay():
    x, h_in, h_out, y, fn = _buffers()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        _round_trip(x, h_in, h_out, y, fn)  # warm-up outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        _round_trip(x, h_in, h_out, y, fn)
    for i in (4, 7, 11):
        x.fill_(float(i))
        graph.replay()
        torch.cuda.synchronize()
        assert fn.error is None
        torch.testing.assert_close(y, torch.full_like(y, 6.0 * i + 1))


@pytest.mark.gpu
def test_host_node_cost_in_a_graph_is_printed(capsys):
    """Not an assertion on time: prints what a native host node costs in a replayed graph (40, as a decode step of
    Qwen3.6 would have one a MoE layer), against the same graph without them."""
    noop = native_no_op_address()
    a = torch.zeros(4096, device="cuda")

    def step(with_nodes: bool):
        for _ in range(40):
            a.add_(1)
            if with_nodes:
                launch_host_function(noop, 0)

    times = {}
    for with_nodes in (False, True):
        step(with_nodes)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            step(with_nodes)
        graph.replay()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(50):
            graph.replay()
        torch.cuda.synchronize()
        times[with_nodes] = (time.perf_counter() - t0) / 50
    per_node_us = (times[True] - times[False]) / 40 * 1e6
    with capsys.disabled():
        print(f"\n40 kernels: {times[False] * 1e6:.1f} us a replay; with 40 host nodes: {times[True] * 1e6:.1f} us "
              f"({per_node_us:.1f} us a node)")  # fmt: skip
