"""A step's small integer arrays to the device in one copy, without stopping the host.

``tensor.to("cuda")`` from ordinary (pageable) host memory is a blocking copy: PyTorch waits for the stream, so the
host stops until the device has finished everything queued before it (the previous step, under overlap
scheduling) and then launches the next kernels while the device idles. An eager step's ``ForwardBatch`` took eleven
such copies (token ids, positions, lengths, rows, slots, the page-table entries): eleven stops a step, the longest
gaps on the device's timeline at the start of a cached agent turn. Here they are packed into one pinned int64 buffer
and sent with one non-blocking copy; PyTorch's pinned-memory allocator keeps the buffer until the copy is done.
"""

from __future__ import annotations

import torch


def upload_int_arrays(arrays: list[torch.Tensor], device: torch.device) -> list[torch.Tensor]:
    """CPU integer tensors as int64 tensors on ``device`` (same shapes, views of one buffer): on CUDA one
    non-blocking copy from pinned memory; elsewhere int64 copies."""
    if device.type != "cuda":
        return [a.to(device, torch.int64, copy=True) for a in arrays]
    sizes = [a.numel() for a in arrays]
    host = torch.empty(sum(sizes), dtype=torch.int64, pin_memory=True)
    if host.numel():
        torch.cat([a.reshape(-1).to(torch.int64) for a in arrays], out=host)
    flat = host.to(device, non_blocking=True)
    return [part.view(a.shape) for part, a in zip(flat.split(sizes), arrays)]
