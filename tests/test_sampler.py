"""layers/sampler.py: greedy, filters, per-row seeds, and the sampled distribution."""

from __future__ import annotations

import pytest
import torch

from freetoken.layers.sampler import sample


def _params(n, temperature=1.0, top_p=1.0, top_k=0, min_p=0.0, seeds=None):
    f = lambda x: torch.full((n,), float(x), dtype=torch.float32)  # noqa: E731
    return dict(
        temperature=f(temperature),
        top_p=f(top_p),
        top_k=torch.full((n,), int(top_k), dtype=torch.int64),
        min_p=f(min_p),
        seeds=torch.arange(n, dtype=torch.int64) if seeds is None else torch.tensor(seeds),
    )


def test_greedy_is_argmax_and_logprob_is_raw_log_softmax():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 100, generator=g) * 3
    tok, lp = sample(logits, **_params(6, temperature=0.0))
    assert torch.equal(tok, logits.argmax(-1))
    assert torch.allclose(lp, torch.log_softmax(logits, -1).gather(1, tok[:, None]).squeeze(1))


def test_top_k_1_is_greedy_whatever_the_temperature():
    logits = torch.randn(5, 50, generator=torch.Generator().manual_seed(1))
    tok, _ = sample(logits, **_params(5, temperature=1.7, top_k=1, seeds=[9, 8, 7, 6, 5]))
    assert torch.equal(tok, logits.argmax(-1))


def test_seeded_draw_is_independent_of_the_batch():
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(8, 300, generator=g)
    seeds = [11, 22, 33, 44, 55, 66, 77, 1 << 63]  # the last is u64 bits >= 2^63 carried as a negative i64
    seeds_i64 = [s - (1 << 64) if s >= 1 << 63 else s for s in seeds]
    full, _ = sample(logits, **_params(8, temperature=0.9, top_p=0.95, seeds=seeds_i64))
    for i in range(8):
        alone, _ = sample(logits[i : i + 1], **_params(1, temperature=0.9, top_p=0.95, seeds=[seeds_i64[i]]))
        assert int(alone[0]) == int(full[i])
    # reversed batch, mixed with greedy rows
    idx = list(reversed(range(8)))
    p = _params(8, temperature=0.9, top_p=0.95, seeds=[seeds_i64[i] for i in idx])
    p["temperature"][::2] = 0.0
    mixed, _ = sample(logits[idx], **p)
    for j, i in enumerate(idx):
        want = int(logits[i].argmax()) if j % 2 == 0 else int(full[i])
        assert int(mixed[j]) == want
    # same seed, same token; many seeds, many tokens
    again, _ = sample(logits, **_params(8, temperature=0.9, top_p=0.95, seeds=seeds_i64))
    assert torch.equal(again, full)
    flat = torch.zeros(64, 300)
    many, _ = sample(flat, **_params(64, seeds=list(range(64))))
    assert len(set(many.tolist())) > 30


def test_top_k_top_p_min_p_masks():
    # probabilities 0.4, 0.3, 0.2, 0.1 on tokens 3, 1, 0, 2 (and -inf elsewhere)
    probs = torch.full((8,), 0.0)
    probs[[3, 1, 0, 2]] = torch.tensor([0.4, 0.3, 0.2, 0.1])
    logits = torch.log(probs).expand(400, 8).contiguous()
    seeds = list(range(400))

    def drawn(**kw):
        tok, _ = sample(logits, **_params(400, seeds=seeds, **kw))
        return set(tok.tolist())

    assert drawn() == {3, 1, 0, 2}
    assert drawn(top_k=2) == {3, 1}
    assert drawn(top_p=0.65) == {3, 1}  # 0.4 < 0.65, 0.4 + 0.3 >= 0.65
    assert drawn(top_p=0.7 + 1e-4) == {3, 1, 0}
    assert drawn(top_p=0.01) == {3}  # the most likely token always survives
    assert drawn(min_p=0.45) == {3, 1, 0}  # p >= 0.45 * 0.4 = 0.18
    assert drawn(min_p=0.76) == {3}
    assert drawn(top_k=3, min_p=0.6) == {3, 1}


