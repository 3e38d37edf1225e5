"""CUDA graphs of one sequence's Gated DeltaNet prefill (fla's chunked forward), by padded length.

A cached agent turn (issue 12: ~2,200 new tokens after ~28,000 cached) is host-bound: fla's chunked forward costs
~0.95 ms of Python and Triton launch work per GDN layer against ~0.16 ms on the device (bench/fla_host_cost.py on
the H200), 30 layers a step. Replaying a graph costs a few microseconds of host time.

A graph fixes its shapes, so a sequence of T tokens runs in the graph of the smallest bucket ``Tb >= T``
(``bucket_sizes``: multiples of fla's 64-token chunk, at most ~25 % padding). The padding tokens get ``g = 0`` and
``beta = 0``: in the delta rule ``S <- exp(g)·S + beta·k ⊗ (v - kᵀS)`` they leave the state as it was (no decay, no
write), and no real token reads a later one, so the first T outputs and the final state are those of the unpadded
call (fla's launch configurations do not depend on T: same kernels, same tiles). The inputs live in static buffers
sized for the largest bucket, shared by every bucket and layer (GDN layers of a model share one shape); every graph
allocates from one private pool, and replays never overlap (one stream), so the pool holds one bucket's
intermediates.

The layer stages a chunk's inputs in those buffers itself (``staging``: the conv writes q | k | v there as three
contiguous blocks, the gates kernel g and beta), so a replay copies nothing in; inputs given elsewhere are copied.
A snapshot round runs the chunk's first piece from the staged buffers while later pieces (the tail after a grid
point) still need theirs: the padding a replay zeroes is saved and put back around it. A later piece is copied to
the buffers' head and replayed when it starts past the rows its bucket reads (a short tail after a fresh prompt's
grid point: ``gated_deltanet.token_by_token``), else it runs eagerly. ``run(borrow=True)``
returns views of the graph's outputs, valid until the next replay (the layer reads them first); else copies.

Captured at start-up before the KV pool is sized (``startup.capture_gdn_prefill_graphs``): what they hold is in
the memory plan. ``--gdn-prefill-graph-tokens`` is the largest bucket (0: none); a longer piece or a snapshot round runs
eagerly where it does not fit a bucket. Steps of several sequences replay the graphs of ``gdn_batch_graphs.py``
(``batch``), which share these buffers and this pool.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch

from .gated_deltanet import CHUNK_SIZE

# fn(q, k, v, g, beta, initial_state) -> (o [T, Hv, dv], final [1, Hv, dk, dv]): one sequence, eagerly
PrefillFn = Callable[..., tuple[torch.Tensor, torch.Tensor]]


def bucket_sizes(max_tokens: int) -> list[int]:
    """Padded lengths up to ``max_tokens`` (rounded down to the chunk): every chunk multiple up to 512, then four
    steps per doubling (640, 768, 896, 1024, 1280, ...), so a piece is padded by at most a quarter."""
    top = max_tokens // CHUNK_SIZE * CHUNK_SIZE
    sizes, s = [], CHUNK_SIZE
    while s <= top:
        sizes.append(s)
        s += max(CHUNK_SIZE, (1 << (s.bit_length() - 1)) // 4)
    if sizes and sizes[-1] != top:
        sizes.append(top)
    return sizes


def record_graph(body: Callable[[], None], side, device: torch.device, pool) -> Callable[[], None]:
    """``body`` run twice on the ``side`` stream (Triton compiles and fla's autotuning happen outside the capture),
    then captured into ``pool``; returns the graph's replay (the bound method keeps the graph alive)."""
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side), torch.inference_mode():
        for _ in range(2):
            body()
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.inference_mode(), torch.cuda.graph(graph, pool=pool):
        body()
    return graph.replay


