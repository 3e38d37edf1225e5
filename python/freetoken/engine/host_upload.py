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

ALIGN = 2  # int64 elements: every array starts on a 16-byte boundary of the buffer
_PAD = torch.zeros(ALIGN, dtype=torch.int64)


def upload_int_arrays(arrays: list[torch.Tensor], device: torch.device) -> list[torch.Tensor]:
    """CPU integer tensors as int64 tensors on ``device`` (same shapes, views of one buffer): on CUDA one
    non-blocking copy from pinned memory; elsewhere one copy (the same layout, so the CPU tests see it).

    Each array starts 16 bytes into the buffer or a multiple of that: Triton specializes a kernel on whether each
    pointer argument is divisible by 16, so packed back to back an array's alignment followed the lengths before
    it, and a step of an even number of sequences (32 streams' prompts) compiled the extend kernel anew on the
    request path (0.1-0.8 s, 2026-12-06) for the one ``rows`` pointer the warm-up's odd-sized steps never gave."""
    sizes = [a.numel() for a in arrays]
    padded = [-(-n // ALIGN) * ALIGN for n in sizes]
    pieces = []
    for a, n, m in zip(arrays, sizes, padded):
        pieces.append(a.reshape(-1).to(torch.int64))
        if m > n:
            pieces.append(_PAD[: m - n])
    cuda = device.type == "cuda"
    host = torch.empty(sum(padded), dtype=torch.int64, pin_memory=cuda)
    if host.numel():
        torch.cat(pieces, out=host)
    flat = host.to(device, non_blocking=True) if cuda else host
    return [part[:n].view(a.shape) for part, n, a in zip(flat.split(padded), sizes, arrays)]
