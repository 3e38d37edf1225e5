"""Sparse MoE blocks from CUDA graphs by padded token count (``layers/moe_prefill_graphs.py``): padding rows routed
to no expert, the shared buffers, the steps that decline, against the block run eagerly on the unpadded step: on the
CPU with emulated graphs (torch experts; Triton experts under the interpreter, audited for host syncs), on CUDA in
real graphs, and through start-up (the memory-plan row, a failed check falling back to eager) and a whole hybrid
model's greedy tokens with and without the graphs."""

from __future__ import annotations

import gc
import logging
import os
import textwrap

import hf_reference as R  # noqa: F401  (blocks fla before transformers is imported)
import pytest
import torch
from triton_interpreter import run_under_interpreter

from freetoken.layers.moe import SparseMoeBlock
from freetoken.layers.moe_prefill_graphs import MoePrefillGraphs, drop_padding_rows
from freetoken.models.base import ModelConfig
from freetoken.moe import bench_routing

torch.set_num_threads(1)


def make_block(layer_id=0, seed=0, E=8, k=2, H=32, dtype=torch.float32, device="cpu", impl=None):
    """A Qwen3.5-style block (shared expert, fused projections) with random weights."""
    cfg = dict(
        model_type="qwen3_5_moe_text",
        hidden_size=H,
        num_experts=E,
        num_experts_per_tok=k,
        moe_intermediate_size=24,
        shared_expert_intermediate_size=16,
        hidden_act="silu",
    )
    block = SparseMoeBlock(ModelConfig.from_dict(cfg), layer_id=layer_id)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in block.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    block.fuse_projections()
    if impl is not None:
        block.experts.impl = impl
    return block.to(device, dtype)


class RecordIds:
    """Wraps a block's experts backend: keeps the ids of every call."""

    def __init__(self, block):
        self.calls = []
        self.inner = block.experts.forward
        block.experts.forward = self

    def __call__(self, x, ids, w, shared=None, out=None):
        self.calls.append(ids.clone())
        return self.inner(x, ids, w, shared, out=out)


def test_drop_padding_rows():
    ids = torch.tensor([[1, 2], [3, 0], [2, 2]])
    got = drop_padding_rows(ids, torch.tensor(2), 8)
    assert got.tolist() == [[1, 2], [3, 0], [8, 8]]
    assert drop_padding_rows(ids, torch.tensor(3), 8).tolist() == ids.tolist()


def test_emulated_graphs_equal_the_eager_block_across_buckets_and_stale_padding():
    """Steps of several lengths, in an order that leaves longer steps' rows in the padding, through two blocks
    sharing one graphs object: each output equals the block run eagerly on the unpadded step, and the padding rows
    reach the experts routed to no expert."""
    blocks = [make_block(layer_id=i, seed=i) for i in range(2)]
    graphs = MoePrefillGraphs(32, torch.float32, torch.device("cpu"), max_tokens=320, min_tokens=33, emulate=True)
    assert graphs.sizes == [64, 128, 192, 256, 320]
    graphs.capture(blocks)
    assert len(graphs.replay_fns) == 2 * 5
    records = [RecordIds(b) for b in blocks]
    for b in blocks:
        b.prefill_graphs = graphs
    g = torch.Generator().manual_seed(5)
    replays = 0
    for n in (300, 40, 64, 130, 257, 33):
        x = torch.randn(n, 32, generator=g)
        for b, rec in zip(blocks, records):
            got = b(x).clone()
            replays += 1
            ids = rec.calls[-1]
            Tb = graphs.bucket(n)
            assert ids.shape[0] == Tb and (ids[n:] == 8).all() and (ids[:n] < 8).all()
            b.prefill_graphs = None
            want = b(x)
            b.prefill_graphs = graphs
            assert got.shape == want.shape == (n, 32)
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert graphs.replays == replays


