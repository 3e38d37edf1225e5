"""Decode CUDA graphs (engine/decode_graphs.py) against eager decoding.

On CPU the graphs are emulated (replay = calling the recorded step again on the same static buffers) and every
recorded step runs under ``no_host_sync()``, so these tests check what a real capture needs without a GPU: the
step reads only the static buffers, padding rows disturb no real sequence, nothing syncs the host. The gpu-marked
test captures real graphs and compares greedy tokens with ``--disable-cuda-graph``.
"""

from __future__ import annotations

import json
import os

import hf_reference as R
import numpy as np
import pytest
import torch
from test_worker_steps import GREEDY, Seq, encode_plan

from freetoken.engine.decode_graphs import decode_inputs, graph_batch_sizes
from freetoken.errors import InvalidPlan


def test_graph_batch_sizes():
    assert graph_batch_sizes(0) == []
    assert graph_batch_sizes(1) == [1]
    assert graph_batch_sizes(4) == [1, 2, 4]
    assert graph_batch_sizes(5) == [1, 2, 4, 5]
    assert graph_batch_sizes(32) == [1, 2, 4, 8, 16, 24, 32]
    assert graph_batch_sizes(36) == [1, 2, 4, 8, 16, 24, 32, 36]


def test_only_plain_decode_steps_take_the_graph_path():
    a, b = Seq(0, [5, 6, 7], 0), Seq(1, [8, 9], 100)
    a.advance(3, 11)
    b.advance(2, 12)
    plain = encode_plan([a.item(sample=GREEDY), b.item(sample=GREEDY)])
    got = decode_inputs(plain, 4)
    assert got["rows"].tolist() == [0, 1] and got["positions"].tolist() == [3, 2]
    assert got["out_cache_loc"].tolist() == [a.slot(3), b.slot(2)] and got["input_ids"].tolist() == [11, 12]
    assert decode_inputs(plain, 1) is None  # more sequences than the largest graph
    c = Seq(2, [1, 2, 3], 200)
    assert decode_inputs(encode_plan([a.item(sample=GREEDY), c.item(sample=GREEDY)]), 4) is None  # mixed
    assert decode_inputs(encode_plan([a.item(sample=GREEDY)], copies=[(0, 1)]), 4) is None
    assert decode_inputs(encode_plan([a.item(sample=None)], kind="decode"), 4) is None  # not sampled
    resent = dict(a.item(sample=GREEDY), table_from=0, table_slots=[a.slot(q) for q in range(4)])
    assert decode_inputs(encode_plan([resent]), 4) is None  # sends more than the new token's slot
    # a snapshot right after the step's token (the tool-call anchor) rides along as a copy after the replay
    anchored = decode_inputs(
        encode_plan(
            [dict(a.item(sample=GREEDY), state_slot=0), dict(b.item(sample=GREEDY), state_slot=1)],
            snapshots=[(1, 3, 7)],
        ),
        4,
    )
    assert anchored["snap_src"].tolist() == [1] and anchored["snap_dst"].tolist() == [7]
    assert decode_inputs(encode_plan([a.item(sample=GREEDY)], snapshots=[(0, 3, 7)]), 4) is None  # not after it
    wants_prompt = dict(a.item(sample=GREEDY), prompt_logprobs={"next": -1, "top": 0})
    assert decode_inputs(encode_plan([wants_prompt], kind="decode"), 4) is None  # prompt logprobs: eager


def _qwen35_dir(tmp_path_factory) -> str:
    from safetensors.torch import save_file

    d = tmp_path_factory.mktemp("tiny-qwen3_5_moe-graphs")
    cfg = R.qwen3_5_moe_config()
    hf = R.build_hf_model(cfg, seed=3)
    save_file({k: v.contiguous() for k, v in hf.state_dict().items()}, os.path.join(d, "model.safetensors"))
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump({**cfg, "torch_dtype": "float32"}, f)
    return str(d)


@pytest.fixture(scope="module")
def model_dirs(tiny_llama_dir, tmp_path_factory):
    return {"llama": tiny_llama_dir, "qwen3_5_moe": _qwen35_dir(tmp_path_factory)}


def _worker(path: str, graphs: bool, **extra):
    from freetoken.worker import Worker

    args = {
        "model_path": path,
        "device": "cpu",
        "dtype": "float32",
        "num_tokens": 2048,
        "max_running_requests": 4,
        "max_seq_len_override": 512,
        "load_progress": False,
        "emulate_cuda_graphs": graphs,
        "disable_cuda_graph": not graphs,
        **extra,
    }
    return Worker(args)


def _state_slot(w, row):
    return row if w.state is not None else -1


