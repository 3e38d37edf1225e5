"""CUDA graphs of the sparse MoE blocks' prefill-sized steps, by padded token count.

A cached agent turn (issue 12: ~2,200 new tokens after ~28,000 cached) is bound by the host's time to enqueue it:
~54 ms for 40 layers served, level with the device's time in the GDN layers, so the device waits there. Eagerly a
resident MoE block is nine launches (the fused router | shared expert projection, top-k, the shared expert's
activation and down projection, the alignment plan and scatter, the two grouped GEMMs, the combine) with their
Python wrappers and allocations: ~0.25 ms of host time a layer, 40 layers a step. A replay is one graph launch.

The MoE is per token, so one graph serves any step whose tokens fit its bucket (one sequence or several, prefill or
a large eager decode batch). A step of T tokens runs in the graph of the smallest bucket ``Tb >= T``
(``gdn_prefill_graphs.bucket_sizes``: at most a quarter of padding). Padding rows are routed to no expert: the
block routes them as usual, then ``drop_padding_rows`` sets their ids to ``num_experts``, which the grouped kernels'
alignment drops (NVFP4 banks send them to their all-zero dummy expert). They cost only their rows of the dense
router | shared projection and of the combine. ``T`` reaches the graph as a device scalar, written only when it
changes.

One object serves every block of a model: the input and output buffers (``[top, H]``) and one private memory
pool are shared, since replays never overlap (one stream) and each block's output is read (by the next layer's
residual add) before the next block replays. ``run`` returns a view of the output buffer: valid until the next
MoE replay. Graphs are per (layer, bucket): a block's weights are addresses in its kernels. Nothing is copied in
or out: the decoder layer's norm before the block writes straight into the input buffer (``input_rows``), and the
experts' combine writes the output buffer (``out=``).

Captured at start-up before the KV pool is sized (``startup.capture_moe_prefill_graphs``), in the memory plan, and
checked there against the eager block on the same padded input (``check``). ``--moe-prefill-graph-tokens`` is the
largest bucket (0: none). Steps outside the buckets, decode-sized steps (the decode kernels, or the decode graphs),
another graph's capture, a benchmark routing mode changed since capture, or ``FREETOKEN_MOE_PREFILL_GRAPHS=0``
(an A/B switch) run eagerly.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Optional

import torch

from ..moe import bench_routing
from ..tuning_env import switch_from_env
from .gdn_prefill_graphs import bucket_sizes

if TYPE_CHECKING:
    from .moe import SparseMoeBlock


def graphs_switched_on() -> bool:
    """``FREETOKEN_MOE_PREFILL_GRAPHS=0`` runs the blocks eagerly, graphs captured or not: an in-process A/B switch
    (``bench/profile_prefill.py --env-ab``), read at every step."""
    return switch_from_env("FREETOKEN_MOE_PREFILL_GRAPHS")


def drop_padding_rows(ids: torch.Tensor, valid_rows: torch.Tensor, num_experts: int) -> torch.Tensor:
    """``ids [T, k]`` with every row at or past ``valid_rows`` (a device scalar) routed to ``num_experts``: no
    expert. Fixed-shape device work (capturable)."""
    rows = torch.arange(ids.shape[0], device=ids.device)
    return torch.where(rows[:, None] < valid_rows, ids, num_experts)


class MoePrefillGraphs:
    """The prefill graphs of a model's MoE blocks on one device. ``emulate`` replays by calling the block again
    (CPU tests of the buffers, the padding and the dispatch)."""

    def __init__(self, hidden_size: int, dtype: torch.dtype, device: torch.device, max_tokens: int, min_tokens: int,
                 emulate: bool = False):  # fmt: skip
        """``min_tokens``: the shortest step that runs here (shorter ones take the decode kernels)."""
        self.device = device
        self.emulate = emulate
        self.min_tokens = min_tokens
        self.sizes = [s for s in bucket_sizes(max_tokens) if s >= min_tokens] if max_tokens >= min_tokens else []
        top = self.sizes[-1] if self.sizes else 0
        self.x = torch.zeros(top, hidden_size, dtype=dtype, device=device)
        self.out = torch.zeros(top, hidden_size, dtype=dtype, device=device)
        self.valid = torch.zeros((), dtype=torch.int64, device=device)  # T of the step being replayed
        self._valid_host = -1
        self.replay_fns: dict[tuple[int, int], Callable[[], None]] = {}  # (layer id, bucket) -> replay
        self.pool = None
        self.routing = bench_routing.mode()  # the benchmark routing the graphs hold
        self.replays = 0
        self.copies_in = 0  # replays whose input was not already in the buffer (``input_rows``)
        self._found: tuple = (None, 0, None)  # (layer id, tokens, replay) that ``input_rows`` looked up for ``run``

    def bucket(self, tokens: int) -> Optional[int]:
        """The smallest bucket holding ``tokens`` (None: outside the buckets)."""
        if tokens < self.min_tokens:
            return None
        for s in self.sizes:
            if s >= tokens:
                return s
        return None

    def _set_valid(self, tokens: int) -> None:
        if self._valid_host != tokens:
            self.valid.fill_(tokens)
            self._valid_host = tokens

    def _body(self, block: "SparseMoeBlock", Tb: int) -> Callable[[], None]:
        def body() -> None:
            out = self.out[:Tb]
            y = block.compute(self.x[:Tb], valid_rows=self.valid, out=out)
            if y.data_ptr() != out.data_ptr():  # a backend that returned its own tensor
                out.copy_(y)

        return body

    def _eagerly(self, bodies: list[Callable[[], None]]) -> None:
        """Run ``bodies`` on a side stream, outside any capture."""
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side), torch.inference_mode():
            for body in bodies:
                body()
        torch.cuda.current_stream(self.device).wait_stream(side)

    def capture(self, blocks: list["SparseMoeBlock"]) -> None:
        """Record every (block, bucket), largest bucket first (the pool grows once, to its intermediates). Every
        block runs eagerly first at the smallest and the largest bucket (state a layer builds on its first call,
        such as a benchmark routing table, cannot be built inside a capture), and each bucket twice in the first
        block (compiles, cuBLAS workspaces)."""
        if not self.emulate:
            for Tb in sorted({self.sizes[0], self.sizes[-1]}):
                self._set_valid(Tb)
                self._eagerly([self._body(block, Tb) for block in blocks])
        for Tb in reversed(self.sizes):
            self._set_valid(Tb)
            for i, block in enumerate(blocks):
                body = self._body(block, Tb)
                if self.emulate:
                    self.replay_fns[(block.layer_id, Tb)] = body
                    continue
                if i == 0:
                    self._eagerly([body, body])
                graph = torch.cuda.CUDAGraph()
                if self.pool is None:
                    self.pool = torch.cuda.graph_pool_handle()
                with torch.inference_mode(), torch.cuda.graph(graph, pool=self.pool):
                    body()
                self.replay_fns[(block.layer_id, Tb)] = graph.replay  # the bound method keeps the graph alive
        if not self.emulate:
            torch.cuda.synchronize(self.device)

    def _replay_for(self, block: "SparseMoeBlock", tokens: int) -> Optional[Callable[[], None]]:
        """The replay that runs ``block`` on a step of ``tokens`` (None: the step runs eagerly)."""
        Tb = self.bucket(tokens)
        if Tb is None or bench_routing.mode() != self.routing or not graphs_switched_on():
            return None
        replay = self.replay_fns.get((block.layer_id, Tb))
        if replay is None or (not self.emulate and torch.cuda.is_current_stream_capturing()):
            return None
        return replay

    def input_rows(self, block: "SparseMoeBlock", tokens: int) -> Optional[torch.Tensor]:
        """The input buffer's first ``tokens`` rows when a graph will run the step (the layer's norm writes its
        output there, and ``run`` copies nothing in), else None."""
        replay = self._replay_for(block, tokens)
        self._found = (block.layer_id, tokens, replay)  # ``run`` of the same layer and step needs no second lookup
        return self.x[:tokens] if replay is not None else None

    def run(self, block: "SparseMoeBlock", x: torch.Tensor) -> Optional[torch.Tensor]:
        """The block's output for ``x [T, H]`` from its graph (a view of the shared output buffer, valid until the
        next MoE replay); None when no graph holds the step (the caller runs the block eagerly)."""
        T = x.shape[0]
        layer, tokens, replay = self._found
        self._found = (None, 0, None)
        if layer != block.layer_id or tokens != T:
            replay = self._replay_for(block, T)
        if replay is None:
            return None
        if x.data_ptr() != self.x.data_ptr():
            self.x[:T].copy_(x)
            self.copies_in += 1
        self._set_valid(T)
        replay()
        self.replays += 1
        return self.out[:T]

    @torch.inference_mode()
    def check(self, block: "SparseMoeBlock", seed: int = 0) -> None:
        """Replay ``block``'s graphs of the smallest and the largest bucket on a step a few tokens short of each and
        compare with the eager block on the same padded input (raises AssertionError on a mismatch). Skipped under
        a benchmark routing that draws at random (the two runs would route differently)."""
        if self.routing in ("uniform", "zipf"):
            return
        g = torch.Generator(device="cpu").manual_seed(seed)
        for Tb in sorted({self.sizes[0], self.sizes[-1]}):
            T = max(self.min_tokens, Tb - 5)
            if self.bucket(T) != Tb:
                T = Tb
            x = torch.randn(T, self.x.shape[1], generator=g).to(self.device, self.x.dtype)
            got = self.run(block, x)
            assert got is not None, f"no MoE prefill graph for {T} tokens"
            got = got.clone()
            want = block.compute(self.x[:Tb], valid_rows=self.valid)[:T]
            torch.testing.assert_close(got, want, msg=lambda m: f"MoE prefill graph ({Tb} tokens) vs eager: {m}")
        self.replays = self.copies_in = 0  # the counters say what serving did