def test_steps_outside_the_buckets_or_another_routing_decline(monkeypatch):
    """Decode-sized steps (the decode kernels' side), steps past the largest bucket, a block without graphs, a
    benchmark routing mode other than the captured one and the A/B switch run eagerly (run returns None)."""
    block = make_block()
    graphs = MoePrefillGraphs(32, torch.float32, torch.device("cpu"), max_tokens=128, min_tokens=33, emulate=True)
    graphs.capture([block])
    x = torch.randn(200, 32)
    assert graphs.run(block, x[:32]) is None
    assert graphs.run(block, x[:129]) is None
    assert graphs.run(make_block(layer_id=3), x[:40]) is None
    assert graphs.run(block, x[:40]) is not None
    saved = bench_routing.mode()
    try:
        bench_routing.set_mode("uniform" if saved != "uniform" else "off")
        assert graphs.run(block, x[:40]) is None
    finally:
        bench_routing.set_mode(saved)
    monkeypatch.setenv("FREETOKEN_MOE_PREFILL_GRAPHS", "0")
    assert graphs.run(block, x[:40]) is None
    monkeypatch.delenv("FREETOKEN_MOE_PREFILL_GRAPHS")
    assert graphs.replays == 1
    assert MoePrefillGraphs(32, torch.float32, torch.device("cpu"), 32, 33, emulate=True).sizes == []


def test_check_catches_a_graph_that_differs_from_the_eager_block():
    """``check`` (start-up's) compares each end bucket with the eager block: a replay that computes something else
    fails it."""
    block = make_block()
    graphs = MoePrefillGraphs(32, torch.float32, torch.device("cpu"), max_tokens=192, min_tokens=33, emulate=True)
    graphs.capture([block])
    graphs.check(block)
    good = graphs.replay_fns[(0, 192)]
    graphs.replay_fns[(0, 192)] = lambda: (good(), graphs.out.mul_(1.01))
    with pytest.raises(AssertionError, match="MoE prefill graph"):
        graphs.check(block)


def test_check_is_skipped_under_a_random_benchmark_routing():
    """Under ``FREETOKEN_BENCH_ROUTING=uniform`` the replay and the eager run draw different experts: no comparison
    (a failed check would switch the graphs off for the benchmark that measures them)."""
    saved = bench_routing.mode()
    try:
        bench_routing.set_mode("uniform")
        block = make_block()
        graphs = MoePrefillGraphs(32, torch.float32, torch.device("cpu"), max_tokens=128, min_tokens=33, emulate=True)
        graphs.capture([block])
        good = graphs.replay_fns[(0, 128)]
        graphs.replay_fns[(0, 128)] = lambda: (good(), graphs.out.mul_(1.01))
        graphs.check(block)
        assert graphs.run(block, torch.randn(100, 32)) is not None  # still replayed under the captured mode
    finally:
        bench_routing.set_mode(saved)


_INTERPRETER_SCRIPT = textwrap.dedent(
    """
    import sys, torch
    sys.path.insert(0, {tests!r})
    from test_moe_prefill_graphs import make_block
    from freetoken.engine.sync_audit import no_host_sync
    from freetoken.layers.moe_prefill_graphs import MoePrefillGraphs

    # the Triton experts (resident BF16 kernels: alignment drops the padding rows), each replay audited as a CUDA
    # graph's body would be: no host sync, no data-dependent shape
    block = make_block(impl="triton", E=8, k=2, H=32)
    graphs = MoePrefillGraphs(32, torch.float32, torch.device("cpu"), max_tokens=128, min_tokens=33, emulate=True)
    graphs.capture([block])
    for Tb, fn in list(graphs.replay_fns.items()):
        graphs.replay_fns[Tb] = lambda fn=fn: no_host_sync_run(fn)

    def no_host_sync_run(fn):
        with no_host_sync():
            fn()

    block.prefill_graphs = graphs
    g = torch.Generator().manual_seed(1)
    for n in (100, 35, 64):
        x = torch.randn(n, 32, generator=g)
        got = block(x).clone()
        block.prefill_graphs = None
        block.experts.impl = "torch"
        want = block(x)
        block.experts.impl = "triton"
        block.prefill_graphs = graphs
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    assert graphs.replays == 3
    # the grouped kernels' combine writes the block's output where it is told (the graphs' output rows)
    buf = torch.zeros(100, 32)
    assert block.compute(torch.randn(100, 32, generator=g), out=buf).data_ptr() == buf.data_ptr() and buf.any()
    print("OK")
    """
)