def _drive(w, steps: int = 6) -> list:
    """Three prompts prefilled together, then decode steps over changing subsets (batch sizes 3, 2, 1: padded to
    4, 2, 1), greedy, seeded sampling and penalties mixed. Returns every step's (tokens, logprobs)."""
    seqs = {0: Seq(0, [5, 17, 23, 99, 3, 41], 0), 2: Seq(2, [7, 8, 9, 10], 300, 2), 3: Seq(3, [100, 3, 3], 700)}
    out = []
    items = [dict(s.item(sample=GREEDY), state_slot=_state_slot(w, r)) for r, s in seqs.items()]
    toks, lps, _, _ = w.execute(encode_plan(items))
    for s, t in zip(seqs.values(), toks):
        s.advance(len(s.tokens) - s.cached, t)
    out.append((toks, lps))
    for step in range(1, steps + 1):
        live = [r for r in seqs if step <= {0: steps, 2: 3, 3: 4}[r]]

        def sample(r, step=step):  # row 2 samples, row 3 is greedy under penalties, row 0 plain greedy
            if r == 2:
                return {"temperature": 0.8, "top_p": 0.9, "seed": 1000 * step + r}
            return {"temperature": 0.0, "presence_penalty": 0.5, "frequency_penalty": 0.7} if r == 3 else GREEDY

        items = [dict(seqs[r].item(sample=sample(r)), state_slot=_state_slot(w, r)) for r in live]
        plan = encode_plan(items, step_id=step)
        assert decode_inputs(plan, 4) is not None
        toks, lps, _, _ = w.execute(plan)
        for r, t in zip(live, toks):
            seqs[r].advance(1, t)
        out.append((toks, lps))
    return out


@pytest.mark.parametrize("family", ["llama", "qwen3_5_moe"])
def test_emulated_graphs_match_eager(model_dirs, family):
    eager = _worker(model_dirs[family], graphs=False)
    graphs = _worker(model_dirs[family], graphs=True)
    assert eager.graphs is None and graphs.graphs is not None and graphs.graphs.sizes == [1, 2, 4]
    want, got = _drive(eager), _drive(graphs)
    for (wt, wl), (gt, gl) in zip(want, got):
        assert gt == wt
        np.testing.assert_allclose(gl, wl, atol=1e-4)


@pytest.mark.parametrize("family", ["llama", "qwen3_5_moe"])
def test_a_deleted_worker_with_graphs_frees_its_pools_without_a_collection(model_dirs, family):
    """The graphs' recorded functions hold no reference back to the graphs object: with the garbage collector off
    (as for everything start-up froze: ``gc_control``), deleting a worker that drove its graphs frees the worker,
    its graphs, KV pool, state pool and model by reference counting alone (a cycle there kept a deleted engine's
    KV pool, most of the card on CUDA, for good)."""
    import gc
    import weakref

    w = _worker(model_dirs[family], graphs=True)
    _drive(w)
    held = {name: weakref.ref(getattr(w, name)) for name in ("graphs", "kv", "model")}
    held["worker"] = weakref.ref(w)
    if w.state is not None:
        held["state"] = weakref.ref(w.state)
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        del w
        assert [name for name, ref in held.items() if ref() is not None] == []
    finally:
        if was_enabled:
            gc.enable()


def _top(extra: dict) -> tuple[np.ndarray, np.ndarray]:
    k = extra["top_k"]
    ids = np.frombuffer(extra["top_ids"], dtype="<i4").reshape(-1, k)
    return ids, np.frombuffer(extra["top_logprobs"], dtype="<f4").reshape(-1, k)


def _decode_with_top_logprobs(w) -> list:
    """Three sequences prefilled, then decode steps whose rows ask for 0..20 alternatives (one samples)."""
    seqs = [Seq(0, [5, 17, 23, 99], 0), Seq(1, [7, 8, 9], 300), Seq(2, [100, 3, 3], 700)]
    toks, *_ = w.execute(encode_plan([s.item(sample=GREEDY) for s in seqs]))
    for s, t in zip(seqs, toks):
        s.advance(len(s.tokens) - s.cached, t)
    out = []
    for step, asks in enumerate(([5, 0, 2], [0, 0, 0], [20, 1, 0]), start=1):
        items = [s.item(sample={"temperature": 0.0, "num_top_logprobs": n}) for s, n in zip(seqs, asks)]
        items[1]["sample"].update(temperature=0.8, seed=step)
        plan = encode_plan(items, step_id=step)
        assert decode_inputs(plan, 4) is not None
        toks, lps, _, extra = w.execute(plan)
        out.append((toks, lps, extra, asks))
        for s, t in zip(seqs, toks):
            s.advance(1, t)
    return out


