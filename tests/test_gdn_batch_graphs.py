"""A Gated DeltaNet step of several sequences from CUDA graphs by (sequence count, chunk count) bucket
(``layers/gdn_batch_graphs.py``): the buckets, the padded varlen index (a padding sequence of whole chunks, then
empty sequences) and the static buffers against the same varlen function called eagerly: on the CPU with the torch
delta rule and emulated graphs, on CUDA with fla's kernels in real graphs and through a whole hybrid model."""

from __future__ import annotations

import gc
import os

import hf_reference as R  # noqa: F401  (blocks fla before transformers is imported)
import pytest
import torch
from test_gated_deltanet import rand_inputs

from freetoken.layers.gated_deltanet import CHUNK_SIZE, _torch_gated_delta_rule
from freetoken.layers.gdn_batch_graphs import (
    MAX_SEQS,
    GdnBatchGraphs,
    capture_batch_graphs,
    chunk_count,
    padded_varlen_index,
    seq_buckets,
)
from freetoken.layers.gdn_prefill_graphs import GdnPrefillGraphs

torch.set_num_threads(1)


def torch_single(q, k, v, g, beta, init):
    o, final, _ = _torch_gated_delta_rule(q, k, v, g, beta, init, [0, q.shape[0]], False, None)
    return o, final


def torch_varlen(q, k, v, g, beta, init, varlen):
    """The torch delta rule in the batch graphs' function signature (reads the index on the host: CPU only)."""
    o, final, _ = _torch_gated_delta_rule(q, k, v, g, beta, init, varlen[0].tolist(), False, None)
    return o, final


def step_inputs(lens, Hk, Hv, dk, dv, seed):
    """A packed step of sequences of ``lens``: ``(q, k, v, g, beta, init [n, Hv, dk, dv])``."""
    parts = [rand_inputs(n, Hk, Hv, dk, dv, seed=seed + i) for i, n in enumerate(lens)]
    q, k, v, g, beta = (torch.cat([p[j] for p in parts]) for j in range(5))
    return q, k, v, g, beta, torch.stack([p[5] for p in parts])


