"""Paged KV pool and page table.

Rust owns the indices (which slot a token's K/V lives in); this pool owns the memory behind them. Slots are
token-granular: ``k[layer][slot]`` is one token's keys for every KV head. ``req_to_token[row, pos]`` maps a
request's position to its slot; the plan sends only new entries, placed by ``table_positions`` and scattered in by
``write_entries`` (on the device, from the step's one upload: ``engine/host_upload.py``).
"""

from __future__ import annotations

import torch


class KVCachePool:
    def __init__(
        self,
        num_layers: int,
        num_slots: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
        max_rows: int,
        max_context: int,
        v_head_dim: int | None = None,
    ):
        self.num_layers = num_layers
        self.num_slots = num_slots
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.v_head_dim = v_head_dim or head_dim
        self.dtype = dtype
        self.device = device
        self.k = [torch.zeros(num_slots, num_kv_heads, head_dim, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v = [
            torch.zeros(num_slots, num_kv_heads, self.v_head_dim, dtype=dtype, device=device) for _ in range(num_layers)
        ]
        # One spare row past the last request row, for warm-up and dry runs.
        self.req_to_token = torch.zeros(max_rows + 1, max_context, dtype=torch.int32, device=device)

    @staticmethod
    def bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype, v_head_dim=None) -> int:
        elt = torch.empty(0, dtype=dtype).element_size()
        return num_layers * num_kv_heads * (head_dim + (v_head_dim or head_dim)) * elt

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k + self.v)

    @staticmethod
    def table_positions(rows, table_from, indptr, slots) -> tuple[torch.Tensor, torch.Tensor]:
        """The (row, position) of each of the plan's new page-table entries (CPU int64)."""
        counts = indptr[1:] - indptr[:-1]
        row_of = torch.repeat_interleave(rows, counts)
        start_of = torch.repeat_interleave(table_from - indptr[:-1], counts)
        return row_of, torch.arange(slots.numel(), dtype=torch.int64) + start_of

    def write_entries(self, row_of: torch.Tensor, pos: torch.Tensor, slots: torch.Tensor) -> None:
        """``req_to_token[row_of, pos] = slots``, all on the pool's device (no host sync)."""
        if slots.numel():
            self.req_to_token[row_of, pos] = slots.to(torch.int32)
