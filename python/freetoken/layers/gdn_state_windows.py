"""A Gated DeltaNet prompt step's conv windows, gathered for all its sequences at once.

After a step, each sequence's conv slot holds the ``Kc-1`` conv inputs before its last new token's end (its next
step's conv reads them), and each snapshot's slot holds those before the snapshot's offset. A window reaches back
into the slot's previous window when the sequence brought fewer than ``Kc-1`` new tokens (a decode token riding
along in a prompt step), and is zeros there for a fresh sequence.

Taken one by one that is a few torch ops per sequence and per layer (a slice, a copy into the slot, the initial
state's gather): a step of 32 short prompts arriving together, or of one prompt beside 31 decode tokens, ran some
hundred small host-launched ops a GDN layer, for the 30 layers of Qwen3.6. Here the step computes, once on the
host, where each window column comes from (``window_host_arrays``, uploaded with the step's other arrays;
``window_index`` on the device), and each layer gathers all windows in a fixed handful of ops (``gather_windows``):
1 prompt + 31 decode tokens 100.7 -> 79.1 ms a step on an H100, 32 prompts 83.1 -> 78.5 (2026-12-06,
bench/batch_prefill_step.py). A step of one sequence keeps the one-by-one path (``GatedDeltaNet._extend``): a few
ops, and its CUDA-graph staging."""

from __future__ import annotations

from dataclasses import dataclass

import torch

OWN, PREV, ZERO = 0, 1, 2  # where a window column comes from: this step's inputs, the slot's window, zeros


@dataclass
class GdnWindowIndex:
    """Device tensors, ``[W, Kc-1]`` per window column unless noted. Windows ``[:num_seqs]`` are the sequences'
    own (written to their live slots), the rest the snapshots' (in ``ForwardBatch.snapshots`` order)."""

    own_rows: torch.Tensor  # int64: the qkv row (clamped into range where unused)
    prev_slot: torch.Tensor  # int64: the conv slot whose previous window it reads (where PREV)
    prev_col: torch.Tensor  # int64: the column of that window
    use_own: torch.Tensor  # bool
    use_prev: torch.Tensor  # bool (neither: zeros, a fresh sequence's window before its first token)
    dst: torch.Tensor  # [W] int64: the conv slot each window is written to
    num_seqs: int


def window_host_arrays(
    cu_seqlens: list[int],
    prefix_lens: list[int],
    state_slots: list[int],
    snapshots: list[tuple[int, int, int]],
    kc1: int,
) -> list[torch.Tensor]:
    """``[own_rows, prev_slot, prev_col, source, dst]`` (CPU int64; ``source`` OWN/PREV/ZERO) for a step's windows:
    each sequence's at the end of its new tokens, then each snapshot's ``(seq, upto, slot)`` at ``upto``."""
    n = len(prefix_lens)
    seq = list(range(n)) + [s for s, _, _ in snapshots]
    end = [cu_seqlens[b + 1] - cu_seqlens[b] for b in range(n)] + [u - prefix_lens[s] for s, u, _ in snapshots]
    seq_t = torch.tensor(seq, dtype=torch.int64)
    off = torch.tensor(end, dtype=torch.int64)[:, None] - kc1 + torch.arange(kc1)  # offset in the new tokens
    start = torch.tensor(cu_seqlens[:-1], dtype=torch.int64)[seq_t]
    total = max(cu_seqlens[-1], 1)
    own_rows = (start[:, None] + off).clamp(0, total - 1)
    has_prev = (torch.tensor(prefix_lens, dtype=torch.int64) > 0)[seq_t]
    source = torch.where(off >= 0, OWN, torch.where(has_prev[:, None], PREV, ZERO))
    prev_slot = torch.tensor(state_slots, dtype=torch.int64)[seq_t][:, None].expand(-1, kc1).clone()
    prev_col = (off + kc1).clamp(0, kc1 - 1)
    dst = torch.tensor(state_slots + [slot for _, _, slot in snapshots], dtype=torch.int64)
    return [own_rows, prev_slot, prev_col, source, dst]


def window_index(device_arrays: list[torch.Tensor], num_seqs: int) -> GdnWindowIndex:
    """The index from ``window_host_arrays``' arrays once on the device."""
    own_rows, prev_slot, prev_col, source, dst = device_arrays
    return GdnWindowIndex(own_rows, prev_slot, prev_col, source == OWN, source == PREV, dst, num_seqs)


def gather_windows(qkv: torch.Tensor, conv_pool: torch.Tensor, ix: GdnWindowIndex) -> torch.Tensor:
    """``[W, C, Kc-1]`` in qkv's dtype: every window of the step, read before any slot is written (a snapshot's
    window can reach into the slot's previous window, which the step then overwrites)."""
    own = qkv[ix.own_rows]  # [W, Kc-1, C]
    prev = conv_pool[ix.prev_slot, :, ix.prev_col].to(qkv.dtype)  # [W, Kc-1, C]: advanced indices first
    win = torch.where(ix.use_own[..., None], own, torch.where(ix.use_prev[..., None], prev, 0))
    return win.transpose(1, 2)
