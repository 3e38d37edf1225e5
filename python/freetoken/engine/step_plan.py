"""The step contract, Python side (the Rust side is crates/ft-core/src/step.rs; crates/ft-py flattens).

Once per step the engine calls ``Worker.execute(plan)`` with a dict of flat little-endian arrays (``bytes``)
and scalars. This module is the one place that decodes it. A change here bumps ``STEP_CONTRACT_VERSION`` on
both sides in the same commit; the worker refuses to start on a mismatch.

Encoding (B sequences, T new tokens, S sampled sequences, C state copies, N snapshots):

    version                int
    step_id                int
    kind                   "prefill" | "decode" | "mixed"
    request_ids   i64[B]   cu_seqlens    i32[B+1]   new tokens of sequence b: input_ids[cu[b]:cu[b+1]]
    input_ids     i32[T]   prefix_lens   i32[B]     tokens already in the KV cache / recurrent state
    input_from_prev i32[B] -1, or r: the sequence's one new token is the token sampled for sampled row r of the
                           step launched just before (overlap: not yet collected; input_ids holds a placeholder)
    rows          i32[B]   page-table row of each sequence
    table_from    i32[B]   table_indptr  i32[B+1]   table_slots i32[..]: KV slots for positions
                                                    table_from[b] .. prefix_lens[b] + extend_len[b] of row b
    state_slots   i32[B]   live recurrent-state slot (-1: not hybrid)
    sample_index  i32[S]   which sequences sample, with their temperature f32[S], top_p f32[S], top_k i32[S],
                           min_p f32[S], presence_penalty f32[S], frequency_penalty f32[S], seeds i64[S] (u64 bits),
                           num_top_logprobs i32[S] (most likely tokens to report beside the sampled one; 0: none)
    plp_seq       i32[Q]   sequences wanting prompt logprobs for their new tokens, with plp_next i32[Q] (the prompt
                           token after the chunk, -1 when the chunk ends the prompt) and plp_top i32[Q] (alternatives)
    copy_src, copy_dst  i32[C]          state copies to run before the forward
    snap_seq, snap_upto, snap_slot i32[N]  recurrent-state snapshots to capture

``Worker.execute(plan)`` runs a step to the end; the overlap loop calls ``Worker.launch(plan)`` instead and later
``Worker.collect()`` (the oldest launched step's answer; at most two launched, so a plan reading ``input_from_prev``
follows the step it reads).

The answer of ``Worker.execute`` (and ``collect``): ``(tokens, logprobs, stats, extra)``: the sampled tokens and their raw logprobs
(one per sampled sequence, plan order), the step's statistics, and the logprobs asked for besides (absent keys
mean none; ``engine/logprobs.py`` builds it):

    top_k int, top_ids i32[S*top_k], top_logprobs f32[S*top_k]     the most likely tokens of every sampled row, when
                                                                   any asks (``top_k`` >= the most any asked)
    prompt_logprobs f32[P]                                         per prompt position of the plp_seq sequences, in
                                                                   order: new tokens after the first, then plp_next
    prompt_top_k int, prompt_top_ids i32[P*k], prompt_top_logprobs f32[P*k]   their most likely tokens, when asked
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import numpy as np
import torch

STEP_CONTRACT_VERSION = 4

_I32 = np.dtype("<i4")
_I64 = np.dtype("<i8")
_F32 = np.dtype("<f4")


def _arr(d: dict, key: str, dtype) -> torch.Tensor:
    raw = d.get(key, b"")
    return torch.from_numpy(np.frombuffer(raw, dtype=dtype).copy())


@dataclass
class SamplingBatch:
    """Per-sampled-sequence settings, all CPU tensors of length S."""

    seq_index: torch.Tensor  # i64 [S] index into the plan's sequences
    temperature: torch.Tensor  # f32 [S]; 0 = greedy
    top_p: torch.Tensor  # f32 [S]
    top_k: torch.Tensor  # i64 [S]; <= 0 disables
    min_p: torch.Tensor  # f32 [S]
    presence_penalty: torch.Tensor  # f32 [S]; subtracted from every token generated before (OpenAI)
    frequency_penalty: torch.Tensor  # f32 [S]; times how often each token was generated before
    seeds: torch.Tensor  # i64 [S]
    num_top_logprobs: torch.Tensor = field(default_factory=lambda: torch.zeros(0, dtype=torch.int64))  # i64 [S]

    def __len__(self) -> int:
        return int(self.seq_index.numel())


@dataclass
class StepPlan:
    """One decoded step plan; every tensor on the CPU, int64 where it indexes."""

    step_id: int
    kind: str
    request_ids: torch.Tensor  # [B]
    input_ids: torch.Tensor  # [T]
    cu_seqlens: torch.Tensor  # [B+1]
    prefix_lens: torch.Tensor  # [B]
    rows: torch.Tensor  # [B]
    table_from: torch.Tensor  # [B]
    table_indptr: torch.Tensor  # [B+1]
    table_slots: torch.Tensor  # [sum]
    state_slots: torch.Tensor  # [B]
    sampling: SamplingBatch
    copy_src: torch.Tensor = field(default_factory=lambda: torch.zeros(0, dtype=torch.int64))
    copy_dst: torch.Tensor = field(default_factory=lambda: torch.zeros(0, dtype=torch.int64))
    snap_seq: torch.Tensor = field(default_factory=lambda: torch.zeros(0, dtype=torch.int64))
    snap_upto: torch.Tensor = field(default_factory=lambda: torch.zeros(0, dtype=torch.int64))
    snap_slot: torch.Tensor = field(default_factory=lambda: torch.zeros(0, dtype=torch.int64))
    plp_seq: torch.Tensor = field(default_factory=lambda: torch.zeros(0, dtype=torch.int64))
    plp_next: torch.Tensor = field(default_factory=lambda: torch.zeros(0, dtype=torch.int64))
    plp_top: torch.Tensor = field(default_factory=lambda: torch.zeros(0, dtype=torch.int64))
    input_from_prev: Optional[torch.Tensor] = None  # [B]; -1 or the previous step's sampled row (None: all -1)

    @property
    def num_seqs(self) -> int:
        return int(self.rows.numel())

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.numel())

    @property
    def extend_lens(self) -> torch.Tensor:
        return self.cu_seqlens[1:] - self.cu_seqlens[:-1]

    @property
    def context_lens(self) -> torch.Tensor:
        return self.prefix_lens + self.extend_lens

    @classmethod
    def from_flat(cls, d: dict) -> "StepPlan":
        from ..errors import InvalidPlan

        if d.get("version") != STEP_CONTRACT_VERSION:
            raise InvalidPlan(f"step contract version {d.get('version')} != {STEP_CONTRACT_VERSION}")
        i32 = lambda k: _arr(d, k, _I32).to(torch.int64)  # noqa: E731
        plan = cls(
            step_id=int(d["step_id"]),
            kind=str(d["kind"]),
            request_ids=_arr(d, "request_ids", _I64),
            input_ids=i32("input_ids"),
            cu_seqlens=i32("cu_seqlens"),
            prefix_lens=i32("prefix_lens"),
            rows=i32("rows"),
            table_from=i32("table_from"),
            table_indptr=i32("table_indptr"),
            table_slots=i32("table_slots"),
            state_slots=i32("state_slots"),
            sampling=SamplingBatch(
                seq_index=i32("sample_index"),
                temperature=_arr(d, "temperature", _F32),
                top_p=_arr(d, "top_p", _F32),
                top_k=i32("top_k"),
                min_p=_arr(d, "min_p", _F32),
                presence_penalty=_arr(d, "presence_penalty", _F32),
                frequency_penalty=_arr(d, "frequency_penalty", _F32),
                seeds=_arr(d, "seeds", _I64),
                num_top_logprobs=i32("num_top_logprobs"),
            ),
            copy_src=i32("copy_src"),
            copy_dst=i32("copy_dst"),
            snap_seq=i32("snap_seq"),
            snap_upto=i32("snap_upto"),
            snap_slot=i32("snap_slot"),
            plp_seq=i32("plp_seq"),
            plp_next=i32("plp_next"),
            plp_top=i32("plp_top"),
        )
        prev = i32("input_from_prev")
        plan.input_from_prev = prev if bool((prev >= 0).any()) else None
        plan.validate()
        return plan

    def to_flat(self, version: int = STEP_CONTRACT_VERSION) -> dict:
        """The flat encoding ``from_flat`` decodes (what crates/ft-py sends): Python callers of ``Worker.execute``."""
        i32 = lambda t: t.numpy().astype(_I32).tobytes()  # noqa: E731
        s = self.sampling
        return {
            "version": version,
            "step_id": self.step_id,
            "kind": self.kind,
            "request_ids": self.request_ids.numpy().astype(_I64).tobytes(),
            "input_ids": i32(self.input_ids),
            "cu_seqlens": i32(self.cu_seqlens),
            "prefix_lens": i32(self.prefix_lens),
            "rows": i32(self.rows),
            "table_from": i32(self.table_from),
            "table_indptr": i32(self.table_indptr),
            "table_slots": i32(self.table_slots),
            "state_slots": i32(self.state_slots),
            "sample_index": i32(s.seq_index),
            "temperature": s.temperature.numpy().astype(_F32).tobytes(),
            "top_p": s.top_p.numpy().astype(_F32).tobytes(),
            "top_k": i32(s.top_k),
            "min_p": s.min_p.numpy().astype(_F32).tobytes(),
            "seeds": s.seeds.numpy().astype(_I64).tobytes(),
            "presence_penalty": s.presence_penalty.numpy().astype(_F32).tobytes(),
            "frequency_penalty": s.frequency_penalty.numpy().astype(_F32).tobytes(),
            "num_top_logprobs": i32(s.num_top_logprobs),
            "plp_seq": i32(self.plp_seq),
            "plp_next": i32(self.plp_next),
            "plp_top": i32(self.plp_top),
            "input_from_prev": i32(self.input_from_prev) if self.input_from_prev is not None else b"",
            "copy_src": i32(self.copy_src),
            "copy_dst": i32(self.copy_dst),
            "snap_seq": i32(self.snap_seq),
            "snap_upto": i32(self.snap_upto),
            "snap_slot": i32(self.snap_slot),
        }

    def validate(self) -> None:
        """Cheap shape checks: a malformed plan is an InvalidPlan, never a crash deep inside a kernel."""
        from ..errors import InvalidPlan

        b = self.num_seqs
        for name in ("prefix_lens", "table_from", "state_slots", "request_ids"):
            if getattr(self, name).numel() != b:
                raise InvalidPlan(f"{name} has {getattr(self, name).numel()} entries for {b} sequences")
        if self.cu_seqlens.numel() != b + 1 or self.table_indptr.numel() != b + 1:
            raise InvalidPlan("cu_seqlens / table_indptr must have B+1 entries")
        if int(self.cu_seqlens[-1]) != self.num_tokens:
            raise InvalidPlan("cu_seqlens does not add up to the number of tokens")
        if bool((self.extend_lens <= 0).any()):
            raise InvalidPlan("every scheduled sequence needs at least one new token")
        sent = self.table_indptr[1:] - self.table_indptr[:-1]
        if bool((self.table_from + sent != self.context_lens).any()):
            raise InvalidPlan("table_slots must cover table_from .. context_len of every sequence")
        if int(self.table_indptr[-1]) != self.table_slots.numel():
            raise InvalidPlan("table_indptr does not add up to table_slots")
        s = self.sampling
        n = len(s)
        names = ("temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty", "seeds")
        for name in (*names, "num_top_logprobs"):
            if getattr(s, name).numel() != n:
                raise InvalidPlan(f"sampling {name} has the wrong length")
        if n and (int(s.seq_index.min()) < 0 or int(s.seq_index.max()) >= b):
            raise InvalidPlan("sample_index out of range")
        q = self.plp_seq.numel()
        if self.plp_next.numel() != q or self.plp_top.numel() != q:
            raise InvalidPlan("plp_seq, plp_next and plp_top differ in length")
        if q and (int(self.plp_seq.min()) < 0 or int(self.plp_seq.max()) >= b or self.plp_seq.unique().numel() != q):
            raise InvalidPlan("plp_seq out of range or repeated")
        prev = self.input_from_prev
        if prev is not None and (prev.numel() != b or bool(((prev >= 0) & (self.extend_lens != 1)).any())):
            raise InvalidPlan("input_from_prev needs one entry per sequence, each one-token where set")

    @classmethod
    def build(
        cls,
        seqs: list[dict],
        step_id: int = 0,
    ) -> "StepPlan":
        """Build a plan from per-sequence dicts (tests and the offline path). Each dict has ``tokens``,
        ``prefix_len``, ``row``, ``table_from``, ``table_slots``, optional ``state_slot``, optional ``sample`` (dict
        with temperature, top_p, top_k, min_p, presence_penalty, frequency_penalty, seed, num_top_logprobs) and
        optional ``prompt_logprobs`` (dict with ``next`` (-1: none) and ``top``)."""
        lens = [len(s["tokens"]) for s in seqs]
        cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int64)
        sent = [len(s["table_slots"]) for s in seqs]
        ti = np.concatenate([[0], np.cumsum(sent)]).astype(np.int64)
        sampled = [i for i, s in enumerate(seqs) if s.get("sample") is not None]
        sp = [seqs[i]["sample"] for i in sampled]
        t64 = lambda x: torch.tensor(x, dtype=torch.int64)  # noqa: E731
        f32 = lambda x: torch.tensor(x, dtype=torch.float32)  # noqa: E731
        plan = cls(
            step_id=step_id,
            kind="decode" if all(n == 1 and s["prefix_len"] > 0 for n, s in zip(lens, seqs)) else "prefill",
            request_ids=t64([s.get("request_id", i) for i, s in enumerate(seqs)]),
            input_ids=t64([t for s in seqs for t in s["tokens"]]),
            cu_seqlens=torch.from_numpy(cu),
            prefix_lens=t64([s["prefix_len"] for s in seqs]),
            rows=t64([s["row"] for s in seqs]),
            table_from=t64([s["table_from"] for s in seqs]),
            table_indptr=torch.from_numpy(ti),
            table_slots=t64([x for s in seqs for x in s["table_slots"]]),
            state_slots=t64([s.get("state_slot", -1) for s in seqs]),
            sampling=SamplingBatch(
                seq_index=t64(sampled),
                temperature=f32([p.get("temperature", 0.0) for p in sp]),
                top_p=f32([p.get("top_p", 1.0) for p in sp]),
                top_k=t64([p.get("top_k", 0) for p in sp]),
                min_p=f32([p.get("min_p", 0.0) for p in sp]),
                presence_penalty=f32([p.get("presence_penalty", 0.0) for p in sp]),
                frequency_penalty=f32([p.get("frequency_penalty", 0.0) for p in sp]),
                seeds=t64([p.get("seed", 0) for p in sp]),
                num_top_logprobs=t64([p.get("num_top_logprobs", 0) for p in sp]),
            ),
        )
        plp = [(i, s["prompt_logprobs"]) for i, s in enumerate(seqs) if s.get("prompt_logprobs") is not None]
        plan.plp_seq = t64([i for i, _ in plp])
        plan.plp_next = t64([p.get("next", -1) for _, p in plp])
        plan.plp_top = t64([p.get("top", 0) for _, p in plp])
        if any(s.get("input_from_prev", -1) >= 0 for s in seqs):
            plan.input_from_prev = t64([s.get("input_from_prev", -1) for s in seqs])
        plan.validate()
        return plan
