"""Decode CUDA graphs: a decode step replayed as one graph per batch-size bucket.

At start-up ``DecodeGraphs.capture()`` records, for every bucket in ``graph_batch_sizes(--cuda-graph-max-bs)``
(largest first, so the smaller graphs reuse its memory pool), the whole decode step: the page-table write of
each sequence's new slot, every layer, the final norm, lm_head and the greedy token with its logprob. A second,
small graph per bucket holds the penalties and the filtered draw (temperature, top-k/p, min-p, seeds), replayed only
when some sequence samples or has a penalty; the sampled tokens are then counted for the penalties. A third holds
the top logprobs (``MAX_TOP_LOGPROBS`` = 20 most likely tokens of every row's raw distribution, a fixed shape),
replayed only when some row asks for any (each row's first ``num_top_logprobs`` are used): a step that asks for
none does exactly what it did before.

Per step the host does little: the plan's flat arrays are packed into two pinned staging buffers (numpy, no
torch ops), copied to the graph's static input buffers in two asynchronous copies, the graph is replayed, and the
sampled tokens come back through one event. ``launch`` returns once all that is queued and ``collect`` waits on the
event, so the engine plans and launches the next step while this one runs (overlap scheduling): a sequence whose
input is the token this step samples (``input_from_prev``) gets it on the device, gathered from the previous
replay's ``tokens`` before the next replay overwrites them. Staging and output buffers alternate between two sets,
so a launch never writes what the step before it may still be copying. A batch smaller than its bucket is padded with rows that point at
the worker's scratch page-table row, scratch KV slot and scratch state slot: they compute garbage nobody reads,
and the expert cache is told how many rows are real (``num_valid_tokens``) so padding fetches no experts.

    plan (flat dict) ──pack──▶ pinned staging[k] ──H2D──▶ static inputs (+ previous tokens) ──replay──▶ tokens
                     ──D2H──▶ pinned out[k] + event[k]  ...  collect: event[k].synchronize() ──▶ host lists

On CPU there are no graphs; ``emulate=True`` (tests) records the step function and replays it by calling it
again on the same static buffers, which checks the static-buffer plumbing and padding without a GPU, and
``sync_audit.no_host_sync`` during "capture" checks that nothing in the step would break a real capture.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field
from typing import Callable, Optional

import numpy as np
import torch

from ..layers.sampler import apply_penalties, draw_tokens, greedy_tokens, is_greedy, token_logprobs, top_logprobs
from ..log import get_logger
from .forward_batch import ForwardBatch
from .logprobs import MAX_TOP_LOGPROBS, graph_logprobs

logger = get_logger(__name__)

# int64 fields of the static input buffer, in packing order
_INT_FIELDS = ("input_ids", "positions", "rows", "out_cache_loc", "state_slots", "top_k", "seeds", "input_from_prev")
_FLOAT_FIELDS = ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty")


def decode_inputs(flat: dict, max_bs: int) -> Optional[dict[str, np.ndarray]]:
    """The graph inputs of a flat step plan (``step_plan.py``'s encoding), or None when the step is not a plain
    decode step a graph can run: every sequence one token over a cached prefix, sampled, sending exactly its new
    token's KV slot, no state restores, at most ``max_bs`` sequences. Snapshots of the state right after the
    step's token (the tool-call anchor of ``--enable-special-token-ckpt``) are slot copies the caller runs after
    the replay: ``snap_src`` (the live slots) to ``snap_dst``. Views over the plan's bytes (no copies); the
    caller validates the values."""
    if flat.get("kind") != "decode":
        return None
    arr = lambda key, dt: np.frombuffer(flat.get(key, b""), dtype=dt)  # noqa: E731
    rows = arr("rows", "<i4")
    n = rows.size
    if not 0 < n <= max_bs:
        return None
    ids, pre, slots = arr("input_ids", "<i4"), arr("prefix_lens", "<i4"), arr("table_slots", "<i4")
    sample_index = arr("sample_index", "<i4")
    if ids.size != n or slots.size != n or sample_index.size != n or arr("copy_src", "<i4").size:
        return None
    if arr("plp_seq", "<i4").size:
        return None  # prompt logprobs need every position's logits: prompt chunks, never a decode step
    if not (np.array_equal(arr("table_from", "<i4"), pre) and np.array_equal(sample_index, np.arange(n))):
        return None
    state_slots = arr("state_slots", "<i4")
    from_prev = arr("input_from_prev", "<i4")
    if from_prev.size not in (0, n):
        return None
    snap_seq, snap_upto = arr("snap_seq", "<i4"), arr("snap_upto", "<i4")
    if snap_seq.size and (np.any((snap_seq < 0) | (snap_seq >= n)) or np.any(snap_upto != pre[snap_seq] + 1)):
        return None  # a capture anywhere but after the step's one token: the eager path runs it
    return {
        "input_ids": ids,
        "positions": pre,
        "rows": rows,
        "out_cache_loc": slots,
        "state_slots": state_slots,
        "top_k": arr("top_k", "<i4"),
        "seeds": arr("seeds", "<i8"),
        "temperature": arr("temperature", "<f4"),
        "top_p": arr("top_p", "<f4"),
        "min_p": arr("min_p", "<f4"),
        "presence_penalty": arr("presence_penalty", "<f4"),
        "frequency_penalty": arr("frequency_penalty", "<f4"),
        "num_top_logprobs": arr("num_top_logprobs", "<i4"),
        "input_from_prev": from_prev if from_prev.size else np.full(n, -1, dtype=np.int32),
        "snap_src": state_slots[snap_seq],
        "snap_dst": arr("snap_slot", "<i4"),
    }


def graph_batch_sizes(max_bs: int) -> list[int]:
    """Buckets 1, 2, 4, 8, then every multiple of 8, up to ``max_bs`` (``max_bs`` itself included)."""
    if max_bs <= 0:
        return []
    sizes = [b for b in (1, 2, 4, 8) if b <= max_bs] + list(range(16, max_bs + 1, 8))
    if sizes[-1] != max_bs:
        sizes.append(max_bs)
    return sizes


@dataclass
class PaddingTargets:
    """Where padding rows point: the page table's spare row, a scratch KV slot, a scratch state slot (-1: the
    model has no recurrent state)."""

    row: int
    kv_slot: int
    state_slot: int


class _EmulatedGraph:
    """CPU stand-in for ``torch.cuda.CUDAGraph``: replay calls the recorded function again."""

    def __init__(self, fn: Callable[[], None]):
        self.fn = fn

    def replay(self) -> None:
        self.fn()


@dataclass
class LaunchedDecode:
    """A replay in flight: the buffer set ``k`` its tokens are copied into, and what ``collect`` reads."""

    k: int
    batch_size: int
    num_top_logprobs: Optional[np.ndarray]  # the rows' requests when one asked, else None
    done: Optional[object]  # torch.cuda.Event recorded after the copies (None on CPU: already done)
    expert_counts: bool = False  # the expert cache's cumulative counts were copied out after the step


@dataclass
class DecodeResult:
    tokens: list[int]
    logprobs: list[float]
    extra: dict = field(default_factory=dict)  # top logprobs when a row asked (engine/logprobs.py)
    expert_counts: Optional[tuple[int, ...]] = None  # the expert cache's cumulative (hits, misses, host) after it


class DecodeGraphs:
    def __init__(
        self,
        model: torch.nn.Module,
        kv,
        attn,
        state,
        device: torch.device,
        max_bs: int,
        max_context: int,
        padding: PaddingTargets,
        token_counts,
        expert_offload=None,
        emulate: bool = False,
        audit: bool = False,
    ):
        self.model, self.kv, self.attn, self.state = model, kv, attn, state
        self.device = device
        self.sizes = graph_batch_sizes(max_bs)
        self.max_bs = self.sizes[-1] if self.sizes else 0
        self.max_context = max_context
        self.padding = padding
        self.counts = token_counts  # OutputTokenCounts: what the penalties read, updated after every replay
        self.offload = expert_offload
        self.emulate = emulate
        self.audit = audit  # emulate only: run each captured function under no_host_sync()
        self.pool = None
        # one side stream for every warm-up: torch caches a cuBLAS workspace per (handle, stream), so a fresh
        # stream per recorded function can leave one behind each (a suspect, not measured yet, for the pool
        # measuring 0.21 GiB against 0.08 planned on the H200)
        self._warmup_stream = None
        self.graphs: dict[int, object] = {}  # bucket -> forward graph
        self.samplers: dict[int, object] = {}  # bucket -> filtered-draw graph
        self.toppers: dict[int, object] = {}  # bucket -> top-logprobs graph
        self.top_ids: Optional[torch.Tensor] = None  # [B, K] int64, K = min(MAX_TOP_LOGPROBS, vocab); with pinned
        self.top_lps: Optional[torch.Tensor] = None  # [B, K] f32   host copies beside them (allocated at capture)
        self.logits: dict[int, torch.Tensor] = {}  # bucket -> the forward graph's logits output
        self._recorded: list[Callable[[], None]] = []  # every captured function, kept alive with its inputs
        self.capture_s = 0.0
        self.pool_bytes = 0
        B = self.max_bs
        pin = device.type == "cuda"
        # static inputs: one int64 and one float32 device buffer, views per field; two sets of pinned staging
        # beside them (a launch fills one while the previous step's copy may still read the other)
        self._hosts_i = [torch.zeros(len(_INT_FIELDS) * B + 1, dtype=torch.int64, pin_memory=pin) for _ in (0, 1)]
        self._hosts_f = [torch.zeros(len(_FLOAT_FIELDS) * B, dtype=torch.float32, pin_memory=pin) for _ in (0, 1)]
        self._host_i, self._host_f = self._hosts_i[0], self._hosts_f[0]
        self._dev_i = torch.zeros_like(self._host_i, device=device)
        self._dev_f = torch.zeros_like(self._host_f, device=device)
        self._np_i, self._np_f = self._host_i.numpy(), self._host_f.numpy()
        self._next_set = 0  # the buffer set the next launch uses
        self.inputs = {name: self._dev_i[i * B : (i + 1) * B] for i, name in enumerate(_INT_FIELDS)}
        self.inputs.update({name: self._dev_f[i * B : (i + 1) * B] for i, name in enumerate(_FLOAT_FIELDS)})
        self.num_valid = self._dev_i[len(_INT_FIELDS) * B :]  # [1]: real (non-padding) rows this step
        self.prefix_lens = torch.zeros(B, dtype=torch.int32, device=device)
        self.context_lens = torch.zeros(B, dtype=torch.int32, device=device)
        # outputs
        self.tokens = torch.zeros(B, dtype=torch.int64, device=device)
        self.logprobs = torch.zeros(B, dtype=torch.float32, device=device)
        self._outs_tokens = [torch.zeros(B, dtype=torch.int64, pin_memory=pin) for _ in (0, 1)]
        self._outs_logprobs = [torch.zeros(B, dtype=torch.float32, pin_memory=pin) for _ in (0, 1)]
        self._done = [torch.cuda.Event() for _ in (0, 1)] if device.type == "cuda" else [None, None]
        # the expert cache's device counters, copied out behind each step (reading them directly would sync)
        # the expert cache's counts: hits, misses, host misses (DeviceExpertCache.counts)
        self._outs_counts = [torch.zeros(3, dtype=torch.int64, pin_memory=pin) for _ in (0, 1)]
        self._pad = self._padding_values()

    # ------------------------------------------------------------------ capture

    def bucket(self, batch_size: int) -> Optional[int]:
        for b in self.sizes:
            if b >= batch_size:
                return b
        return None

    def _batch(self, bs: int) -> ForwardBatch:
        i = self.inputs
        # split-K of decode attention: fixed per bucket, sized for the longest context (short contexts leave
        # splits empty, which the merge weighs zero)
        from ..kernels.attention import pick_num_kv_splits  # noqa: PLC0415 (triton is optional on CPU)

        splits = pick_num_kv_splits(bs, self.kv.num_kv_heads, self.max_context)
        return ForwardBatch.for_decode_graph(
            i["input_ids"][:bs],
            i["positions"][:bs],
            i["rows"][:bs],
            i["out_cache_loc"][:bs],
            self.prefix_lens[:bs],
            self.context_lens[:bs],
            i["state_slots"][:bs],
            self.kv,
            self.attn,
            self.state,
            num_kv_splits=splits,
        )

    # The recorded functions below read what they need from locals, never ``self``: this object keeps them (the
    # graphs, ``_recorded``), and a function holding it back would make a reference cycle, which only the garbage
    # collector frees; after the start-up freeze (``gc_control``) it never does, so a deleted engine kept its KV pool.

    def _forward_fn(self, bs: int) -> Callable[[], None]:
        batch = self._batch(bs)
        i, kv, model, logits_by_bs = self.inputs, self.kv, self.model, self.logits
        prefix_lens, context_lens, tokens, logprobs = self.prefix_lens, self.context_lens, self.tokens, self.logprobs

        def step() -> None:
            pos = i["positions"][:bs]
            prefix_lens[:bs].copy_(pos)
            context_lens[:bs].copy_(pos + 1)
            kv.req_to_token[batch.rows, pos] = batch.out_cache_loc.to(torch.int32)  # the new token's slot
            logits = model(batch)
            tok, lp = greedy_tokens(logits)
            tokens[:bs].copy_(tok)
            logprobs[:bs].copy_(lp)
            logits_by_bs[bs] = logits

        return step

    def _sampler_fn(self, bs: int) -> Callable[[], None]:
        i, token_counts, logits_by_bs, tokens, logprobs = (
            self.inputs,
            self.counts,
            self.logits,
            self.tokens,
            self.logprobs,
        )

        def draw() -> None:
            logits = logits_by_bs[bs]
            counts = token_counts.counts[i["rows"][:bs]]
            penalized = apply_penalties(logits, counts, i["presence_penalty"][:bs], i["frequency_penalty"][:bs])
            temp, top_k = i["temperature"][:bs], i["top_k"][:bs]
            drawn = draw_tokens(penalized, temp, i["top_p"][:bs], top_k, i["min_p"][:bs], i["seeds"][:bs])
            tok = torch.where(is_greedy(temp, top_k), torch.argmax(penalized, dim=-1), drawn)
            tokens[:bs].copy_(tok)
            logprobs[:bs].copy_(token_logprobs(logits, tok))

        return draw

    def _top_fn(self, bs: int) -> Callable[[], None]:
        """The top-logprobs step of bucket ``bs`` (after its forward graph is recorded: its logits exist)."""
        if self.top_ids is None:
            k, pin = min(MAX_TOP_LOGPROBS, self.logits[bs].shape[-1]), self.device.type == "cuda"
            self.top_ids = torch.zeros(self.max_bs, k, dtype=torch.int64, device=self.device)
            self.top_lps = torch.zeros(self.max_bs, k, dtype=torch.float32, device=self.device)
            self._outs_top_ids = [torch.zeros(self.max_bs, k, dtype=torch.int64, pin_memory=pin) for _ in (0, 1)]
            self._outs_top_lps = [torch.zeros(self.max_bs, k, dtype=torch.float32, pin_memory=pin) for _ in (0, 1)]

        logits_by_bs, top_ids, top_lps = self.logits, self.top_ids, self.top_lps

        def top() -> None:
            ids, lps = top_logprobs(logits_by_bs[bs], top_ids.shape[1])
            top_ids[:bs].copy_(ids)
            top_lps[:bs].copy_(lps)

        return top

    def capture(self) -> None:
        """Record every bucket (largest first). Padding inputs are staged first, so the warm-up runs touch only
        scratch rows and slots."""
        if not self.sizes:
            return
        t0 = time.perf_counter()
        reserved0 = torch.cuda.memory_reserved(self.device) if self.device.type == "cuda" else 0
        self._stage_padding(0)
        if self.offload is not None:
            self.offload.num_valid_tokens = self.num_valid
        try:
            for bs in reversed(self.sizes):
                fwd, draw = self._forward_fn(bs), self._sampler_fn(bs)
                self.graphs[bs] = self._record(fwd)
                self.samplers[bs] = self._record(draw)
                self.toppers[bs] = self._record(self._top_fn(bs))
        finally:
            if self.offload is not None:
                self.offload.num_valid_tokens = None
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            # the eager warm-up runs on the side stream left their blocks cached in the allocator, outside the
            # graphs' pool: hand them back, so the figure (and the plan's check against it) is the pool alone
            torch.cuda.empty_cache()
            self.pool_bytes = torch.cuda.memory_reserved(self.device) - reserved0
        self.capture_s = time.perf_counter() - t0

    def _record(self, fn: Callable[[], None]):
        # The step function holds its ForwardBatch, whose tensors (cu_seqlens, logits_indices) were allocated
        # outside the graph's pool: a replay reads them, so they must live as long as the graph.
        self._recorded.append(fn)
        if self.emulate or self.device.type != "cuda":
            from .sync_audit import no_host_sync

            with torch.inference_mode(), no_host_sync() if self.audit else contextlib.nullcontext():
                fn()  # what capture would record must run without a host sync
            return _EmulatedGraph(fn)
        if self._warmup_stream is None:
            self._warmup_stream = torch.cuda.Stream(self.device)
        side = self._warmup_stream
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side), torch.inference_mode():
            for _ in range(2):  # compile Triton kernels, settle allocator and autotuner state
                fn()
        torch.cuda.current_stream(self.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        with torch.inference_mode(), torch.cuda.graph(graph, pool=self.pool):
            fn()
        return graph

    # ------------------------------------------------------------------ replay

    def _padding_values(self) -> dict:
        p = self.padding
        return {
            "input_ids": 0,
            "positions": 0,
            "rows": p.row,
            "out_cache_loc": p.kv_slot,
            "state_slots": p.state_slot,
            "top_k": 0,
            "seeds": 0,
            "input_from_prev": -1,
            "temperature": 0.0,
            "top_p": 1.0,
            "min_p": 0.0,
            "presence_penalty": 0.0,
            "frequency_penalty": 0.0,
        }

    def _stage_padding(self, start: int) -> None:
        """Rows ``start..max_bs`` of the staging buffers become padding rows; copies them to the device."""
        B, pad = self.max_bs, self._padding_values()
        for f, name in enumerate(_INT_FIELDS):
            self._np_i[f * B + start : (f + 1) * B] = pad[name]
        self._np_i[len(_INT_FIELDS) * B] = start
        for f, name in enumerate(_FLOAT_FIELDS):
            self._np_f[f * B + start : (f + 1) * B] = pad[name]
        self._dev_i.copy_(self._host_i)
        self._dev_f.copy_(self._host_f)

    def run(self, inputs: dict[str, np.ndarray], batch_size: int) -> DecodeResult:
        """One decode step of ``batch_size`` sequences, to the end (``launch`` then ``collect``)."""
        return self.collect(self.launch(inputs, batch_size))

    def _stage(self, inputs: dict[str, np.ndarray], n: int, bs: int, k: int) -> None:
        """Packs ``inputs`` (``n`` rows, padded to bucket ``bs``) into staging set ``k``."""
        B, ni, nf, pad = self.max_bs, self._hosts_i[k].numpy(), self._hosts_f[k].numpy(), self._pad
        for f, name in enumerate(_INT_FIELDS):
            ni[f * B : f * B + n] = inputs[name]
            ni[f * B + n : f * B + bs] = pad[name]  # padding rows: never a real row's slots
        ni[len(_INT_FIELDS) * B] = n
        for f, name in enumerate(_FLOAT_FIELDS):
            nf[f * B : f * B + n] = inputs[name]
            nf[f * B + n : f * B + bs] = pad[name]

    def _feed_previous(self, prev_tokens: torch.Tensor, n: int) -> None:
        """Rows with ``input_from_prev >= 0`` take that row of the previous step's sampled tokens, on the device
        (stream-ordered before this replay, which overwrites ``tokens``)."""
        src, ids = self.inputs["input_from_prev"][:n], self.inputs["input_ids"][:n]
        ids.copy_(torch.where(src >= 0, prev_tokens[src.clamp(min=0)], ids))

    def launch(
        self, inputs: dict[str, np.ndarray], batch_size: int, prev_tokens: Optional[torch.Tensor] = None
    ) -> LaunchedDecode:
        """Queues one decode step of ``batch_size`` sequences. ``inputs`` maps every field of ``_INT_FIELDS`` and
        ``_FLOAT_FIELDS`` to an array of ``batch_size`` values (validated by the caller); ``prev_tokens`` are the
        previous step's sampled tokens on the device, read where ``input_from_prev >= 0``."""
        bs = self.bucket(batch_size)
        assert bs is not None, f"batch of {batch_size} exceeds the largest graph ({self.max_bs})"
        n, k = batch_size, self._next_set
        self._next_set ^= 1
        self._stage(inputs, n, bs, k)
        greedy = (inputs["temperature"] <= 0) | (inputs["top_k"] == 1)
        penalized = (inputs["presence_penalty"] != 0) | (inputs["frequency_penalty"] != 0)
        sampling = not bool(np.all(greedy & ~penalized))
        tops = bool(np.any(inputs["num_top_logprobs"] > 0))
        self._dev_i.copy_(self._hosts_i[k], non_blocking=True)
        self._dev_f.copy_(self._hosts_f[k], non_blocking=True)
        if prev_tokens is not None and bool(np.any(inputs["input_from_prev"] >= 0)):
            self._feed_previous(prev_tokens, n)
        self.graphs[bs].replay()
        if sampling:
            self.samplers[bs].replay()
        if tops:  # only when a row asks: the plain step does no more than before
            self.toppers[bs].replay()
            self._outs_top_ids[k][:n].copy_(self.top_ids[:n], non_blocking=True)
            self._outs_top_lps[k][:n].copy_(self.top_lps[:n], non_blocking=True)
        self.counts.add(self.inputs["rows"][:n], self.tokens[:n])
        experts = self._expert_counters()
        if experts is not None:
            self._outs_counts[k].copy_(experts, non_blocking=True)
        self._outs_tokens[k][:n].copy_(self.tokens[:n], non_blocking=True)
        self._outs_logprobs[k][:n].copy_(self.logprobs[:n], non_blocking=True)
        if self._done[k] is not None:
            self._done[k].record()
        tops_of = inputs["num_top_logprobs"].copy() if tops else None
        return LaunchedDecode(k, n, tops_of, self._done[k], expert_counts=experts is not None)

    def _expert_counters(self) -> Optional[torch.Tensor]:
        """The device expert cache's cumulative (hits, misses, host misses) tensor (offload backends), if any."""
        counts = getattr(getattr(self.offload, "cache", None), "counts", None)
        return counts if isinstance(counts, torch.Tensor) else None

    def collect(self, step: LaunchedDecode) -> DecodeResult:
        """Waits for a launched step's copies and returns its tokens."""
        if step.done is not None:
            step.done.synchronize()
        k, n = step.k, step.batch_size
        extra = {}
        if step.num_top_logprobs is not None:
            ids, lps = self._outs_top_ids[k][:n].numpy(), self._outs_top_lps[k][:n].numpy()
            extra = graph_logprobs(step.num_top_logprobs, ids, lps)
        experts = tuple(self._outs_counts[k].tolist()) if step.expert_counts else None
        return DecodeResult(self._outs_tokens[k][:n].tolist(), self._outs_logprobs[k][:n].tolist(), extra, experts)

    def describe(self) -> str:
        return (
            f"Captured CUDA graphs for batch sizes {self.sizes} in {self.capture_s:.1f} s "
            f"(graph memory pool {self.pool_bytes / 2**30:.2f} GiB)"
        )