def test_triton_experts_in_emulated_graphs_under_the_interpreter_no_host_sync():
    run_under_interpreter(_INTERPRETER_SCRIPT)


# ---------------------------------------------------------------------------------------------------- start-up


def _tiny_hybrid(tmp_path, seed=12):
    d = str(tmp_path / "tiny-qwen3_5_moe")
    os.makedirs(d, exist_ok=True)
    R.write_released_qwen3_5_moe(d, seed=seed, max_position_embeddings=4096)
    return d


def test_cpu_model_greedy_tokens_equal_with_and_without_emulated_graphs(tmp_path):
    """A tiny hybrid model on the CPU with emulated CUDA graphs: prompts short of, inside and past the buckets,
    greedy, with the MoE prefill graphs (start-up captures them: a memory-plan row) and with
    ``moe_prefill_graph_tokens=0``: the same tokens, and the graphs replayed."""
    from freetoken import LLM, SamplingParams
    from freetoken.layers.moe import SparseMoeBlock as Block

    d = _tiny_hybrid(tmp_path)
    prompts = [list(range(3, 3 + n)) for n in (5, 70, 200)]
    args = dict(device="cpu", dtype="float32", max_seq_len_override=1024, load_progress=False, emulate_cuda_graphs=True)
    outs = {}
    for tokens in (128, 0):
        llm = LLM(d, moe_prefill_graph_tokens=tokens, max_prefill_length=256, **args)
        plan = llm.worker.memory_plan
        graphs = {b.prefill_graphs for b in llm.worker.model.modules() if isinstance(b, Block)}
        assert (plan.moe_graph_sizes[-1] if tokens else None) == (128 if tokens else None)
        outs[tokens] = [llm.generate(p, SamplingParams(max_tokens=6, ignore_eos=True))[0] for p in prompts]
        if tokens:
            (g,) = graphs
            assert g is not None and g.replays > 0
            assert g.copies_in == 0  # the decoder layers' norms wrote every replay's input in place
        else:
            assert graphs == {None}
        del llm
    for with_graphs, without in zip(outs[128], outs[0]):
        assert with_graphs.token_ids == without.token_ids
        assert max(abs(a - b) for a, b in zip(with_graphs.logprobs, without.logprobs)) < 1e-4


def test_a_failed_startup_check_is_logged_and_the_blocks_run_eagerly(tmp_path, monkeypatch, caplog):
    """Fault injection: the start-up check fails (as a graph computing something else would): the error is logged,
    no block keeps the graphs, the memory plan has no row, and the model still answers."""
    from freetoken import LLM, SamplingParams
    from freetoken.layers.moe import SparseMoeBlock as Block

    def broken(self, block, seed=0):
        raise AssertionError("MoE prefill graph (64 tokens) vs eager: injected")

    monkeypatch.setattr(MoePrefillGraphs, "check", broken)
    d = _tiny_hybrid(tmp_path)
    logging.getLogger("freetoken").addHandler(caplog.handler)
    try:
        llm = LLM(d, device="cpu", dtype="float32", max_seq_len_override=512, load_progress=False,
                  emulate_cuda_graphs=True, moe_prefill_graph_tokens=128)  # fmt: skip
    finally:
        logging.getLogger("freetoken").removeHandler(caplog.handler)
    errors = [m for m in caplog.messages if "MoE prefill CUDA graphs failed" in m]
    assert errors and "injected" in errors[0], caplog.messages
    assert all(b.prefill_graphs is None for b in llm.worker.model.modules() if isinstance(b, Block))
    assert llm.worker.memory_plan.moe_graph_sizes == ()
    out = llm.generate(list(range(3, 80)), SamplingParams(max_tokens=3, ignore_eos=True))[0]
    assert len(out.token_ids) == 3