def test_top_logprobs_on_the_graph_path_equal_eager(model_dirs):
    """Rows asking for top logprobs on the graph path (the top-logprobs graph's fixed 20) get what the eager path
    computes (as many as the most asked); a step where no row asks returns none."""
    want = _decode_with_top_logprobs(_worker(model_dirs["llama"], graphs=False))
    got = _decode_with_top_logprobs(_worker(model_dirs["llama"], graphs=True))
    for (wt, wl, we, asks), (gt, gl, ge, _) in zip(want, got):
        assert gt == wt
        np.testing.assert_allclose(gl, wl, atol=1e-4)
        if not any(asks):
            assert we == ge == {}
            continue
        assert (we["top_k"], ge["top_k"]) == (max(asks), 20)
        (wi, wlp), (gi, glp) = _top(we), _top(ge)
        for r, n in enumerate(asks):
            assert gi[r, :n].tolist() == wi[r, :n].tolist()
            np.testing.assert_allclose(glp[r, :n], wlp[r, :n], atol=1e-4)
            if n and r != 1:  # greedy rows: the sampled token is the most likely one, with the same logprob
                assert gi[r, 0] == gt[r] and glp[r, 0] == pytest.approx(gl[r], abs=1e-5)


def test_anchor_snapshot_on_the_graph_path_equals_eager(model_dirs):
    """A decode step that snapshots a sequence's state after its token (``--enable-special-token-ckpt``): the
    graph path copies the live slot after the replay; the snapshot equals the eager path's, which captures it
    inside the GDN layers, and the live state after the step."""
    states = []
    for graphs in (False, True):
        w = _worker(model_dirs["qwen3_5_moe"], graphs=graphs)
        snap = w.max_running_requests + 1  # a snapshot slot past the live ones
        a = Seq(0, [5, 17, 23, 99, 3, 41], 0)
        toks, _, _, _ = w.execute(encode_plan([dict(a.item(sample=GREEDY), state_slot=0)]))
        a.advance(6, toks[0])
        plan = encode_plan([dict(a.item(sample=GREEDY), state_slot=0)], step_id=1, snapshots=[(0, 7, snap)])
        assert decode_inputs(plan, 4) is not None  # the graph worker replays this step
        w.execute(plan)
        for layer in range(w.state.num_layers):
            torch.testing.assert_close(w.state.ssm[layer][snap], w.state.ssm[layer][0], rtol=0, atol=0)
            torch.testing.assert_close(w.state.conv[layer][snap], w.state.conv[layer][0], rtol=0, atol=0)
        states.append([w.state.ssm[layer][snap].clone() for layer in range(w.state.num_layers)])
    for eager, graph in zip(*states):
        torch.testing.assert_close(graph, eager, atol=1e-5, rtol=1e-5)


def test_graph_step_rejects_out_of_range_indices(model_dirs):
    w = _worker(model_dirs["llama"], graphs=True)
    a = Seq(0, [5, 6, 7], 0)
    w.execute(encode_plan([a.item(sample=GREEDY)]))
    a.advance(3, 9)
    good = a.item(sample=GREEDY)
    for bad in (dict(good, row=4), dict(good, table_slots=[2048]), dict(good, tokens=[256])):
        plan = encode_plan([bad])
        assert decode_inputs(plan, 4) is not None
        with pytest.raises(InvalidPlan):
            w.execute(plan)
    assert w.execute(encode_plan([good]))[0]  # the worker goes on


@pytest.mark.gpu
@pytest.mark.parametrize("family", ["llama", "qwen3_5_moe"])
def test_cuda_graphs_match_eager(model_dirs, family):
    """Real graphs on CUDA: greedy tokens equal ``--disable-cuda-graph`` token for token."""
    kw = {"device": "cuda", "emulate_cuda_graphs": False}
    eager = _worker(model_dirs[family], graphs=False, **kw)
    want = _drive(eager)
    del eager
    torch.cuda.empty_cache()
    graphs = _worker(model_dirs[family], graphs=True, **{**kw, "disable_cuda_graph": False})
    assert graphs.graphs is not None and not graphs.graphs.emulate
    got = _drive(graphs)
    for (wt, wl), (gt, gl) in zip(want, got):
        assert gt == wt
        np.testing.assert_allclose(gl, wl, atol=2e-3)


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["1", "prefetch"])
@pytest.mark.parametrize("family", ["llama", "qwen3_5_moe"])
def test_cuda_graphs_with_pdl_match_eager(model_dirs, family, mode, monkeypatch):
    """Programmatic dependent launch (``FREETOKEN_PDL``, ``kernels/pdl.py``) in real graphs and in eager steps:
    greedy tokens equal eager steps without it, token for token."""
    if torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("PDL needs sm_90+")
    kw = {"device": "cuda", "emulate_cuda_graphs": False}
    monkeypatch.setenv("FREETOKEN_PDL", "0")  # the reference: no PDL (on by default)
    want = _drive(_worker(model_dirs[family], graphs=False, **kw))
    monkeypatch.setenv("FREETOKEN_PDL", mode)
    for graphs in (False, True):
        torch.cuda.empty_cache()
        w = _worker(model_dirs[family], graphs=graphs, **{**kw, "disable_cuda_graph": not graphs})
        assert (w.graphs is not None) == graphs
        for (wt, wl), (gt, gl) in zip(want, _drive(w)):
            assert gt == wt
            np.testing.assert_allclose(gl, wl, atol=2e-3)
        del w
