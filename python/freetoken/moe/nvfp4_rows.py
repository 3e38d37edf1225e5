"""``Nvfp4Rows``: the NVFP4 expert bank (``layers/nvfp4_experts.py``) stored as two rows of 32-bit words per expert,
so that expert offload moves NVFP4 experts exactly as it moves BF16 ones.

The offload machinery (pinned host banks, the device slot cache's gather kernel, the prefill layer stream) copies
one ``gate_up [E, ...]`` and one ``down [E, ...]`` tensor per layer, one expert per index of the leading dim. The
NVFP4 bank has six tensors of three dtypes, so here each projection's three go into one row of words::

    gate_up row: codes uint8 [2I, H/2] | block scales e4m3 [2I, H/16] | per-row globals fp32 [2I]
    down row:    codes uint8 [H, I/2]  | block scales e4m3 [H, I/16]  | per-row globals fp32 [H]

each segment starting on a 16-byte boundary (wide loads; the fp32 view needs 4). ``views`` gives the six bank
tensors back as strided views (same shapes and dtypes as ``Nvfp4Experts.bank()``, stride(0) the row), which the
NVFP4 kernels and the torch reference take as they are: a host bank, a slot pool or a stream buffer of these rows
runs through the same code with expert or slot ids. Qwen3.6-35B-A3B: 1,781,760 bytes per expert (no padding),
against 6 MiB in BF16.
"""

from __future__ import annotations

import torch

from ..quant import nvfp4

_ALIGN = 16


def _up(n: int) -> int:
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN


def _segments(rows: int, k: int) -> list[tuple[int, int, torch.dtype, tuple]]:
    """``(byte offset, bytes, dtype, shape)`` of codes, block scales and globals of one ``[rows, k]`` projection."""
    parts = [
        (rows * k // 2, torch.uint8, (rows, k // 2)),
        (rows * k // nvfp4.BLOCK, torch.float8_e4m3fn, (rows, k // nvfp4.BLOCK)),
        (rows * 4, torch.float32, (rows,)),
    ]
    out, offset = [], 0
    for nbytes, dtype, shape in parts:
        out.append((offset, nbytes, dtype, shape))
        offset = _up(offset + nbytes)
    return out


def _row_bytes(segments) -> int:
    offset, nbytes, _, _ = segments[-1]
    return _up(offset + nbytes)


class Nvfp4Rows:
    def __init__(self, hidden_size: int, intermediate_size: int):
        H, I = hidden_size, intermediate_size
        if H % nvfp4.BLOCK or I % nvfp4.BLOCK:
            raise ValueError(f"NVFP4 experts need hidden and intermediate sizes divisible by {nvfp4.BLOCK}")
        self.gate_up_segments = _segments(2 * I, H)
        self.down_segments = _segments(H, I)
        self.gate_up_words = _row_bytes(self.gate_up_segments) // 4
        self.down_words = _row_bytes(self.down_segments) // 4

    @property
    def expert_bytes(self) -> int:
        """Bytes of one expert in host memory, a cache slot or a stream buffer."""
        return 4 * (self.gate_up_words + self.down_words)

    def allocate(self, num: int, device=None) -> tuple[torch.Tensor, torch.Tensor]:
        """``(gate_up [num, W1], down [num, W2])`` int32 rows, zeroed (the padding stays defined)."""
        kw = dict(dtype=torch.int32, device=device)
        return torch.zeros(num, self.gate_up_words, **kw), torch.zeros(num, self.down_words, **kw)

    def views(self, gate_up: torch.Tensor, down: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """The six bank tensors (``Nvfp4Experts.bank()`` order) viewing ``gate_up [N, W1]`` and ``down [N, W2]``."""
        return (*_split(gate_up, self.gate_up_segments), *_split(down, self.down_segments))


def _split(words: torch.Tensor, segments) -> list[torch.Tensor]:
    assert words.dtype == torch.int32 and words.stride(-1) == 1, "rows of int32 words expected"
    raw = words.view(torch.uint8)  # [N, 4W]
    n = raw.shape[0]
    return [raw[:, off : off + nbytes].view(dtype).view(n, *shape) for off, nbytes, dtype, shape in segments]
