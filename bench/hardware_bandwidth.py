"""The hardware limits every benchmark reports against, measured on the card it runs on: HBM bandwidth (a 1 GiB
device-to-device copy, bytes read + written, timed eagerly with events: a copy captured in a CUDA graph becomes a
memcpy node that runs well below what kernels reach) and pinned host-to-device PCIe bandwidth."""

from __future__ import annotations

import statistics


def median_device_ms(fn, reps: int) -> float:
    """Median device milliseconds of ``fn()`` between two CUDA events, ``reps`` runs after one warm-up."""
    import torch

    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def graph_device_ms(fn, reps: int) -> float:
    """Device milliseconds per ``fn()``: ``reps`` calls captured in one CUDA graph, replayed twice, the second timed.
    For kernels shorter than their host launch, where ``median_device_ms``'s events would time the launch (a
    ~20-70 us kernel read ~200 us that way)."""
    import torch

    fn()  # compile outside the capture
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(reps):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    graph.replay()
    b.record()
    b.synchronize()
    del graph
    return a.elapsed_time(b) / reps


def measure_bandwidth() -> dict:
    """``{"hbm_copy_gb_s", "pcie_h2d_gb_s"}``: device-to-device copy bandwidth (bytes read + written) and pinned
    host-to-device bandwidth, medians of 10; ``{}`` without CUDA."""
    import torch

    if not torch.cuda.is_available():
        return {}

    def timed(fn) -> float:
        return median_device_ms(fn, 10) / 1e3

    n = 1 << 30
    src, dst = torch.empty(n, dtype=torch.uint8, device="cuda"), torch.empty(n, dtype=torch.uint8, device="cuda")
    hbm = 2 * n / timed(lambda: dst.copy_(src))
    host = torch.empty(n, dtype=torch.uint8, pin_memory=True)
    pcie = n / timed(lambda: dst.copy_(host, non_blocking=True))
    src = dst = host = None  # frees the buffers (the timed closures hold the names, not the tensors)
    torch.cuda.empty_cache()
    return {"hbm_copy_gb_s": hbm / 1e9, "pcie_h2d_gb_s": pcie / 1e9}
