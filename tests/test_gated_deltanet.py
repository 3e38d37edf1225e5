"""Gated DeltaNet: the delta-rule math (chunked vs recurrent vs a naive per-token loop written from the formula),
the varlen dispatch, the layer against HF's ``Qwen3_5MoeGatedDeltaNet`` / ``Qwen3NextGatedDeltaNet`` modules, state
continuation through the state pool across chunks / decode / mixed batches, snapshots, and the pool itself.
fp32 on CPU, tiny shapes."""

from __future__ import annotations

import itertools

import hf_reference as R  # noqa: F401  (blocks fla before transformers is imported)
import numpy as np
import pytest
import torch

from freetoken.cache.state_pool import RecurrentStatePool, default_ssm_dtype
from freetoken.layers.gated_deltanet import (
    SHORT_PIECE,
    GatedDeltaNet,
    gated_delta_rule,
    gated_delta_rule_in_rounds,
    l2norm,
    token_by_token,
    torch_chunk_gated_delta_rule,
    torch_recurrent_gated_delta_rule,
)
from freetoken.layers.gdn_state_windows import window_host_arrays, window_index
from freetoken.models.base import ModelConfig

torch.set_num_threads(1)  # 2 shared cores: more threads only spin


def naive_gdn(q, k, v, g, beta, state):
    """Straight from REFERENCES §1.6, one token and one value head at a time. ``q, k [T, Hk, dk]`` raw,
    ``v [T, Hv, dv]``, ``g, beta [T, Hv]``, ``state [Hv, dk, dv]``."""
    T, Hk, dk = q.shape
    Hv = v.shape[1]
    r = Hv // Hk
    S = state.clone().double()
    o = torch.zeros(T, Hv, v.shape[2], dtype=torch.float64)
    for t in range(T):
        for h in range(Hv):
            qh = q[t, h // r].double()
            kh = k[t, h // r].double()
            qh = qh / torch.sqrt((qh * qh).sum() + 1e-6) * dk**-0.5
            kh = kh / torch.sqrt((kh * kh).sum() + 1e-6)
            S[h] = torch.exp(g[t, h].double()) * S[h]
            S[h] = S[h] + beta[t, h].double() * torch.outer(kh, v[t, h].double() - kh @ S[h])
            o[t, h] = qh @ S[h]
    return o.float(), S.float()


def rand_inputs(T, Hk=2, Hv=4, dk=8, dv=6, seed=0):
    gen = torch.Generator().manual_seed(seed)
    rnd = lambda *s: torch.randn(*s, generator=gen)  # noqa: E731
    q, k, v = rnd(T, Hk, dk), rnd(T, Hk, dk), rnd(T, Hv, dv)
    g = -torch.rand(T, Hv, generator=gen) * 0.3  # log-decay in (-0.3, 0]
    beta = torch.rand(T, Hv, generator=gen)
    state = 0.3 * rnd(Hv, dk, dv)
    return q, k, v, g, beta, state


def _expand(q, k, v, g, beta, Hv):
    r = Hv // q.shape[1]
    qf = (l2norm(q) * q.shape[-1] ** -0.5).repeat_interleave(r, 1).transpose(0, 1)
    kf = l2norm(k).repeat_interleave(r, 1).transpose(0, 1)
    return qf, kf, v.transpose(0, 1), g.t(), beta.t()


@pytest.mark.parametrize("T", [1, 5, 64, 130])
@pytest.mark.parametrize("chunk", [16, 64])
def test_chunked_and_recurrent_match_naive(T, chunk):
    q, k, v, g, beta, state = rand_inputs(T, seed=T)
    o_ref, s_ref = naive_gdn(q, k, v, g, beta, state)
    qf, kf, vf, gf, bf = _expand(q, k, v, g, beta, 4)
    o_c, s_c = torch_chunk_gated_delta_rule(qf, kf, vf, gf, bf, state.clone(), chunk_size=chunk)
    o_r, s_r = torch_recurrent_gated_delta_rule(qf[None], kf[None], vf[None], gf[None], bf[None], state[None].clone())
    assert (o_c.transpose(0, 1) - o_ref).abs().max() < 2e-5
    assert (s_c - s_ref).abs().max() < 2e-5
    assert (o_r[0].transpose(0, 1) - o_ref).abs().max() < 2e-5
    assert (s_r[0] - s_ref).abs().max() < 2e-5


def varlen_batch(lens: list[int], seed: int):
    """Random sequences of the given lengths: each one's inputs, the concatenated inputs, the stacked initial
    states and the host offsets."""
    seqs = [rand_inputs(n, seed=seed + i) for i, n in enumerate(lens)]
    cat = [torch.cat([s[j] for s in seqs]) for j in range(5)]
    cu = [0]
    for n in lens:
        cu.append(cu[-1] + n)
    return seqs, cat, torch.stack([s[5] for s in seqs]), cu


def test_varlen_dispatch_equals_per_sequence_and_decode():
    seqs, cat, init, cu = varlen_batch([7, 1, 70, 3], seed=10)
    o, final, _ = gated_delta_rule(*cat, init, cu, decode=False, backend="torch")
    for i, s in enumerate(seqs):
        o_ref, s_ref = naive_gdn(*s)
        assert (o[cu[i] : cu[i + 1]] - o_ref).abs().max() < 2e-5
        assert (final[i] - s_ref).abs().max() < 2e-5
    # decode form: one token per sequence, batched
    one = [rand_inputs(1, seed=30 + i) for i in range(3)]
    cat = [torch.cat([s[j] for s in one]) for j in range(5)]
    o, final, _ = gated_delta_rule(*cat, torch.stack([s[5] for s in one]), [0, 1, 2, 3], decode=True, backend="torch")
    for i, s in enumerate(one):
        o_ref, s_ref = naive_gdn(*s)
        assert (o[i] - o_ref[0]).abs().max() < 2e-5 and (final[i] - s_ref).abs().max() < 2e-5


def test_captures_are_prefix_states():
    q, k, v, g, beta, state = rand_inputs(100, seed=3)
    o, final, cap = gated_delta_rule(
        q, k, v, g, beta, state[None], [0, 100], decode=False, captures={0: [64, 37]}, backend="torch"
    )
    o_full, _ = naive_gdn(q, k, v, g, beta, state)
    assert (o - o_full).abs().max() < 2e-5
    for at in (37, 64, 100):
        _, s_ref = naive_gdn(q[:at], k[:at], v[:at], g[:at], beta[:at], state)
        assert (cap[(0, at)] - s_ref).abs().max() < 2e-5


def _torch_varlen(q, k, v, g, beta, init, cu, decode):
    """The capture-free torch path in the signature the fla path has, to test the rounds on the CPU."""
    o, final, _ = gated_delta_rule(q, k, v, g, beta, init, cu, decode, backend="torch")
    return o, final


@pytest.mark.parametrize(
    "captures", [{0: [37, 64], 2: [1]}, {1: [70]}, {0: [5], 1: [1, 69], 2: [3]}, {3: [2]}, {0: [100], 3: [2]}]
)
def test_rounds_give_the_states_at_capture_points(captures):
    """The fla path's snapshot captures (pieces run in rounds) against per-token states from the formula: outputs,
    finals and every captured state, with sequences of different piece counts in one batch (and captures at
    sequence ends only: one call, no gathers)."""
    lens = [100, 70, 4, 2]
    seqs, cat, init, cu = varlen_batch(lens, seed=40)
    calls = []

    def counted(*a):
        calls.append(len(a[6]) - 1)
        return _torch_varlen(*a)

    o, final, cap = gated_delta_rule_in_rounds(counted, *cat, init, cu, captures)
    assert len(calls) == 1 + max(len([c for c in cs if c < lens[b]]) for b, cs in captures.items())
    for i, s in enumerate(seqs):
        o_ref, s_ref = naive_gdn(*s)
        assert (o[cu[i] : cu[i + 1]] - o_ref).abs().max() < 2e-5
        assert (final[i] - s_ref).abs().max() < 2e-5
    for b, offsets in captures.items():
        q, k, v, g, beta, state = seqs[b]
        for at in offsets:
            _, s_ref = naive_gdn(q[:at], k[:at], v[:at], g[:at], beta[:at], state)
            assert (cap[(b, at)] - s_ref).abs().max() < 2e-5, (b, at)


def test_rounds_of_many_sequences_cost_the_same_ops_as_of_few():
    """A prompt cut at its grid point beside decode tokens (the served step in which a prompt joins running streams):
    the rounds' torch ops outside the kernel do not grow with the number of sequences (per-sequence index builds,
    state copies and stacks made such a step ~0.1 ms a sequence and layer slower on the host)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class CountOps(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops += 1
            return func(*args, **(kwargs or {}))

    def kernel(*a):  # the varlen kernel's own ops are not the rounds' cost
        with torch.utils._python_dispatch._disable_current_modes():
            return _torch_varlen(*a)

    counts = []
    for decoders in (3, 24):
        seqs, cat, init, cu = varlen_batch([100] + [1] * decoders, seed=42)
        with CountOps() as mode:
            o, final, cap = gated_delta_rule_in_rounds(kernel, *cat, init, cu, {0: [64, 100]})
        counts.append(mode.ops)
        q, k, v, g, beta, state = seqs[0]
        _, s_at = naive_gdn(q[:64], k[:64], v[:64], g[:64], beta[:64], state)
        assert (cap[(0, 64)] - s_at).abs().max() < 2e-5
        for i, sq in enumerate(seqs):
            o_ref, s_ref = naive_gdn(*sq)
            assert (o[cu[i] : cu[i + 1]] - o_ref).abs().max() < 2e-5 and (final[i] - s_ref).abs().max() < 2e-5
    assert counts[0] == counts[1], counts


@pytest.mark.parametrize("captures", [{3: [64, 100]}, {3: [37]}, {0: [1], 2: [1], 3: [64]}])
def test_a_prompt_cut_after_decode_tokens_runs_its_rounds_on_views(captures):
    """The served join: decode tokens first (the scheduler's order), then a prompt cut once. Its two rounds take
    views (each call gets a prefix or the rest of the batch, and the tail starts from the prompt's round-0 state):
    against the formula, with no gather or scatter, and in fewer torch ops than the same batch with the prompt first
    (whose round 0 gathers)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class CountOps(TorchDispatchMode):
        """Ops that run something (views only make tensor headers), and the names of those that run."""

        def __init__(self):
            super().__init__()
            self.ops, self.names = 0, []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if not func.is_view:
                self.ops += 1
                self.names.append(func.__name__)
            return func(*args, **(kwargs or {}))

    calls = []

    def kernel(*a):  # the varlen kernel's own ops are not the rounds' cost
        calls.append(list(a[6]))
        with torch.utils._python_dispatch._disable_current_modes():
            return _torch_varlen(*a)

    lens = [1, 1, 1, 100]
    seqs, cat, init, cu = varlen_batch(lens, seed=43)
    with CountOps() as views:
        o, final, cap = gated_delta_rule_in_rounds(kernel, *cat, init, cu, captures)
    cut = [c for c in captures[3] if c < 100][0]
    assert calls == [[0, 1, 2, 3, 3 + cut], [0, 100 - cut]]
    for i, sq in enumerate(seqs):
        o_ref, s_ref = naive_gdn(*sq)
        assert (o[cu[i] : cu[i + 1]] - o_ref).abs().max() < 2e-5 and (final[i] - s_ref).abs().max() < 2e-5
    for b, offsets in captures.items():
        q, k, v, g, beta, state = seqs[b]
        for at in offsets:
            _, s_ref = naive_gdn(q[:at], k[:at], v[:at], g[:at], beta[:at], state)
            assert (cap[(b, at)] - s_ref).abs().max() < 2e-5, (b, at)
    assert not {"index.Tensor", "index_copy_.default"} & set(views.names), views.names  # no gathers or scatters
    # the same batch with the prompt first: its round 0 is not consecutive tokens, so it gathers and scatters
    order = [3, 0, 1, 2]
    _, cat_first, init_first, cu_first = varlen_batch([lens[i] for i in order], seed=43)
    with CountOps() as general:
        gated_delta_rule_in_rounds(kernel, *cat_first, init_first, cu_first, {0: [cut]})
    assert {"index.Tensor", "index_copy_.default"} <= set(general.names), general.names
    assert views.ops < general.ops, (views.names, general.names)


@pytest.mark.parametrize("captures", [[37, 64], [64], [99], [1, 2, 3]])
def test_rounds_of_one_sequence_run_on_views(captures):
    """One sequence (a cached turn's last chunk: a snapshot at the grid point inside it and one at its end) takes
    the view path: one call per piece, each starting where the previous ended, pieces shorter than fla's chunk on
    the token-by-token kernel, against the formula."""
    seqs, cat, init, cu = varlen_batch([100], seed=41)
    calls = []

    def counted(*a):
        calls.append(a[6])
        return _torch_varlen(*a)

    shorts = []

    def short(q, k, v, g, beta, init, out):  # the token-by-token path, as the fla dispatch gives it
        shorts.append(q.shape[0])
        o, final, _ = gated_delta_rule(q, k, v, g, beta, init, [0, q.shape[0]], False, backend="torch")
        return out.copy_(o), final

    o, final, cap = gated_delta_rule_in_rounds(counted, *cat, init, cu, {0: captures + [100]}, short=short)
    bounds = [0, *captures, 100]
    pieces = list(zip(bounds[:-1], bounds[1:]))
    # pieces under fla's chunk go token by token, unless they start on a chunk boundary after the first ([64, 100))
    assert sorted(shorts) == sorted(z - a for a, z in pieces if token_by_token(a, z))
    assert sorted(shorts) == {(37, 64): [27, 37], (64,): [], (99,): [1], (1, 2, 3): [1, 1, 1]}[tuple(captures)]
    assert len(calls) + len(shorts) == len(captures) + 1 and all(c[0] == 0 and len(c) == 2 for c in calls)
    q, k, v, g, beta, state = seqs[0]
    o_ref, s_ref = naive_gdn(q, k, v, g, beta, state)
    assert o.dtype == torch.float32 and (o - o_ref).abs().max() < 2e-5
    assert (final[0] - s_ref).abs().max() < 2e-5 and (cap[(0, 100)] - s_ref).abs().max() < 2e-5
    for at in captures:
        _, s_at = naive_gdn(q[:at], k[:at], v[:at], g[:at], beta[:at], state)
        assert (cap[(0, at)] - s_at).abs().max() < 2e-5, at


# ---------------------------------------------------------------------------------------------------------------
# the layer
# ---------------------------------------------------------------------------------------------------------------

LAYER_SHAPES = {
    "gva_r2_dk_ne_dv": dict(
        linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=24
    ),
    "r1": dict(linear_num_key_heads=3, linear_num_value_heads=3, linear_key_head_dim=8, linear_value_head_dim=8),
    "r3_kc2": dict(
        linear_num_key_heads=1,
        linear_num_value_heads=3,
        linear_key_head_dim=12,
        linear_value_head_dim=8,
        linear_conv_kernel_dim=2,
    ),
}


def _hf_gdn(family, shape, seed=0):
    m35, mnext = R._hf_modules()
    cfg = R.qwen3_5_moe_config(**shape)["text_config"] if family == "qwen3_5_moe" else R.qwen3_next_config(**shape)
    if family == "qwen3_5_moe":
        from transformers import Qwen3_5MoeTextConfig

        hf_cfg = Qwen3_5MoeTextConfig(**R._hf_kwargs(cfg))
        layer = m35.Qwen3_5MoeGatedDeltaNet(hf_cfg, 0)
    else:
        from transformers import Qwen3NextConfig

        hf_cfg = Qwen3NextConfig(**R._hf_kwargs(cfg))
        layer = mnext.Qwen3NextGatedDeltaNet(hf_cfg, 0)
    R.randomize_(layer.float().eval(), seed)
    ours = GatedDeltaNet(ModelConfig.from_dict(cfg), 0, 0, interleaved_proj=(family == "qwen3_next")).eval()
    ours.load_state_dict(layer.state_dict())
    return layer, ours


class _Batch:
    """The fields of ForwardBatch the GDN layer reads; ``gathered``: a step of several sequences carries its conv
    windows' index as ``ForwardBatch.from_plan`` builds it (else the layer takes them one by one)."""

    def __init__(self, pool, items, lens, snapshots=None, gathered=True):
        self.state = pool
        self.extend_lens_cpu = [len(x) for _, x in items]
        self.prefix_lens_cpu = [lens.get(s, 0) for s, _ in items]
        self.state_slots_cpu = [2 * s + 1 for s, _ in items]
        self.state_slots = torch.tensor(self.state_slots_cpu)
        self.cu_seqlens = torch.tensor([0, *self.extend_lens_cpu], dtype=torch.int32).cumsum(0).to(torch.int32)
        self.prefix_lens = torch.tensor(self.prefix_lens_cpu, dtype=torch.int32)
        self.is_decode = all(n == 1 for n in self.extend_lens_cpu) and all(p > 0 for p in self.prefix_lens_cpu)
        self.snapshots = snapshots
        self.gdn_windows = None
        if gathered and len(items) > 1:
            cu, kc1 = self.cu_seqlens.tolist(), pool.conv_shape[-1]
            arrays = window_host_arrays(cu, self.prefix_lens_cpu, self.state_slots_cpu, snapshots or [], kc1)
            self.gdn_windows = window_index(arrays, len(items))

    @property
    def has_initial_state_cpu(self):
        return [p > 0 for p in self.prefix_lens_cpu]


def _run(ours, pool, lens, items, snapshots=None, gathered=True):
    """items: (seq, x [n, H]); returns per-item outputs."""
    b = _Batch(pool, items, lens, snapshots, gathered)
    with torch.no_grad():
        out = ours(torch.cat([x for _, x in items]), b)
    res, at = [], 0
    for s, x in items:
        res.append(out[at : at + len(x)])
        at += len(x)
        lens[s] = lens.get(s, 0) + len(x)
    return res


def _pool(ours, slots=10):
    return RecurrentStatePool(1, slots, ours.conv_state_shape, ours.ssm_state_shape, torch.float32, torch.float32)


@pytest.mark.parametrize("family", ["qwen3_5_moe", "qwen3_next"])
@pytest.mark.parametrize("shape", list(LAYER_SHAPES))
def test_layer_matches_hf_and_continues_across_chunks(family, shape):
    hf, ours = _hf_gdn(family, LAYER_SHAPES[shape], seed=1)
    gen = torch.Generator().manual_seed(2)
    T = 150
    x = torch.randn(T, 64, generator=gen)
    with torch.no_grad():
        ref = hf(x[None])[0]
    # one shot
    pool, lens = _pool(ours), {}
    (y,) = _run(ours, pool, lens, [(0, x)])
    assert (y - ref).abs().max() < 1e-4 * max(1.0, ref.abs().max().item())
    # split prefill (odd pieces, one longer than a 64-chunk, one shorter than the conv window) then decode
    pool, lens = _pool(ours), {}
    pieces, at = [], 0
    for n in (2, 67, 1, 30):
        pieces.append(_run(ours, pool, lens, [(3, x[at : at + n])])[0])
        at += n
    while at < T:
        pieces.append(_run(ours, pool, lens, [(3, x[at : at + 1])])[0])
        at += 1
    got = torch.cat(pieces)
    assert (got - ref).abs().max() < 1e-4 * max(1.0, ref.abs().max().item())


@pytest.mark.parametrize("gathered", [True, False])
@pytest.mark.parametrize("family", ["qwen3_5_moe", "qwen3_next"])
def test_layer_mixed_batch_matches_separate_runs(family, gathered):
    hf, ours = _hf_gdn(family, LAYER_SHAPES["gva_r2_dk_ne_dv"], seed=4)
    gen = torch.Generator().manual_seed(5)
    xa, xb, xc = (
        torch.randn(40, 64, generator=gen),
        torch.randn(25, 64, generator=gen),
        torch.randn(9, 64, generator=gen),
    )
    with torch.no_grad():
        refs = [hf(x[None])[0] for x in (xa, xb, xc)]
    pool, lens = _pool(ours), {}
    out = {0: [], 1: [], 2: []}
    # step 1: a prefills 30, b prefills 5
    for s, y in zip((0, 1), _run(ours, pool, lens, [(0, xa[:30]), (1, xb[:5])], gathered=gathered)):
        out[s].append(y)
    # steps: a decodes token by token while b prefills in pieces and c joins
    a_at, b_at, c_at = 30, 5, 0
    while a_at < 40 or b_at < 25 or c_at < 9:
        items = []
        if a_at < 40:
            items.append((0, xa[a_at : a_at + 1]))
            a_at += 1
        if b_at < 25:
            n = min(7, 25 - b_at)
            items.append((1, xb[b_at : b_at + n]))
            b_at += n
        if c_at < 9 and a_at > 33:
            n = 1 if c_at else 4
            items.append((2, xc[c_at : c_at + n]))
            c_at += n
        for (s, _), y in zip(items, _run(ours, pool, lens, items, gathered=gathered)):
            out[s].append(y)
    for s, ref in enumerate(refs):
        assert (torch.cat(out[s]) - ref).abs().max() < 1e-4 * max(1.0, ref.abs().max().item())


def test_layer_snapshots_restore_to_the_same_continuation():
    _, ours = _hf_gdn("qwen3_5_moe", LAYER_SHAPES["gva_r2_dk_ne_dv"], seed=6)
    x = torch.randn(100, 64, generator=torch.Generator().manual_seed(7))
    pool, lens = _pool(ours), {}
    # seq 0 (slot 1) prefills 10 then 90 tokens, snapshotting after 64 and after all 100 into slots 6 and 8
    _run(ours, pool, lens, [(0, x[:10])])
    _run(ours, pool, lens, [(0, x[10:])], snapshots=[(0, 64, 6), (0, 100, 8)])
    ref, lens_ref = _pool(ours), {}
    _run(ours, ref, lens_ref, [(0, x[:64])])
    assert torch.allclose(pool.conv[0][6], ref.conv[0][1]) and (pool.ssm[0][6] - ref.ssm[0][1]).abs().max() < 1e-5
    assert torch.equal(pool.conv[0][8], pool.conv[0][1]) and torch.equal(pool.ssm[0][8], pool.ssm[0][1])
    # restore the 64-token snapshot into seq 2's slot (5) and continue: same as the uninterrupted run
    pool.copy(torch.tensor([6]), torch.tensor([5]))
    lens[2] = 64
    y = _run(ours, pool, lens, [(2, x[64:70])])[0]
    y_ref = _run(ours, ref, lens_ref, [(0, x[64:70])])[0]
    assert (y - y_ref).abs().max() < 1e-4


def test_gathered_windows_equal_one_by_one():
    """A step of several sequences gathers every conv window at once (``gdn_state_windows.py``): outputs and every
    slot it writes (live windows and states, snapshots' windows and states) equal the one-by-one path's bit for bit,
    with windows that reach into the slot's previous window (a decode token, a snapshot 1 or 2 tokens in) and a
    fresh sequence's that reach into zeros (not into what its slot held)."""
    _, ours = _hf_gdn("qwen3_5_moe", LAYER_SHAPES["gva_r2_dk_ne_dv"], seed=8)
    x = torch.randn(6, 80, 64, generator=torch.Generator().manual_seed(9))
    pools = {}
    for gathered in (True, False):
        pool, lens = _pool(ours, slots=24), {}
        _run(ours, pool, lens, [(0, x[0, :20]), (1, x[1, :3]), (2, x[2, :40])], gathered=gathered)
        for slot in (7, 9, 11):  # the fresh sequences' slots hold what an earlier request left: never read
            pool.conv[0][slot] = 1.0 + slot
            pool.ssm[0][slot] = 1.0 + slot
        step = [(0, x[0, 20:21]), (1, x[1, 3:50]), (2, x[2, 40:42]), (3, x[3, :2]), (4, x[4, :70]), (5, x[5, :1])]
        snaps = [(1, 4, 13), (1, 50, 15), (2, 41, 17), (3, 1, 19), (4, 64, 21), (4, 70, 23), (5, 1, 12)]
        out = _run(ours, pool, lens, step, snapshots=snaps, gathered=gathered)
        pools[gathered] = (torch.cat(out), pool.conv[0].clone(), pool.ssm[0].clone())
    for got, want in zip(pools[True], pools[False]):
        assert torch.equal(got, want)


def test_hf_pitfall_blocked():
    """The HF references must be the torch bodies, not fla's kernels (REFERENCES §2.3)."""
    m35, mnext = R._hf_modules()
    for mod in (m35, mnext):
        fn = mod.torch_chunk_gated_delta_rule
        assert fn.__module__ == mod.__name__ and not hasattr(fn, "__wrapped__")


# ---------------------------------------------------------------------------------------------------------------
# the state pool
# ---------------------------------------------------------------------------------------------------------------


def test_state_pool_copy_and_sizes(monkeypatch):
    pool = RecurrentStatePool(3, 5, (12, 3), (4, 8, 6), torch.bfloat16, device="cpu")
    assert pool.ssm_dtype == torch.float32
    assert pool.conv[2].shape == (5, 12, 3) and pool.ssm[0].shape == (5, 4, 8, 6)
    per = 3 * (12 * 3 * 2 + 4 * 8 * 6 * 4)
    assert pool.bytes_per_slot() == per
    assert RecurrentStatePool.bytes_per_slot(3, (12, 3), (4, 8, 6), torch.bfloat16, torch.float32) == per
    assert pool.nbytes() == 5 * per
    for layer in range(3):
        pool.conv[layer].normal_()
        pool.ssm[layer].normal_()
    before = [(c.clone(), s.clone()) for c, s in zip(pool.conv, pool.ssm)]
    pool.copy(torch.tensor([0, 1]), torch.tensor([1, 4]))  # simultaneous: slot 1 <- old 0, slot 4 <- old 1
    for layer, (c, s) in enumerate(before):
        assert torch.equal(pool.conv[layer][1], c[0]) and torch.equal(pool.conv[layer][4], c[1])
        assert torch.equal(pool.ssm[layer][1], s[0]) and torch.equal(pool.ssm[layer][4], s[1])
        assert torch.equal(pool.ssm[layer][2], s[2])
    before = [(c.clone(), s.clone()) for c, s in zip(pool.conv, pool.ssm)]
    pool.copy(np.array([2, 0]), torch.tensor([3, 4]))  # disjoint (a restore, a capture): the multi-tensor copy
    for layer, (c, s) in enumerate(before):
        assert torch.equal(pool.conv[layer][3], c[2]) and torch.equal(pool.conv[layer][4], c[0])
        assert torch.equal(pool.ssm[layer][3], s[2]) and torch.equal(pool.ssm[layer][4], s[0])
        assert all(torch.equal(pool.ssm[layer][j], s[j]) and torch.equal(pool.conv[layer][j], c[j]) for j in (0, 1, 2))
    from freetoken.errors import InvalidPlan

    with pytest.raises(InvalidPlan):
        pool.copy([5], [0])
    monkeypatch.setenv("FREETOKEN_MAMBA_SSM_DTYPE", "bfloat16")
    assert default_ssm_dtype() == torch.bfloat16
    assert RecurrentStatePool(1, 2, (4, 3), (2, 2, 2), torch.float32).ssm[0].dtype == torch.bfloat16
    monkeypatch.setenv("FREETOKEN_MAMBA_SSM_DTYPE", "int8")
    with pytest.raises(ValueError):
        default_ssm_dtype()


# ---------------------------------------------------------------------------------------------------------------
# fla (GPU only)
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("decode", [False, True])
def test_fla_matches_torch(decode):
    from freetoken.layers.gated_deltanet import _fla_ops

    if _fla_ops() is None:
        pytest.skip("fla not importable")
    lens = [1, 1, 1] if decode else [7, 1, 130, 64]
    seqs = [rand_inputs(n, Hk=2, Hv=4, dk=64, dv=64, seed=50 + i) for i, n in enumerate(lens)]
    cat = [torch.cat([s[j] for s in seqs]).cuda() for j in range(5)]
    init = torch.stack([s[5] for s in seqs]).cuda()
    cu = [0]
    for n in lens:
        cu.append(cu[-1] + n)
    o_t, f_t, _ = gated_delta_rule(*cat, init.clone(), cu, decode=decode, backend="torch")
    o_f, f_f, _ = gated_delta_rule(*cat, init.clone(), cu, decode=decode, backend="fla")
    assert (o_f.float() - o_t).abs().max() < 2e-3
    assert (f_f.float() - f_t).abs().max() < 2e-3


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize(
    "lens, captures",
    [
        ([130, 64, 9], {0: [64, 100], 1: [64], 2: [1]}),  # the general rounds
        ([1, 1, 1, 130], {0: [1], 3: [64, 130]}),  # a prompt joining decode tokens: the rounds on views
    ],
)
def test_fla_captures_match_torch(lens, captures):
    from freetoken.layers.gated_deltanet import _fla_ops

    if _fla_ops() is None:
        pytest.skip("fla not importable")
    seqs = [rand_inputs(n, Hk=2, Hv=4, dk=64, dv=64, seed=60 + i) for i, n in enumerate(lens)]
    cat = [torch.cat([s[j] for s in seqs]).cuda() for j in range(5)]
    init = torch.stack([s[5] for s in seqs]).cuda()
    cu = [0, *itertools.accumulate(lens)]
    o_t, f_t, c_t = gated_delta_rule(*cat, init.clone(), cu, False, captures=captures, backend="torch")
    o_f, f_f, c_f = gated_delta_rule(*cat, init.clone(), cu, False, captures=captures, backend="fla")
    assert (o_f - o_t).abs().max() < 2e-3 and (f_f - f_t).abs().max() < 2e-3
    wanted = {key for key in c_t if key[0] in captures}  # the torch path also keeps every other piece end
    assert set(c_f) == wanted, (sorted(c_f), sorted(wanted))
    for key in wanted:
        assert (c_f[key] - c_t[key]).abs().max() < 2e-3, key


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("n, captures", [(600, [576, 600]), (150, [64, 150]), (40, [13, 40])])
def test_fla_single_sequence_captures_match_torch(n, captures):
    """A cached turn's chunk: pieces on views, the tail after the grid snapshot token by token
    (``kernels/gdn_recurrent_piece.py``)."""
    from freetoken.layers.gated_deltanet import _fla_ops

    if _fla_ops() is None:
        pytest.skip("fla not importable")
    q, k, v, g, beta, init = (x.cuda() for x in rand_inputs(n, Hk=2, Hv=4, dk=64, dv=64, seed=70))
    cu, caps = [0, n], {0: captures}
    o_t, f_t, c_t = gated_delta_rule(q, k, v, g, beta, init[None].clone(), cu, False, captures=caps, backend="torch")
    o_f, f_f, c_f = gated_delta_rule(q, k, v, g, beta, init[None].clone(), cu, False, captures=caps, backend="fla")
    assert (o_f - o_t).abs().max() < 2e-3 and (f_f - f_t).abs().max() < 2e-3
    for key, state in c_t.items():
        assert (c_f[key] - state).abs().max() < 2e-3, key


def test_which_pieces_go_token_by_token():
    """Short pieces run token by token, except those that start on a chunk boundary of the call after its start
    (a fresh prompt's tail after its last grid point: fla's chunks then are the uncut call's)."""
    assert token_by_token(0, 37) and token_by_token(37, 64) and token_by_token(2136, 2184)  # an off-grid cached turn
    assert not token_by_token(3968, 4000) and not token_by_token(64, 100)  # on a chunk boundary: chunked
    assert not token_by_token(0, SHORT_PIECE) and not token_by_token(37, 37 + SHORT_PIECE)  # long: chunked


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("graphs", [False, True])
@pytest.mark.parametrize("n, captures", [(4000, [3968, 4000]), (600, [576, 600]), (130, [64, 128, 130])])
def test_fla_cut_on_chunk_boundaries_equals_the_uncut_call(n, captures, graphs):
    """A fresh prompt's chunk cut at its grid points (snapshots) gives, bit for bit, the output and final state of
    the same chunk uncut (what ``--cache-type naive`` runs), at Qwen3.6's GDN shape in bf16, with and without the
    GDN prefill graphs: fla's chunks of the pieces are the uncut call's, and the state passes between them in fp32
    as fla carries it between chunks. The captured states are the uncut call's states there (fla's, to rounding)."""
    from freetoken.layers import gated_deltanet as gdn
    from freetoken.layers.gdn_prefill_graphs import GdnPrefillGraphs

    if gdn._fla_ops() is None or gdn._fla_direct_ops() is None:
        pytest.skip("fla not importable, or internals this fla version does not have")
    Hk, Hv, d = 16, 32, 128
    pg = None
    if graphs:
        pg = GdnPrefillGraphs(gdn.fla_direct_prefill, Hk, Hv, d, d, torch.bfloat16, torch.device("cuda"), 4096)
        pg.capture()
    q, k, v, g, beta, init = (x.cuda() for x in rand_inputs(n, Hk, Hv, d, d, seed=83))
    q, k, v = (x.to(torch.bfloat16) for x in (q, k, v))
    zero = torch.zeros_like(init)[None]
    # clones: with graphs the outputs may be the graph's buffers, which the next replay overwrites
    run = lambda caps: [  # noqa: E731
        x.clone() if torch.is_tensor(x) else x
        for x in gdn.gated_delta_rule(q, k, v, g, beta, zero.clone(), [0, n], False, caps, "fla", pg)
    ]
    o_u, f_u, _ = run(None)
    o_c, f_c, cap = run({0: captures})
    assert o_c.dtype == o_u.dtype == torch.bfloat16
    assert torch.equal(o_c, o_u) and torch.equal(f_c, f_u)
    for at in captures[:-1]:
        cut = (x[:at] for x in (q, k, v, g, beta))
        _, f_at, _ = gdn.gated_delta_rule(*cut, zero.clone(), [0, at], False, None, "fla", pg)
        assert torch.equal(cap[(0, at)], f_at[0]), at


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("n", [1, 63, 64, 200, 2184])
def test_fla_direct_matches_public(n):
    """One sequence runs below fla's entry point (``fla_direct_prefill``): the same kernels, so the same output and
    final state, bit for bit, as fla's public ``chunk_gated_delta_rule``; and the dispatch takes that route."""
    from freetoken.layers import gated_deltanet as gdn

    if gdn._fla_ops() is None or gdn._fla_direct_ops() is None:
        pytest.skip("fla not importable, or internals this fla version does not have")
    q, k, v, g, beta, init = (x.cuda() for x in rand_inputs(n, Hk=2, Hv=4, dk=64, dv=64, seed=80))
    q, k, v = (x.to(torch.bfloat16).contiguous() for x in (q, k, v))
    chunk, _, takes_cpu_cu = gdn._fla_ops()
    o_p, f_p = gdn._fla_public_chunk(chunk, takes_cpu_cu, q, k, v, g, beta, init[None].clone(), [0, n])
    o_d, f_d = gdn.fla_direct_prefill(q, k, v, g, beta, init[None].clone())
    assert o_d.dtype == o_p.dtype == torch.bfloat16
    assert torch.equal(o_d, o_p) and torch.equal(f_d, f_p)
    o_r, f_r = gdn._fla_gated_delta_rule(q, k, v, g, beta, init[None].clone(), [0, n], False)
    assert torch.equal(o_r, o_d) and torch.equal(f_r, f_d)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("lens", [[7] * 32, [200] + [1] * 31, [63, 64, 200, 5], [2184, 3]])
def test_fla_direct_varlen_matches_public(lens):
    """Several sequences run below fla's entry point too, with the step's varlen index (``_fla_varlen_index``):
    the same output and final states, bit for bit, as fla's public varlen call; and the dispatch takes that route."""
    from freetoken.layers import gated_deltanet as gdn

    if gdn._fla_ops() is None or not gdn._fla_direct_varlen():
        pytest.skip("fla not importable, or internals this fla version does not have")
    T, N = sum(lens), len(lens)
    q, k, v, g, beta, _ = (x.cuda() for x in rand_inputs(T, Hk=2, Hv=4, dk=64, dv=64, seed=81))
    q, k, v = (x.to(torch.bfloat16).contiguous() for x in (q, k, v))
    init = 0.3 * torch.randn(N, 4, 64, 64, generator=torch.Generator().manual_seed(82)).cuda()
    cu = [0, *torch.tensor(lens).cumsum(0).tolist()]
    chunk, _, takes_cpu_cu = gdn._fla_ops()
    o_p, f_p = gdn._fla_public_chunk(chunk, takes_cpu_cu, q, k, v, g, beta, init.clone(), cu)
    o_d, f_d = gdn.fla_direct_prefill(q, k, v, g, beta, init.clone(), gdn._fla_varlen_index(tuple(cu), q.device))
    assert o_d.dtype == o_p.dtype == torch.bfloat16
    assert torch.equal(o_d, o_p) and torch.equal(f_d, f_p)
    o_r, f_r = gdn._fla_gated_delta_rule(q, k, v, g, beta, init.clone(), cu, False)
    assert torch.equal(o_r, o_d) and torch.equal(f_r, f_d)


def test_fla_direct_refuses_a_result_of_another_shape(monkeypatch):
    """An fla whose ``chunk_gated_delta_rule_fwd`` takes the expected parameters but returns other than its six
    values is refused with a message, not read as the wrong tensors (stand-ins for fla's functions, on the CPU)."""
    from freetoken.layers import gated_deltanet as gdn

    def l2norm_fwd(x):
        return x, None

    def fwd(q, k, v, g, beta, scale, initial_state, output_final_state):
        return v, v, initial_state, v, initial_state  # five values, not (g, o, A, final_state, h0, g_input)

    monkeypatch.setattr(gdn, "_fla_direct_ops", lambda: (l2norm_fwd, fwd))
    q, k, v, g, beta, init = rand_inputs(5)
    with pytest.raises(RuntimeError, match="returned 5 values"):
        gdn.fla_direct_prefill(q, k, v, g, beta, init[None])
