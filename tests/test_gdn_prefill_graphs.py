"""One sequence's Gated DeltaNet prefill from CUDA graphs by padded length (``layers/gdn_prefill_graphs.py``):
the buckets, the padding (g = 0, beta = 0 tokens leave the state alone) and the static buffers against the same
function called eagerly: on the CPU with the torch delta rule and emulated graphs, on CUDA with fla's kernels in
real graphs, through the layer dispatch and a whole hybrid model (greedy tokens with graphs = without)."""

from __future__ import annotations

import gc
import os

import hf_reference as R  # noqa: F401  (blocks fla before transformers is imported)
import pytest
import torch
from test_gated_deltanet import rand_inputs

from freetoken.kernels.gdn_conv_prefill import parts_views
from freetoken.layers.gated_deltanet import CHUNK_SIZE, _torch_gated_delta_rule, gated_delta_rule_in_rounds
from freetoken.layers.gdn_prefill_graphs import GdnPrefillGraphs, bucket_sizes

torch.set_num_threads(1)


def torch_prefill(q, k, v, g, beta, init):
    """The torch delta rule in the graphs' function signature: one sequence, ``(o, final [1, ...])``."""
    o, final, _ = _torch_gated_delta_rule(q, k, v, g, beta, init, [0, q.shape[0]], False, None)
    return o, final


@pytest.mark.parametrize("top", [64, 100, 512, 4096, 8192])
def test_buckets_are_chunk_multiples_padding_at_most_a_quarter(top):
    sizes = bucket_sizes(top)
    assert sizes == sorted(set(sizes)) and sizes[0] == CHUNK_SIZE and sizes[-1] == top // CHUNK_SIZE * CHUNK_SIZE
    assert all(s % CHUNK_SIZE == 0 for s in sizes)
    for n in range(1, sizes[-1] + 1):
        b = next(s for s in sizes if s >= n)
        assert b - n < CHUNK_SIZE or (b - n) / n <= 0.25, (n, b)
    assert bucket_sizes(63) == []