def test_distribution_matches_softmax_over_seeds():
    """Chi-square goodness of fit on 4000 seeded draws of a fixed 6-token distribution at temperature 0.7.
    df = 5; the 99.99th percentile of chi2(5) is ~25.7, so a correct sampler fails with p < 1e-4 (and the seeds
    are fixed, so it is deterministic). A sampler that ignores temperature gives chi2 in the hundreds."""
    base = torch.tensor([2.0, 1.0, 0.5, 0.0, -0.5, -1.0])
    n = 4000
    logits = base.expand(n, 6).contiguous()
    tok, lp = sample(logits, **_params(n, temperature=0.7, seeds=[1000 + i for i in range(n)]))
    counts = torch.bincount(tok, minlength=6).double()
    expected = torch.softmax(base.double() / 0.7, -1) * n
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    assert chi2 < 25.7, (counts.tolist(), expected.tolist())
    # the wrong temperature is detected by the same statistic
    wrong = torch.softmax(base.double(), -1) * n
    assert float(((counts - wrong) ** 2 / wrong).sum()) > 100
    # logprobs are the model's own (temperature 1), not the scaled distribution's
    assert torch.allclose(lp, torch.log_softmax(base, -1)[tok])


def test_empty_batch():
    tok, lp = sample(torch.zeros(0, 10), **_params(0))
    assert tok.shape == (0,) and lp.shape == (0,)


@pytest.mark.gpu
def test_seeded_draw_same_on_cuda_and_cpu():
    logits = torch.randn(16, 1000, generator=torch.Generator().manual_seed(3))
    p = _params(16, temperature=0.8, top_p=0.9, top_k=50)
    a, _ = sample(logits, **p)
    b, _ = sample(logits.cuda(), **p)
    assert torch.equal(a, b.cpu())


def test_uniform_from_seed_is_splitmix64():
    from freetoken.layers.sampler import uniform_from_seed

    def splitmix64(seed):
        m = (1 << 64) - 1
        z = (seed + 0x9E3779B97F4A7C15) & m
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & m
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & m
        return z ^ (z >> 31)

    seeds = [0, 1, 12345, (1 << 63) - 1, 1 << 63, (1 << 64) - 1]
    as_i64 = torch.tensor([s - (1 << 64) if s >= 1 << 63 else s for s in seeds], dtype=torch.int64)
    got = uniform_from_seed(as_i64).tolist()
    assert splitmix64(0) == 0xE220A8397B1DCDAF  # the published first output for seed 0
    assert got == [(splitmix64(s) >> 11) / float(1 << 53) for s in seeds]
    assert all(0.0 <= u < 1.0 for u in got)


def test_sampling_runs_without_host_sync():
    """The draw is fixed-shape device work: nothing reads a value back to the host (CUDA-graph capturable)."""
    from freetoken.engine.sync_audit import no_host_sync
    from freetoken.layers.sampler import draw_tokens, greedy_tokens

    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(4))
    p = _params(3, temperature=0.8, top_p=0.9, top_k=5, min_p=0.01)
    with no_host_sync():
        greedy_tokens(logits)
        draw_tokens(logits, p["temperature"], p["top_p"], p["top_k"], p["min_p"], p["seeds"])


def test_penalties_subtract_presence_once_and_frequency_per_count():
    from freetoken.layers.sampler import apply_penalties

    logits = torch.zeros(2, 5)
    counts = torch.tensor([[0, 1, 3, 0, 0], [2, 0, 0, 0, 1]], dtype=torch.int32)
    out = apply_penalties(logits, counts, torch.tensor([0.5, 0.0]), torch.tensor([0.25, 1.0]))
    assert torch.allclose(out, torch.tensor([[0, -0.75, -1.25, 0, 0], [-2.0, 0, 0, 0, -1.0]]))