def test_switched_off_at_start_up_captures_nothing(tmp_path, monkeypatch, caplog):
    """``FREETOKEN_MOE_PREFILL_GRAPHS=0`` in the server's environment: nothing captured, said once (not an error)."""
    from freetoken.worker import Worker

    monkeypatch.setenv("FREETOKEN_MOE_PREFILL_GRAPHS", "0")
    d = _tiny_hybrid(tmp_path)
    logging.getLogger("freetoken").addHandler(caplog.handler)
    try:
        w = Worker({"model_path": d, "device": "cpu", "dtype": "float32", "num_tokens": 1024, "load_progress": False,
                    "max_seq_len_override": 512, "emulate_cuda_graphs": True, "moe_prefill_graph_tokens": 128})  # fmt: skip
    finally:
        logging.getLogger("freetoken").removeHandler(caplog.handler)
    assert w.memory_plan.moe_graph_sizes == ()
    assert [m for m in caplog.messages if "MoE prefill" in m] == [
        "FREETOKEN_MOE_PREFILL_GRAPHS=0: no MoE prefill CUDA graphs captured"
    ]


def test_offloaded_experts_stay_eager_and_the_flag_says_so(tmp_path, caplog):
    """``--moe-backend offload`` plans its transfers on the host step by step: no block is captured, even in the
    CPU emulation, and a non-default flag value is said to do nothing."""
    from freetoken.layers.moe import SparseMoeBlock as Block
    from freetoken.worker import Worker

    d = _tiny_hybrid(tmp_path)
    logging.getLogger("freetoken").addHandler(caplog.handler)
    try:
        w = Worker({"model_path": d, "device": "cpu", "dtype": "float32", "num_tokens": 1024, "load_progress": False,
                    "max_seq_len_override": 512, "moe_backend": "offload", "emulate_cuda_graphs": True,
                    "moe_prefill_graph_tokens": 128})  # fmt: skip
    finally:
        logging.getLogger("freetoken").removeHandler(caplog.handler)
    assert all(b.prefill_graphs is None for b in w.model.modules() if isinstance(b, Block))
    assert w.memory_plan.moe_graph_sizes == ()
    notes = [m for m in caplog.messages if "--moe-prefill-graph-tokens" in m]
    assert notes == ["--moe-prefill-graph-tokens 128: no effect, its experts are not resident on the device "
                     "(--moe-backend offload / hybrid)"], notes  # fmt: skip


def test_flag_on_a_model_without_moe_is_logged(tiny_llama_dir, caplog):
    """Set on a dense model it is accepted and said to do nothing; at its default it is not mentioned."""
    from freetoken.worker import Worker

    logging.getLogger("freetoken").addHandler(caplog.handler)
    try:
        for tokens in (2048, None):
            Worker({"model_path": tiny_llama_dir, "device": "cpu", "num_tokens": 256, "load_progress": False,
                    "emulate_cuda_graphs": True, "moe_prefill_graph_tokens": tokens})  # fmt: skip
    finally:
        logging.getLogger("freetoken").removeHandler(caplog.handler)
    notes = [m for m in caplog.messages if "--moe-prefill-graph-tokens" in m]
    assert notes == ["--moe-prefill-graph-tokens 2048: no effect, the model has no sparse MoE blocks"], notes


