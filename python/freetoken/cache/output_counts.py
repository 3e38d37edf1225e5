"""How often each sequence has generated each token: what presence and frequency penalties read.

One row per page-table row (plus the scratch row): ``counts[row, token]``, int32 on the device. A request's row is
cleared on its first step (the plan sends its page table from position 0 then) and gains one count per sampled
token, so the counts cover exactly the tokens this request generated, whatever the prefix cache reused. Updates are
fixed-shape device work (an indexed accumulate), so they run after a decode CUDA graph without a host sync.
"""

from __future__ import annotations

import torch


class OutputTokenCounts:
    def __init__(self, num_rows: int, vocab_size: int, device: torch.device):
        self.counts = torch.zeros(num_rows, vocab_size, dtype=torch.int32, device=device)

    @property
    def nbytes(self) -> int:
        return self.counts.numel() * self.counts.element_size()

    def reset(self, rows: torch.Tensor) -> None:
        """Rows whose request starts this step."""
        if rows.numel():
            self.counts[rows.to(self.counts.device, non_blocking=True)] = 0

    def add(self, rows: torch.Tensor, tokens: torch.Tensor) -> None:
        """One more of ``tokens[i]`` in row ``rows[i]`` (rows distinct within a step)."""
        dev = self.counts.device
        self.counts.index_put_(
            (rows.to(dev, non_blocking=True), tokens.to(dev)),
            torch.ones(rows.numel(), dtype=torch.int32, device=dev),
            accumulate=True,
        )

    def rows(self, rows: torch.Tensor) -> torch.Tensor:
        return self.counts[rows.to(self.counts.device, non_blocking=True)]