class GdnPrefillGraphs:
    """The graphs of one GDN shape (``Hk`` key heads, ``Hv`` value heads, ``dk x dv`` state) on one device.
    ``emulate`` replays by calling the function again (CPU tests of the buffer and padding logic)."""

    def __init__(
        self,
        fn: PrefillFn,
        num_k_heads: int,
        num_v_heads: int,
        head_k_dim: int,
        head_v_dim: int,
        dtype: torch.dtype,
        device: torch.device,
        max_tokens: int,
        emulate: bool = False,
    ):
        self.fn = fn
        self.device = device
        self.emulate = emulate
        self.sizes = bucket_sizes(max_tokens)
        top = self.sizes[-1] if self.sizes else 0
        hk, hv, dk, dv = num_k_heads, num_v_heads, head_k_dim, head_v_dim
        self.top = top
        self.parts = (hk * dk, hk * dk, hv * dv)  # the conv output's q | k | v columns
        # q, k and v as three [top, width] blocks, one after another (the conv's ``parts`` layout)
        self.qkv = torch.zeros(top * sum(self.parts), dtype=dtype, device=device)
        nq = top * hk * dk
        self.q = self.qkv[:nq].view(top, hk, dk)
        self.k = self.qkv[nq : 2 * nq].view(top, hk, dk)
        self.v = self.qkv[2 * nq :].view(top, hv, dv)
        self.gates = torch.zeros(2, top, hv, dtype=torch.float32, device=device)  # g | beta: one fill clears both
        self.staged = 0  # tokens the layer last staged in the buffers (rows past a piece that a replay must keep)
        self.state = torch.zeros(1, hv, dk, dv, dtype=torch.float32, device=device)
        self.o = torch.zeros(top, hv, dv, dtype=dtype, device=device)
        self.final = torch.zeros(1, hv, dk, dv, dtype=torch.float32, device=device)
        self.replay_fns: dict[int, Callable[[], None]] = {}  # bucket -> its graph's replay
        self.pool = None
        self.replays = 0
        # steps of several sequences (``gdn_batch_graphs.GdnBatchGraphs``, on these buffers), set at start-up
        self.batch = None

    def bucket(self, tokens: int) -> Optional[int]:
        """The smallest bucket holding ``tokens`` (None: longer than the largest, or nothing captured)."""
        for s in self.sizes:
            if s >= tokens:
                return s if s in self.replay_fns else None
        return None

    def _body(self, T: int) -> Callable[[], None]:
        def body() -> None:
            o, final = self.fn(self.q[:T], self.k[:T], self.v[:T], self.gates[0, :T], self.gates[1, :T], self.state)
            self.o[:T].copy_(o)
            self.final.copy_(final)

        return body

    def capture(self) -> None:
        """Record every bucket, largest first (the pool grows once, to the largest's intermediates)."""
        side = torch.cuda.Stream(self.device) if not self.emulate else None
        for T in reversed(self.sizes):
            body = self._body(T)
            if self.emulate:
                self.replay_fns[T] = body
                continue
            self.replay_fns[T] = record_graph(body, side, self.device, self.graph_pool())
        if not self.emulate:
            torch.cuda.synchronize(self.device)

    def graph_pool(self):
        """The private memory pool of these graphs (and the batch graphs'), made on first use."""
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        return self.pool

    def staging(self, tokens: int) -> Optional[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        """``(qkv, g, beta)`` for a chunk of ``tokens`` to be written in place (``qkv``: the conv's flat ``parts``
        buffer of ``top`` rows; ``g, beta [tokens, Hv]``), or None when no bucket holds the chunk."""
        if self.bucket(tokens) is None:
            return None
        self.staged = tokens
        return self.qkv, self.gates[0, :tokens], self.gates[1, :tokens]

    def _place(self, src: torch.Tensor, buf: torch.Tensor, Tb: int) -> Optional[bool]:
        """Whether ``src`` is already ``buf[:T]`` (True) or must be copied there (False); None when it lies
        elsewhere in the static buffers where a copy would overwrite itself (a later piece of a staged chunk that
        starts inside the rows a replay of bucket ``Tb`` reads: the caller runs it eagerly). A later piece that
        starts at or past row ``Tb`` of its buffer (a short tail after a grid point) is copied to the head."""
        if src.data_ptr() == buf.data_ptr() and src.stride() == buf[: src.shape[0]].stride():
            return True
        for owner in (self.qkv, self.gates):
            lo = owner.data_ptr()
            if lo <= src.data_ptr() < lo + owner.numel() * owner.element_size():
                row_bytes = buf.stride(0) * buf.element_size()
                offset = src.data_ptr() - buf.data_ptr()
                in_buf = 0 <= offset < buf.numel() * buf.element_size() and src.stride() == buf.stride()
                return False if in_buf and offset % row_bytes == 0 and offset // row_bytes >= Tb else None
        return False

    def run(self, q, k, v, g, beta, initial_state, borrow: bool = False):
        """One sequence's ``(o [T, Hv, dv], final [1, Hv, dk, dv] fp32)``, as ``fn`` gives them, from the graph of
        its bucket; None when no bucket holds it (the caller runs ``fn`` eagerly). Inputs as ``fn`` takes them
        (``[T, H, *]``, possibly strided views, or the staged buffers; ``initial_state [1, Hv, dk, dv]``).
        ``borrow``: the outputs are the graph's buffers, overwritten by the next replay."""
        T = q.shape[0]
        Tb = self.bucket(T)
        if Tb is None or initial_state.shape[0] != 1:
            return None
        pairs = ((q, self.q), (k, self.k), (v, self.v), (g, self.gates[0]), (beta, self.gates[1]))
        placed = [self._place(src, buf, Tb) for src, buf in pairs]
        if None in placed:
            return None
        for (src, buf), in_place in zip(pairs, placed):
            if not in_place:
                buf[:T].copy_(src)
        # rows of a staged chunk past this piece: its later pieces' gates, which the padding below overwrites
        keep = min(Tb, self.staged) if placed[3] else T
        saved = self.gates[:, T:keep].clone() if keep > T else None
        if Tb > T:
            self.gates[:, T:Tb].zero_()  # padding tokens: no decay, no write
        self.state.copy_(initial_state)
        self.replay_fns[Tb]()
        self.replays += 1
        if saved is not None:
            self.gates[:, T:keep].copy_(saved)
        if borrow:
            return self.o[:T], self.final
        return self.o[:T].clone(), self.final.clone()
