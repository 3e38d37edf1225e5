"""CUDA graphs of a Gated DeltaNet prefill step of several sequences (fla's varlen chunked forward), by bucket.

A step of several sequences (prompts arriving together, a prompt joining running decode streams, decode steps with
snapshots) ran fla's varlen forward eagerly: ~17 Triton launches and their Python per GDN layer, ~1 ms of host time
a layer, 30 layers a step, where one sequence replays a graph (``gdn_prefill_graphs.py``). On the H100 a step of one
224-token prompt and 31 decode tokens took 79 ms where the prompt alone took 47 (``bench/batch_prefill_step.py``);
replayed from these graphs, 51 ms against 74 eagerly on the same machine (README, "Steps of many sequences").

A graph fixes every grid, and fla's varlen grids depend on two numbers only: the sequence count N (the state
kernel's programs) and the total chunk count NT (everything else: one program per 64-token chunk of a sequence).
So a step of ``n`` sequences whose chunks number ``C = Σ ceil(len/64)`` runs in the graph of bucket ``(Nb, NTb)``,
``Nb > n`` and ``NTb >= C``, with its varlen index padded (``padded_varlen_index``): after the real sequences, one
padding sequence of ``NTb - C`` whole chunks, then empty sequences up to ``Nb``. Each sequence's chunks are computed
as in the unpadded call (fla's tiles never cross a sequence), so the real sequences' outputs and final states are
those of the eager varlen call (compared on the GPU within the one-sequence graphs' tolerances: fla autotunes some
launch settings per call shape). The padding sequence's rows get ``g = 0, beta = 0`` and start from a zero state:
it stays finite, and nothing reads it.

The index (``cu_seqlens [Nb+1]``, ``chunk_indices [NTb, 2]``) lives in static buffers, refilled once per step (every
GDN layer of a step has the same one). fla derives its chunk offsets from ``cu_seqlens`` through a cache keyed on the
tensor object, so every call passes a fresh view of the buffer: the derivation is recorded in the graph and replayed
on the step's values. q | k | v and the gates share the one-sequence graphs' staged buffers (the conv writes there
when the step fits), the outputs their ``o``; graphs of both kinds come from one private pool and never overlap.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Optional

import torch

from .gated_deltanet import CHUNK_SIZE
from .gdn_prefill_graphs import record_graph

if TYPE_CHECKING:
    from .gdn_prefill_graphs import GdnPrefillGraphs

# fn(q, k, v, g, beta, initial_state [N, ...], varlen=(cu_seqlens, chunk_indices)) -> (o [T, Hv, dv], final [N, ...])
VarlenFn = Callable[..., tuple[torch.Tensor, torch.Tensor]]

# the most sequences a captured step holds (the padding sequence included): a larger step runs eagerly, its host
# cost then spread over many sequences, and the static states stay small (64 x 2 MiB at Qwen3.6's shape)
MAX_SEQS = 64


def seq_buckets(max_seqs: int) -> list[int]:
    """Sequence-count buckets (the padding sequence included): every count up to 8, then four steps per doubling
    (10, 12, 14, 16, 20, ...), up to ``max_seqs + 1`` (a full batch pads no empty sequence), at most ``MAX_SEQS``;
    none when steps hold one sequence. Fine steps because every sequence of a bucket costs the state kernel a read
    and a write of its state (2 MiB at Qwen3.6's shape) and the step's state copies as much, real or empty."""
    if max_seqs < 2:
        return []
    top = min(max_seqs + 1, MAX_SEQS)
    sizes, n = [], 2
    while n < top:
        sizes.append(n)
        n += 1 if n < 8 else (1 << (n.bit_length() - 1)) // 4
    return sizes + [top]


def chunk_count(lens: list[int]) -> int:
    """fla's chunks of a varlen step: each sequence rounded up to whole chunks."""
    return sum(-(-n // CHUNK_SIZE) for n in lens)


def padded_varlen_index(lens: list[int], num_seqs: int, num_chunks: int) -> tuple[list[int], list[tuple[int, int]]]:
    """``(cu_seqlens [num_seqs + 1], chunk_indices [num_chunks] of (sequence, chunk))`` for sequences of ``lens``
    packed from row 0, padded to the bucket: one padding sequence of the missing whole chunks right after the real
    rows, then empty sequences. Its rows end at most at ``num_chunks * CHUNK_SIZE``."""
    n, real = len(lens), chunk_count(lens)
    if n + 1 > num_seqs or real > num_chunks:
        raise ValueError(f"{n} sequences of {real} chunks do not fit the bucket ({num_seqs}, {num_chunks})")
    cu = [0]
    for length in lens:
        cu.append(cu[-1] + length)
    cu += [cu[-1] + (num_chunks - real) * CHUNK_SIZE] * (num_seqs - n)
    index = [(s, c) for s, length in enumerate(lens) for c in range(-(-length // CHUNK_SIZE))]
    index += [(n, c) for c in range(num_chunks - real)]
    return cu, index


class GdnBatchGraphs:
    """The several-sequence graphs beside one ``GdnPrefillGraphs`` (``single``): its staged buffers and chunk buckets
    (no reference to ``single`` itself, which holds this object: no cycle to keep both alive). ``emulate`` replays by
    calling the function again (CPU tests of the index and padding logic)."""

    def __init__(self, fn: VarlenFn, single: "GdnPrefillGraphs", max_seqs: int, emulate: bool = False):
        self.fn = fn
        self.emulate = emulate
        self.device = single.device
        self.qkv, self.q, self.k, self.v, self.gates, self.o = (
            single.qkv,
            single.q,
            single.k,
            single.v,
            single.gates,
            single.o,
        )
        self.seq_sizes = seq_buckets(max_seqs)
        self.chunk_sizes = [s // CHUNK_SIZE for s in single.sizes]
        n_max = self.seq_sizes[-1] if self.seq_sizes else 0
        nt_max = self.chunk_sizes[-1] if self.chunk_sizes else 0
        device, hv, dk, dv = single.device, *single.state.shape[1:]
        self.cu = torch.zeros(n_max + 1, dtype=torch.int64, device=device)
        self.chunk_index = torch.zeros(nt_max, 2, dtype=torch.int64, device=device)
        self.states = torch.zeros(n_max, hv, dk, dv, dtype=torch.float32, device=device)
        self.final = torch.zeros(n_max, hv, dk, dv, dtype=torch.float32, device=device)
        self.replay_fns: dict[tuple[int, int], Callable[[], None]] = {}
        self.loaded: Optional[tuple] = None  # (lens, bucket) whose index the buffers hold
        self._lookup: tuple = ((), None)  # the last step's (lens, bucket): its layers ask four times each
        self.replays = 0

    def buckets(self) -> list[tuple[int, int]]:
        """Every ``(Nb, NTb)`` a step can land in: a step in ``Nb`` holds at least as many sequences as the bucket
        below it, so at least as many chunks."""
        out = []
        for i, nb in enumerate(self.seq_sizes):
            least = self.seq_sizes[i - 1] if i else 1
            out += [(nb, nt) for nt in self.chunk_sizes if nt >= least]
        return out

    def bucket(self, lens: list[int]) -> Optional[tuple[int, int]]:
        """The smallest captured bucket holding sequences of ``lens`` (None: too many sequences, chunks or tokens)."""
        key = tuple(lens)
        if self._lookup[0] == key:
            return self._lookup[1]
        n, chunks = len(lens), chunk_count(lens)
        nb = next((s for s in self.seq_sizes if s > n), None)
        nt = next((s for s in self.chunk_sizes if s >= chunks), None)
        found = None if nb is None or nt is None or (nb, nt) not in self.replay_fns else (nb, nt)
        self._lookup = (key, found)
        return found

    def _body(self, nb: int, nt: int) -> Callable[[], None]:
        rows = nt * CHUNK_SIZE

        def body() -> None:
            # fresh views of the index every call: fla caches what it derives from cu_seqlens on the tensor object
            varlen = (self.cu[: nb + 1], self.chunk_index[:nt])
            o, final = self.fn(self.q[:rows], self.k[:rows], self.v[:rows], self.gates[0, :rows], self.gates[1, :rows],
                               self.states[:nb], varlen=varlen)  # fmt: skip
            self.o[:rows].copy_(o)
            self.final[:nb].copy_(final)

        return body

    def capture(self, pool=None) -> None:
        """Record every bucket, largest first, into ``pool`` (the one-sequence graphs', ``GdnPrefillGraphs.graph_pool``).
        The warm-up runs see a valid index (one sequence of every chunk, the rest empty)."""
        side = torch.cuda.Stream(self.device) if not self.emulate else None
        for nb, nt in sorted(self.buckets(), reverse=True):
            self._load([nt * CHUNK_SIZE - 1], (nb, nt))
            body = self._body(nb, nt)
            if self.emulate:
                self.replay_fns[(nb, nt)] = body
                continue
            self.replay_fns[(nb, nt)] = record_graph(body, side, self.device, pool)
        self.loaded, self._lookup = None, ((), None)
        if not self.emulate:
            torch.cuda.synchronize(self.device)

    def _load(self, lens: list[int], bucket: tuple[int, int]) -> None:
        """The step's padded index into the static buffers (skipped when they hold it: the step's later layers)."""
        key = (tuple(lens), bucket)
        if self.loaded == key:
            return
        cu, index = padded_varlen_index(lens, *bucket)
        pinned = self.device.type == "cuda"
        host_cu = torch.tensor(cu, dtype=torch.int64, pin_memory=pinned)
        host_index = torch.tensor(index, dtype=torch.int64, pin_memory=pinned).view(-1, 2)
        self.cu[: len(cu)].copy_(host_cu, non_blocking=pinned)
        self.chunk_index[: len(index)].copy_(host_index, non_blocking=pinned)
        self._host = (host_cu, host_index)  # alive until the next load, by when the copies have long run
        self.loaded = key

    def states_for(self, lens: list[int]) -> Optional[torch.Tensor]:
        """``[n, Hv, dk, dv]`` fp32 rows of the static initial states for the layer to gather a step's states into
        (one copy fewer per layer), or None when no bucket holds the step."""
        return self.states[: len(lens)] if self.bucket(lens) is not None else None

    def staging(self, lens: list[int]) -> Optional[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        """``(qkv, g, beta)`` for the step's conv and gates to write in place (as ``GdnPrefillGraphs.staging``), or
        None when no bucket holds the step."""
        if self.bucket(lens) is None:
            return None
        tokens = sum(lens)
        return self.qkv, self.gates[0, :tokens], self.gates[1, :tokens]

    def run(self, q, k, v, g, beta, initial_state, lens: list[int]):
        """The step's ``(o [T, Hv, dv], final [n, Hv, dk, dv] fp32)`` from its bucket's graph, both views of the
        graphs' buffers (valid until the next replay); None when no bucket holds it (the caller runs eagerly).
        Inputs as the varlen function takes them (``[T, H, *]``, the staged buffers or anywhere else)."""
        bucket = self.bucket(lens)
        if bucket is None:
            return None
        n, T = len(lens), q.shape[0]
        for src, buf in ((q, self.q), (k, self.k), (v, self.v), (g, self.gates[0]), (beta, self.gates[1])):
            if src.data_ptr() != buf.data_ptr() or src.stride() != buf[:T].stride():
                buf[:T].copy_(src)
        rows = bucket[1] * CHUNK_SIZE
        self.gates[:, T:rows].zero_()  # the padding sequence: no decay, no write
        if initial_state.data_ptr() != self.states.data_ptr():  # else gathered in place (``states_for``)
            self.states[:n].copy_(initial_state)
        self.states[n : n + 1].zero_()
        self._load(lens, bucket)
        self.replay_fns[bucket]()
        self.replays += 1
        return self.o[:T], self.final[:n]


def capture_batch_graphs(fn: VarlenFn, single: "GdnPrefillGraphs", max_seqs: int) -> Optional[GdnBatchGraphs]:
    """The batch graphs beside ``single``, captured into its pool; None when none would be used (one running request,
    no one-sequence buckets) or their capture fails: that is logged as an error and such steps run eagerly (an
    optimization's failure does not stop the server)."""
    batch = GdnBatchGraphs(fn, single, max_seqs, emulate=single.emulate)
    if not batch.seq_sizes or not batch.chunk_sizes:
        return None
    try:
        batch.capture(None if single.emulate else single.graph_pool())
    except Exception as e:
        from ..log import get_logger

        first = str(e).splitlines()[0] if str(e) else ""
        get_logger(__name__).error(
            f"GDN batch graphs not captured ({type(e).__name__}: {first}); steps of several sequences run eagerly"
        )
        return None
    return batch
