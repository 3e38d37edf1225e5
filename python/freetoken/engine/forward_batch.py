"""What a model's forward sees: the step plan turned into device tensors, plus the caches it reads and writes.

Layers never look at the plan; they read this. Host-side copies of the small per-sequence lengths are kept
next to the device tensors so torch reference paths can loop over sequences without a device sync.

A decode batch built for a CUDA graph (``ForwardBatch.for_decode_graph``) has no host copies at all (they are
None): its device tensors are views of the graph's static input buffers, refilled before every replay, so code
that runs under a graph must read only device tensors and decide only on shapes and ``is_decode``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

import torch

from ..layers.gdn_state_windows import window_host_arrays, window_index
from .host_upload import upload_int_arrays

if TYPE_CHECKING:
    from ..cache.kv_pool import KVCachePool
    from ..layers.attention import AttentionBackend
    from ..layers.gdn_state_windows import GdnWindowIndex


@dataclass
class ForwardBatch:
    input_ids: torch.Tensor  # [T] int64, device
    positions: torch.Tensor  # [T] int64, device
    cu_seqlens: torch.Tensor  # [B+1] int32, device
    prefix_lens: torch.Tensor  # [B] int32, device: tokens already cached before this step
    context_lens: torch.Tensor  # [B] int32, device: prefix + new tokens
    rows: torch.Tensor  # [B] int64, device: page-table rows
    out_cache_loc: torch.Tensor  # [T] int64, device: KV slot of each new token
    state_slots: torch.Tensor  # [B] int64, device: live recurrent-state slot (-1 when not hybrid)
    logits_indices: torch.Tensor  # [S] int64, device: token rows whose logits are computed
    # host copies (None in a CUDA-graph decode batch)
    extend_lens_cpu: Optional[list[int]]
    prefix_lens_cpu: Optional[list[int]]
    context_lens_cpu: Optional[list[int]]
    state_slots_cpu: Optional[list[int]]
    is_decode: bool  # every sequence has exactly one new token over a cached prefix
    # the caches this forward reads and writes
    kv: "KVCachePool"
    attn: "AttentionBackend"
    state: Optional[object] = None  # RecurrentStatePool for hybrid models
    snapshots: Optional[list[tuple[int, int, int]]] = None  # (seq_index, upto, slot) recurrent-state captures
    # split-K count of decode attention: fixed per CUDA-graph bucket; None = chosen from the host lengths
    num_kv_splits: Optional[int] = None
    # a hybrid model's step of several sequences: where its GDN conv windows come from (None otherwise)
    gdn_windows: Optional["GdnWindowIndex"] = None

    @property
    def num_seqs(self) -> int:
        return int(self.rows.numel())

    @property
    def in_graph(self) -> bool:
        """Built for CUDA-graph capture: device tensors only."""
        return self.extend_lens_cpu is None

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.numel())

    @property
    def has_initial_state_cpu(self) -> list[bool]:
        """A sequence continues from its state slot when something was computed before this step."""
        return [p > 0 for p in self.prefix_lens_cpu]

    @classmethod
    def from_plan(
        cls,
        plan,
        kv: "KVCachePool",
        attn: "AttentionBackend",
        state=None,
        all_logits: bool = False,
        logits_indices: Optional[torch.Tensor] = None,
    ) -> "ForwardBatch":
        """Device tensors for ``plan`` (a StepPlan). Writes the plan's page-table entries into ``kv``.
        ``all_logits`` computes logits at every position (offline per-position logits), ``logits_indices`` at those
        token rows (``engine/logprobs.py``), else only at the last token of each sampled sequence."""
        dev = kv.device
        ext = plan.extend_lens
        pre = plan.prefix_lens
        seq_of_tok = torch.repeat_interleave(torch.arange(plan.num_seqs), ext)
        positions = torch.arange(plan.num_tokens) - plan.cu_seqlens[:-1][seq_of_tok] + pre[seq_of_tok]
        if logits_indices is not None:
            logits_idx = logits_indices.to("cpu")  # host rows (a device tensor would be copied back, once)
        elif all_logits:
            logits_idx = torch.arange(plan.num_tokens)
        else:
            logits_idx = plan.cu_seqlens[1:][plan.sampling.seq_index] - 1
        table_rows, table_pos = kv.table_positions(plan.rows, plan.table_from, plan.table_indptr, plan.table_slots)
        snapshots = list(zip(plan.snap_seq.tolist(), plan.snap_upto.tolist(), plan.snap_slot.tolist()))
        is_decode = bool((ext == 1).all()) and bool((pre > 0).all())
        # a GDN prompt step of several sequences: its conv windows' sources (``layers/gdn_state_windows.py``); a
        # decode step without snapshots updates its states in place and reads none
        windows = []
        if state is not None and plan.num_seqs > 1 and not (is_decode and not snapshots):
            windows = window_host_arrays(
                plan.cu_seqlens.tolist(), pre.tolist(), plan.state_slots.tolist(), snapshots, state.conv_shape[-1]
            )
        # every host array in one copy that does not stop the host (``host_upload.py``)
        uploaded = upload_int_arrays(
            [plan.input_ids, positions, plan.cu_seqlens, pre, pre + ext, plan.rows, seq_of_tok,
             plan.state_slots, logits_idx, table_rows, table_pos, plan.table_slots, *windows],
            dev,
        )  # fmt: skip
        input_ids, positions_d, cu, pre_d, ctx_d, rows_d, seq_d, slots_d, logits_d = uploaded[:9]
        t_rows, t_pos, t_slots = uploaded[9:12]
        kv.write_entries(t_rows, t_pos, t_slots)
        out_loc = kv.req_to_token[rows_d[seq_d], positions_d].to(torch.int64)
        return cls(
            input_ids=input_ids,
            positions=positions_d,
            cu_seqlens=cu.to(torch.int32),
            prefix_lens=pre_d.to(torch.int32),
            context_lens=ctx_d.to(torch.int32),
            rows=rows_d,
            out_cache_loc=out_loc,
            state_slots=slots_d,
            logits_indices=logits_d,
            extend_lens_cpu=ext.tolist(),
            prefix_lens_cpu=pre.tolist(),
            context_lens_cpu=(pre + ext).tolist(),
            state_slots_cpu=plan.state_slots.tolist(),
            is_decode=is_decode,
            kv=kv,
            attn=attn,
            state=state,
            snapshots=snapshots or None,
            gdn_windows=window_index(uploaded[12:], plan.num_seqs) if windows else None,
        )

    @classmethod
    def for_decode_graph(
        cls,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        rows: torch.Tensor,
        out_cache_loc: torch.Tensor,
        prefix_lens: torch.Tensor,
        context_lens: torch.Tensor,
        state_slots: torch.Tensor,
        kv: "KVCachePool",
        attn: "AttentionBackend",
        state=None,
        num_kv_splits: Optional[int] = None,
    ) -> "ForwardBatch":
        """A decode batch over static device buffers (one token per sequence): what a CUDA graph captures. Every
        per-sequence tensor is passed in (a view of a static buffer): anything derived here would be computed once
        at capture and never again. ``positions`` int64 = ``prefix_lens`` int32 = ``context_lens`` int32 - 1."""
        b = int(rows.numel())
        dev = rows.device
        return cls(
            input_ids=input_ids,
            positions=positions,
            cu_seqlens=torch.arange(b + 1, dtype=torch.int32, device=dev),
            prefix_lens=prefix_lens,
            context_lens=context_lens,
            rows=rows,
            out_cache_loc=out_cache_loc,
            state_slots=state_slots,
            logits_indices=torch.arange(b, dtype=torch.int64, device=dev),
            extend_lens_cpu=None,
            prefix_lens_cpu=None,
            context_lens_cpu=None,
            state_slots_cpu=None,
            is_decode=True,
            kv=kv,
            attn=attn,
            state=state,
            num_kv_splits=num_kv_splits,
        )