# ---------------------------------------------------------------------------------------------------- CUDA

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_cuda_graphs_equal_the_eager_block(dtype):
    """Real graphs at a Qwen3.6-like width (256 experts, top 8): several lengths in every bucket region, each
    replay against the eager block on the same padded input (same kernels: equal to rounding) and on the unpadded
    step (the dense projection's GEMM may tile another M differently: close)."""
    torch.manual_seed(0)
    blocks = [make_block(layer_id=i, seed=i, E=256, k=8, H=256, dtype=dtype, device="cuda") for i in range(2)]
    graphs = MoePrefillGraphs(256, dtype, torch.device("cuda"), max_tokens=1024, min_tokens=9)
    graphs.capture(blocks)
    graphs.check(blocks[0])
    for b in blocks:
        b.prefill_graphs = graphs
    tol = dict(atol=2e-2, rtol=2e-2) if dtype == torch.bfloat16 else dict(atol=1e-4, rtol=1e-4)
    for n in (1000, 9, 64, 65, 500, 700):
        x = torch.randn(n, 256, device="cuda", dtype=dtype)
        for b in blocks:
            got = b(x).clone()
            Tb = graphs.bucket(n)
            padded = b.compute(graphs.x[:Tb], valid_rows=graphs.valid)[:n]
            torch.testing.assert_close(got, padded, **tol)
            b.prefill_graphs = None
            torch.testing.assert_close(got, b(x), **tol)
            b.prefill_graphs = graphs
    assert graphs.replays == 12


@pytest.mark.gpu
@cuda
def test_cuda_capture_builds_each_layers_routing_table_outside_the_capture():
    """``FREETOKEN_BENCH_ROUTING=hot``: each layer builds its routing table on its first call, a host-to-device copy
    that a capture cannot hold; capture runs every block eagerly first, so every layer's graph is recorded and
    replays the hot experts."""
    saved = bench_routing.mode()
    try:
        bench_routing.set_mode("hot")
        blocks = [make_block(layer_id=10 + i, seed=i, E=64, k=4, H=128, device="cuda") for i in range(3)]
        graphs = MoePrefillGraphs(128, torch.float32, torch.device("cuda"), max_tokens=256, min_tokens=17)
        graphs.capture(blocks)
        graphs.check(blocks[-1])
        x = torch.randn(100, 128, device="cuda")
        for b in blocks:
            got = graphs.run(b, x).clone()
            torch.testing.assert_close(got, b.compute(x), atol=1e-4, rtol=1e-4)
    finally:
        bench_routing.set_mode(saved)


@pytest.mark.gpu
@cuda
def test_cuda_model_greedy_tokens_equal_with_and_without_graphs(tmp_path):
    """A tiny hybrid model on CUDA: start-up captures and checks the graphs; prompts short of, inside and past the
    buckets, greedy, with and without: the same tokens."""
    from freetoken import LLM, SamplingParams

    d = _tiny_hybrid(tmp_path)
    prompts = [list(range(3, 3 + n)) for n in (5, 70, 300, 900)]
    # a small KV pool (memory_ratio), and each engine freed before the next: the default pool takes the GPU, and
    # an engine kept alive by its reference cycles left the next test file out of memory (H200, 2026-12-05)
    args = dict(device="cuda", dtype="float32", max_seq_len_override=4096, load_progress=False, memory_ratio=0.05)
    outs = {}
    for tokens in (512, 0):
        llm = LLM(d, moe_prefill_graph_tokens=tokens, **args)
        assert bool(llm.worker.memory_plan.moe_graph_sizes) == bool(tokens)
        outs[tokens] = [llm.generate(p, SamplingParams(max_tokens=8, ignore_eos=True))[0] for p in prompts]
        del llm
        gc.collect()
        torch.cuda.empty_cache()
    for with_graphs, without in zip(outs[512], outs[0]):
        assert with_graphs.token_ids == without.token_ids
        assert max(abs(a - b) for a, b in zip(with_graphs.logprobs, without.logprobs)) < 1e-3