def test_emulated_graphs_equal_the_eager_call_across_buckets_and_stale_padding():
    """Each length runs in its bucket (padded), in an order that leaves longer inputs' values in the padding
    region, from a non-zero initial state: outputs and final state equal the unpadded eager call."""
    Hk, Hv, dk, dv = 2, 4, 8, 6
    graphs = GdnPrefillGraphs(torch_prefill, Hk, Hv, dk, dv, torch.float32, torch.device("cpu"), 320, emulate=True)
    graphs.capture()
    assert graphs.sizes == [64, 128, 192, 256, 320]
    for i, n in enumerate([300, 5, 64, 130, 1, 257]):
        q, k, v, g, beta, state = rand_inputs(n, Hk, Hv, dk, dv, seed=i)
        want_o, want_f = torch_prefill(q, k, v, g, beta, state[None])
        got = graphs.run(q, k, v, g, beta, state[None])
        assert got is not None
        o, final = got
        assert o.shape == want_o.shape and final.shape == want_f.shape
        torch.testing.assert_close(o, want_o, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(final, want_f, atol=1e-5, rtol=1e-5)
    assert graphs.replays == 6


def test_outputs_outlive_the_next_replay_and_misfits_fall_back():
    """What run returns is the caller's (a later replay does not change it); longer pieces and batches of several
    initial states are declined (None: the caller runs eagerly)."""
    graphs = GdnPrefillGraphs(torch_prefill, 2, 4, 8, 6, torch.float32, torch.device("cpu"), 128, emulate=True)
    graphs.capture()
    a = rand_inputs(70, seed=1)
    o1, f1 = graphs.run(*a[:5], a[5][None])
    keep = o1.clone(), f1.clone()
    b = rand_inputs(90, seed=2)
    graphs.run(*b[:5], b[5][None])
    assert torch.equal(o1, keep[0]) and torch.equal(f1, keep[1])
    c = rand_inputs(129, seed=3)
    assert graphs.run(*c[:5], c[5][None]) is None
    d = rand_inputs(10, seed=4)
    assert graphs.run(*d[:5], torch.stack([d[5], d[5]])) is None


def test_strided_inputs_as_the_layer_passes_them():
    """The layer hands q, k, v as split views of the conv output and the initial state as a view of its slot."""
    Hk, Hv, dk, dv, n = 2, 4, 8, 6, 100
    q, k, v, g, beta, state = rand_inputs(n, Hk, Hv, dk, dv, seed=5)
    y = torch.cat([q.reshape(n, -1), k.reshape(n, -1), v.reshape(n, -1)], dim=-1)
    qs, ks, vs = torch.split(y, [Hk * dk, Hk * dk, Hv * dv], dim=-1)
    views = qs.reshape(n, Hk, dk), ks.reshape(n, Hk, dk), vs.reshape(n, Hv, dv)
    pool = torch.stack([torch.zeros_like(state), state])
    graphs = GdnPrefillGraphs(torch_prefill, Hk, Hv, dk, dv, torch.float32, torch.device("cpu"), 128, emulate=True)
    graphs.capture()
    o, final = graphs.run(*views, g, beta, pool[1:2])
    want_o, want_f = torch_prefill(q, k, v, g, beta, state[None])
    torch.testing.assert_close(o, want_o, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(final, want_f, atol=1e-5, rtol=1e-5)


def _stage(graphs, q, k, v, g, beta):
    """What the layer does: the conv writes q | k | v into the staged buffer, the gates kernel g and beta."""
    T = q.shape[0]
    qkv, g_buf, beta_buf = graphs.staging(T)
    views = parts_views(qkv, graphs.top, T, graphs.parts)
    for view, x in zip(views, (q, k, v)):
        view.copy_(x.reshape(T, -1))
    g_buf.copy_(g)
    beta_buf.copy_(beta)
    Hk, Hv = q.shape[1], v.shape[1]
    qs, ks = (x.view(T, Hk, -1) for x in views[:2])
    return qs, ks, views[2].view(T, Hv, -1), g_buf, beta_buf


def test_staged_chunk_runs_in_place_and_its_tail_keeps_its_gates():
    """A staged chunk's first piece replays from the buffers themselves (no copy in: the static inputs keep their
    addresses, a borrowed output is the graph's buffer); the padding zeroed for its bucket is the next piece's
    gates, which come back after the replay; a later piece (a view inside the buffers) is copied to the buffers'
    head and replayed when it starts past the rows its bucket reads, else declined."""
    Hk, Hv, dk, dv, n, cut = 2, 4, 8, 6, 150, 100
    graphs = GdnPrefillGraphs(torch_prefill, Hk, Hv, dk, dv, torch.float32, torch.device("cpu"), 320, emulate=True)
    graphs.capture()
    q, k, v, g, beta, state = rand_inputs(n, Hk, Hv, dk, dv, seed=8)
    qs, ks, vs, gs, bs = _stage(graphs, q, k, v, g, beta)
    copies = []
    for buf in (graphs.q, graphs.k, graphs.v):
        buf.copy_ = lambda *a, _c=copies: _c.append(a)  # a copy into a static input would land here
    o1, f1 = graphs.run(qs[:cut], ks[:cut], vs[:cut], gs[:cut], bs[:cut], state[None], borrow=True)
    assert not copies and o1.data_ptr() == graphs.o.data_ptr() and f1.data_ptr() == graphs.final.data_ptr()
    assert torch.equal(gs[cut:], g[cut:]) and torch.equal(bs[cut:], beta[cut:])  # bucket 128 zeroed 100..127
    o1, f1 = o1.clone(), f1.clone()  # borrowed: the next replay overwrites them
    assert graphs.run(qs[30:], ks[30:], vs[30:], gs[30:], bs[30:], f1) is None  # from row 30, bucket 128: declined
    o2, f2 = graphs.run(qs[cut:], ks[cut:], vs[cut:], gs[cut:], bs[cut:], f1)  # 50 from row 100, bucket 64
    assert graphs.replays == 2
    want_o, want_f = torch_prefill(q, k, v, g, beta, state[None])
    torch.testing.assert_close(torch.cat([o1, o2]), want_o, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(f2, want_f, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("captures", [[128, 150], [100, 150], [30, 100, 150], [64, 140, 150]])
def test_staged_chunk_through_the_snapshot_rounds(captures):
    """``gated_delta_rule_in_rounds`` over a staged chunk with borrowed graph outputs (as the fla dispatch runs it):
    outputs, final state and every captured state equal the torch delta rule's, although each replay overwrites
    the previous piece's borrowed buffers, and a later long piece (a view inside the buffers) runs eagerly."""
    Hk, Hv, dk, dv, n = 2, 4, 8, 6, 150
    graphs = GdnPrefillGraphs(torch_prefill, Hk, Hv, dk, dv, torch.float32, torch.device("cpu"), 320, emulate=True)
    graphs.capture()
    q, k, v, g, beta, state = rand_inputs(n, Hk, Hv, dk, dv, seed=9)
    staged = _stage(graphs, q, k, v, g, beta)

    def varlen(q, k, v, g, beta, init, cu, decode):  # _fla_gated_delta_rule's single-sequence path
        out = graphs.run(q, k, v, g, beta, init, borrow=True)
        return out if out is not None else torch_prefill(q, k, v, g, beta, init)

    def short(q, k, v, g, beta, init, out):  # the tail kernel's contract: o into the caller's rows
        o, f = torch_prefill(q, k, v, g, beta, init)
        return out.copy_(o), f

    o, final, cap = gated_delta_rule_in_rounds(varlen, *staged, state[None], [0, n], {0: captures}, short=short)
    o_t, f_t, c_t = _torch_gated_delta_rule(q, k, v, g, beta, state[None], [0, n], False, {0: captures})
    torch.testing.assert_close(o, o_t, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(final, f_t, atol=1e-5, rtol=1e-5)
    assert set(cap) == set(c_t)
    for key, s in c_t.items():
        torch.testing.assert_close(cap[key], s, atol=1e-5, rtol=1e-5)
    # the first piece from the buffers when long; a later long one eagerly (it starts inside the rows its replay
    # reads); a short tail on a chunk boundary (128) copied to the buffers' head and replayed; other short tails
    # token by token
    assert graphs.replays == {(128, 150): 2, (100, 150): 1, (30, 100, 150): 0, (64, 140, 150): 1}[tuple(captures)]


# ---------------------------------------------------------------------------------------------------------------
# CUDA: fla in real graphs
# ---------------------------------------------------------------------------------------------------------------


def _fla_or_skip():
    from freetoken.layers import gated_deltanet as gdn

    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    if gdn._fla_ops() is None or gdn._fla_direct_ops() is None:
        pytest.skip("fla not importable, or internals this fla version does not have")
    return gdn


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_graphs_equal_fla_direct_at_qwen_shape():
    """Qwen3.6's GDN shape (16 key heads, 32 value heads, 128 x 128 state), bf16: every length in its bucket,
    longer lengths first so the padding holds stale values, against ``fla_direct_prefill`` eagerly."""
    gdn = _fla_or_skip()
    Hk, Hv, d = 16, 32, 128
    graphs = GdnPrefillGraphs(gdn.fla_direct_prefill, Hk, Hv, d, d, torch.bfloat16, torch.device("cuda"), 4096)
    graphs.capture()
    for i, n in enumerate([4096, 2184, 1, 63, 64, 700, 3000]):
        q, k, v, g, beta, state = (x.cuda() for x in rand_inputs(n, Hk, Hv, d, d, seed=90 + i))
        q, k, v = (x.to(torch.bfloat16) for x in (q, k, v))
        want_o, want_f = gdn.fla_direct_prefill(q, k, v, g, beta, state[None].clone())
        o, final = graphs.run(q, k, v, g, beta, state[None].clone())
        assert o.dtype == want_o.dtype and final.shape == want_f.shape
        # same kernels and tiles; fla's configurations do not depend on the length
        assert (o.float() - want_o.float()).abs().max().item() <= 1e-2, n
        assert (final.float() - want_f.float()).abs().max().item() <= 1e-3, n
    assert graphs.replays == 7


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize(
    "n, captures", [(600, [576, 600]), (150, [64, 150]), (2184, [2176, 2184]), (2184, [2136, 2184])]
)
def test_cuda_graphs_through_the_dispatch_with_snapshot_rounds(n, captures):
    """``gated_delta_rule(..., prefill_graphs=)``: a cached turn's chunk with its snapshot rounds (the tail after
    the grid point token by token, ``kernels/gdn_recurrent_piece.py``) against the torch reference, graphs replayed
    for the pieces of at least fla's chunk."""
    gdn = _fla_or_skip()
    graphs = GdnPrefillGraphs(gdn.fla_direct_prefill, 2, 4, 64, 64, torch.float32, torch.device("cuda"), 2560)
    graphs.capture()
    q, k, v, g, beta, init = (x.cuda() for x in rand_inputs(n, Hk=2, Hv=4, dk=64, dv=64, seed=71))
    cu, caps = [0, n], {0: captures}
    o_t, f_t, c_t = gdn.gated_delta_rule(q, k, v, g, beta, init[None].clone(), cu, False, caps, backend="torch")
    o_f, f_f, c_f = gdn.gated_delta_rule(
        q, k, v, g, beta, init[None].clone(), cu, False, caps, backend="fla", prefill_graphs=graphs
    )
    bounds = [0, *captures]
    chunked = sum(not gdn.token_by_token(a, z) for a, z in zip(bounds[:-1], bounds[1:]))
    assert graphs.replays == chunked  # a tail under fla's chunk runs on the token-by-token kernel, unless aligned
    assert (o_f - o_t).abs().max() < 2e-3 and (f_f - f_t).abs().max() < 2e-3
    for key, state in c_t.items():
        assert (c_f[key] - state).abs().max() < 2e-3, key


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_model_greedy_tokens_equal_with_and_without_graphs(tmp_path):
    """A tiny hybrid model on CUDA (fla): prompts of several lengths, one at a time and with a cached prefix,
    greedy, with the GDN prefill graphs (start-up captures them) and with ``gdn_prefill_graph_tokens=0``: the same
    tokens and logprobs (fp32: both runs use the same fla kernels, so only the padding could differ)."""
    _fla_or_skip()
    from freetoken import LLM, SamplingParams

    d = str(tmp_path / "tiny-qwen3_5_moe")
    os.makedirs(d)
    R.write_released_qwen3_5_moe(d, seed=12, max_position_embeddings=4096)
    prompts = [list(range(3, 3 + n)) for n in (5, 70, 300, 900)]
    prompts.append(prompts[-1] + list(range(7, 7 + 150)))  # the last one again, longer: a cached prefix
    args = dict(device="cuda", dtype="float32", max_seq_len_override=4096, load_progress=False)
    outs = {}
    for tokens in (4096, 0):
        llm = LLM(d, gdn_prefill_graph_tokens=tokens, **args)
        assert bool(llm.worker.memory_plan.gdn_graph_sizes) == bool(tokens)
        outs[tokens] = [llm.generate(p, SamplingParams(max_tokens=8, ignore_eos=True))[0] for p in prompts]
        del llm
        gc.collect()  # an engine's reference cycles would keep its KV pool (90 % of the card) from the next test
        torch.cuda.empty_cache()
    for with_graphs, without in zip(outs[4096], outs[0]):
        assert with_graphs.token_ids == without.token_ids
        assert max(abs(a - b) for a, b in zip(with_graphs.logprobs, without.logprobs)) < 1e-4