def test_seq_buckets_hold_the_running_sequences_and_the_padding_one():
    assert seq_buckets(1) == []
    assert seq_buckets(2) == [2, 3]
    assert seq_buckets(7) == [2, 3, 4, 5, 6, 7, 8]
    assert seq_buckets(32) == [2, 3, 4, 5, 6, 7, 8, 10, 12, 14, 16, 20, 24, 28, 32, 33]  # a full batch: no empty one
    assert seq_buckets(1000)[-1] == MAX_SEQS
    for m in (2, 5, 9, 20, 63, 1000):
        sizes = seq_buckets(m)
        for n in range(1, min(m, MAX_SEQS - 1) + 1):  # every step of several sequences has a bucket, padded little
            nb = next(s for s in sizes if s > n)
            assert nb - (n + 1) <= max(0, (n + 1) // 4), (m, n, nb)


def test_padded_index_adds_one_padding_sequence_of_whole_chunks_then_empty_ones():
    lens = [5, 64, 1, 130]  # 1 + 1 + 1 + 3 chunks
    assert chunk_count(lens) == 6
    cu, index = padded_varlen_index(lens, 8, 10)
    assert cu == [0, 5, 69, 70, 200, 200 + 4 * CHUNK_SIZE, 456, 456, 456]
    assert index == [(0, 0), (1, 0), (2, 0), (3, 0), (3, 1), (3, 2), (4, 0), (4, 1), (4, 2), (4, 3)]
    assert cu[-1] <= 10 * CHUNK_SIZE
    assert padded_varlen_index([64, 64], 4, 2) == ([0, 64, 128, 128, 128], [(0, 0), (1, 0)])  # no padding chunk
    with pytest.raises(ValueError):
        padded_varlen_index([1, 1, 1, 1], 4, 8)  # no room for the padding sequence
    with pytest.raises(ValueError):
        padded_varlen_index([65, 1], 4, 2)  # 3 chunks


def _graphs(max_tokens=320, max_seqs=8, Hk=2, Hv=4, dk=8, dv=6):
    single = GdnPrefillGraphs(
        torch_single, Hk, Hv, dk, dv, torch.float32, torch.device("cpu"), max_tokens, emulate=True
    )
    single.capture()
    batch = GdnBatchGraphs(torch_varlen, single, max_seqs, emulate=True)
    batch.capture()
    return single, batch


def test_emulated_steps_equal_the_eager_varlen_call_across_buckets_and_stale_buffers():
    """Steps of several sequences, larger first so the buffers past each step hold stale rows, states and index
    entries, from non-zero initial states: outputs and final states equal the unpadded eager call's."""
    single, batch = _graphs(max_tokens=640)
    assert batch.seq_sizes == [2, 3, 4, 5, 6, 7, 8, 9] and batch.chunk_sizes == [1, 2, 3, 4, 5, 6, 7, 8, 10]
    assert (9, 7) not in batch.replay_fns and (2, 1) in batch.replay_fns and (9, 8) in batch.replay_fns
    steps = [[100, 64, 1, 40], [7] * 5, [1, 1], [130, 2], [64, 64, 64], [1] * 3, [200, 1, 1, 1, 1, 1, 1], [1] * 8]
    for i, lens in enumerate(steps):
        q, k, v, g, beta, init = step_inputs(lens, 2, 4, 8, 6, seed=10 * i)
        cu = [0]
        for n in lens:
            cu.append(cu[-1] + n)
        want_o, want_f, _ = _torch_gated_delta_rule(q, k, v, g, beta, init, cu, False, None)
        got = batch.run(q, k, v, g, beta, init, lens)
        assert got is not None, lens
        o, final = got
        assert o.shape == want_o.shape and final.shape == want_f.shape
        torch.testing.assert_close(o, want_o, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(final, want_f, atol=1e-5, rtol=1e-5)
    assert batch.replays == len(steps) and single.replays == 0


def test_misfits_are_declined_and_the_index_loads_once_per_step(monkeypatch):
    """Too many sequences (none left for padding) or chunks: None (the caller runs eagerly). The same step's later
    layers reuse the loaded index; staging hands out the shared buffers for fitting steps only."""
    single, batch = _graphs(max_seqs=3)  # buckets 2, 3, 4: at most 3 real sequences
    assert all(value is not single for value in vars(batch).values())  # no cycle with the graphs that hold it
    q, k, v, g, beta, init = step_inputs([1] * 4, 2, 4, 8, 6, seed=3)
    assert batch.bucket([1] * 4) is None and batch.run(q, k, v, g, beta, init, [1] * 4) is None
    assert batch.bucket([300, 30]) is None  # 6 chunks > 5
    assert batch.staging([300, 30]) is None
    from freetoken.layers import gdn_batch_graphs

    looked_up = []  # the bucket lookups (the step's later layers and their four questions ask the remembered one)
    monkeypatch.setattr(gdn_batch_graphs, "chunk_count", lambda ls: (looked_up.append(ls), chunk_count(ls))[1])
    qkv, gs, bs = batch.staging([100, 20])
    assert (
        qkv.data_ptr() == single.qkv.data_ptr() and gs.shape[0] == 120 and bs.data_ptr() == single.gates[1].data_ptr()
    )
    lens = [100, 20]
    q, k, v, g, beta, init = step_inputs(lens, 2, 4, 8, 6, seed=4)
    built = []
    monkeypatch.setattr(
        gdn_batch_graphs, "padded_varlen_index", lambda *a: (built.append(a), padded_varlen_index(*a))[1]
    )
    assert batch.states_for(lens) is not None
    first = [x.clone() for x in batch.run(q, k, v, g, beta, init, lens)]
    second = batch.run(q, k, v, g, beta, init, lens)  # the next layer: same index, not rebuilt nor sent again
    assert built == [([100, 20], 3, 3)] and batch.loaded == ((100, 20), (3, 3))
    # one bucket lookup for the step's staging, states and both runs (the later layer's), one in the index's build
    assert looked_up == [[100, 20], [100, 20]]
    assert all(torch.equal(a, b) for a, b in zip(first, second))
    batch.run(q[:100], k[:100], v[:100], g[:100], beta[:100], init, [60, 40])  # another step: rebuilt
    assert built[-1] == ([60, 40], 3, 2)


def test_a_failed_capture_is_an_error_and_steps_run_eagerly(monkeypatch, freetoken_caplog):
    """``capture_batch_graphs``: a capture that raises is logged as an error and gives no batch graphs (steps of
    several sequences then run eagerly); one running request or no one-sequence buckets: none, silently."""
    import logging

    single = GdnPrefillGraphs(torch_single, 2, 4, 8, 6, torch.float32, torch.device("cpu"), 256, emulate=True)
    single.capture()
    assert capture_batch_graphs(torch_varlen, single, 4).replay_fns
    assert capture_batch_graphs(torch_varlen, single, 1) is None

    def broken(self, pool=None):
        raise RuntimeError("operation not permitted when stream is capturing\ndetails")

    monkeypatch.setattr(GdnBatchGraphs, "capture", broken)
    with freetoken_caplog.at_level(logging.ERROR):
        assert capture_batch_graphs(torch_varlen, single, 4) is None
    assert "GDN batch graphs not captured (RuntimeError: operation not permitted" in freetoken_caplog.text
    assert "details" not in freetoken_caplog.text


@pytest.mark.parametrize("prefix_lens", [[0, 0, 0], [5, 9, 2], [0, 7, 0], [0] * 6 + [3]])
def test_states_gathered_into_the_static_rows_equal_the_eager_gather(prefix_lens):
    """``GatedDeltaNet._initial_states(..., out=)`` (the batch graphs' static states): all fresh (zeros, no read),
    none fresh (one gather), a few fresh (rows zeroed one by one), many (one masked fill): the eager gather's values, in
    the given rows, whatever they held before."""
    from types import SimpleNamespace

    from freetoken.layers.gated_deltanet import GatedDeltaNet

    gen = torch.Generator().manual_seed(5)
    pool = torch.randn(12, 4, 8, 6, generator=gen)
    slots = [11, 3, 7, 0, 5, 8, 2][: len(prefix_lens)]
    batch = SimpleNamespace(
        state_slots_cpu=slots,
        state_slots=torch.tensor(slots),
        prefix_lens_cpu=prefix_lens,
        prefix_lens=torch.tensor(prefix_lens),
    )
    want = GatedDeltaNet._initial_states(pool, batch)
    out = torch.full((len(slots), 4, 8, 6), float("nan"))
    got = GatedDeltaNet._initial_states(pool, batch, out=out)
    assert got.data_ptr() == out.data_ptr() and torch.equal(got, want)


# ---------------------------------------------------------------------------------------------------------------
# CUDA: fla in real graphs
# ---------------------------------------------------------------------------------------------------------------


def _fla_or_skip():
    from freetoken.layers import gated_deltanet as gdn

    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    if gdn._fla_ops() is None or not gdn._fla_direct_varlen():
        pytest.skip("fla not importable, or internals this fla version does not have")
    return gdn


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_batch_graphs_equal_fla_varlen_at_qwen_shape():
    """Qwen3.6's GDN shape in bf16: steps of several sequences (a prompt among decode tokens, many short prompts,
    chunk-aligned ones), larger first, against ``fla_direct_prefill`` with the step's own varlen index, eagerly."""
    gdn = _fla_or_skip()
    Hk, Hv, d = 16, 32, 128
    single = GdnPrefillGraphs(gdn.fla_direct_prefill, Hk, Hv, d, d, torch.bfloat16, torch.device("cuda"), 4096)
    single.capture()
    batch = GdnBatchGraphs(gdn.fla_direct_prefill, single, 32)
    batch.capture(single.graph_pool())
    steps = [[1500, 300, 1, 1], [224] + [1] * 31, [7] * 32, [64, 128, 1], [1, 1], [63, 65]]
    for i, lens in enumerate(steps):
        q, k, v, g, beta, init = (x.cuda() for x in step_inputs(lens, Hk, Hv, d, d, seed=50 + i))
        q, k, v = (x.to(torch.bfloat16) for x in (q, k, v))
        cu = [0]
        for n in lens:
            cu.append(cu[-1] + n)
        index = gdn._fla_varlen_index(tuple(cu), q.device)
        want_o, want_f = gdn.fla_direct_prefill(q, k, v, g, beta, init.clone(), index)
        o, final = batch.run(q, k, v, g, beta, init.clone(), lens)
        assert o.dtype == want_o.dtype and final.shape == want_f.shape
        # the same kernels on every real chunk (launch settings autotuned per call shape may differ)
        assert (o.float() - want_o.float()).abs().max().item() <= 1e-2, lens
        assert (final - want_f.float()).abs().max().item() <= 1e-3, lens
    assert batch.replays == len(steps)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_model_greedy_tokens_equal_with_and_without_batch_graphs(tmp_path, monkeypatch):
    """A tiny hybrid model on CUDA (fla), prompts of several lengths generated together (their prefill steps hold
    several sequences; then decode): the same tokens and logprobs with the batch graphs and with
    ``FREETOKEN_GDN_BATCH_GRAPHS=0`` (eager varlen), in one process."""
    _fla_or_skip()
    from freetoken import LLM, SamplingParams

    d = str(tmp_path / "tiny-qwen3_5_moe")
    os.makedirs(d)
    R.write_released_qwen3_5_moe(d, seed=13, max_position_embeddings=4096)
    prompts = [list(range(3, 3 + n)) for n in (5, 70, 300, 1, 129)]
    # naive cache: the second round must compute what the first did, not resume from its prefixes
    llm = LLM(d, device="cuda", dtype="float32", max_seq_len_override=4096, load_progress=False,
              max_running_requests=8, cache_type="naive")  # fmt: skip
    batch = next(m.prefill_graphs for m in llm.worker.model.modules() if getattr(m, "prefill_graphs", None)).batch
    assert batch is not None and batch.replay_fns
    outs = {}
    for flag in ("1", "0"):
        monkeypatch.setenv("FREETOKEN_GDN_BATCH_GRAPHS", flag)
        before = batch.replays
        outs[flag] = llm.generate(prompts, SamplingParams(max_tokens=8, ignore_eos=True))
        assert (batch.replays > before) == (flag == "1")
    del llm, batch
    gc.collect()  # free the engine's KV pool for the next test (its reference cycles wait for a collection)
    torch.cuda.empty_cache()
    for a, b in zip(outs["1"], outs["0"]):
        assert a.token_ids == b.token_ids
        assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs)) < 1e-5
