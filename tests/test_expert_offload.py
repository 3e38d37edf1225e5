"""Expert offload (``--moe-backend offload``) against all-resident experts: the slot cache's LRU bookkeeping, the
prefill stream, and a tiny Qwen3.5-MoE run through both backends (prefill chunks on the stream path, decode on the
cache path, caches too small to hold one step's experts) with equal logits and equal greedy tokens."""

from __future__ import annotations

import hf_reference as R
import pytest
import torch

from freetoken.layers.fused_linear import fuse_projections
from freetoken.models.base import ModelConfig
from freetoken.models.registry import model_class
from freetoken.moe.offload import ExpertOffload
from freetoken.moe.prefill_stream import PrefillExpertStream
from freetoken.moe.slot_cache import ExpertSlotCache

E, L = 8, 3


def _banks(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(E, 6, 4, generator=g), torch.randn(E, 4, 3, generator=g)) for _ in range(L)]


def _lookup(cache, banks, layer, ids):
    return cache.lookup(layer, banks[layer][0], banks[layer][1], torch.tensor(ids))


def test_slot_cache_maps_every_routed_expert_to_a_slot_holding_its_weights():
    banks = _banks()
    cache = ExpertSlotCache(12, L, E, (6, 4), (4, 3), torch.float32, torch.device("cpu"))
    g = torch.Generator().manual_seed(1)
    distinct = 0
    for step in range(200):
        layer = step % L
        ids = torch.randint(0, E, (3, 2), generator=g)
        distinct += len(set(ids.flatten().tolist()))
        slots = _lookup(cache, banks, layer, ids.tolist())
        assert slots.shape == ids.shape
        for e, s in zip(ids.flatten().tolist(), slots.flatten().tolist()):
            assert torch.equal(cache.gate_up[s], banks[layer][0][e]) and torch.equal(cache.down[s], banks[layer][1][e])
        cache.check_integrity()
    assert cache.hits + cache.misses == distinct  # each distinct expert of a lookup counts once
    assert cache.hits > 0 and cache.misses > 0


def test_slot_cache_is_lru_and_counts_hits_and_misses():
    banks = _banks()
    cache = ExpertSlotCache(3, L, E, (6, 4), (4, 3), torch.float32, torch.device("cpu"), policy="lru")
    _lookup(cache, banks, 0, [[0, 1]])  # misses 0, 1
    _lookup(cache, banks, 1, [[0]])  # miss (layer 1, 0): the cache is full now
    assert (cache.hits, cache.misses) == (0, 3)
    _lookup(cache, banks, 0, [[0]])  # hit; (0, 1) is now the least recently used
    assert (cache.hits, cache.misses) == (1, 3)
    _lookup(cache, banks, 2, [[5]])  # miss: evicts (0, 1)
    assert cache.resident(0) == [0] and cache.resident(1) == [0] and cache.resident(2) == [5]
    # a lookup never evicts what it uses itself: three misses replace everything but nothing it needs
    _lookup(cache, banks, 0, [[1, 2], [3, 1]])
    assert cache.resident(0) == [1, 2, 3] and cache.resident(1) == [] and cache.resident(2) == []
    cache.check_integrity()


def test_slot_cache_lfu_keeps_the_often_routed_experts_and_forgets_with_age():
    banks = _banks()
    cache = ExpertSlotCache(3, L, E, (6, 4), (4, 3), torch.float32, torch.device("cpu"), age_every=8)
    for _ in range(3):
        _lookup(cache, banks, 0, [[0, 1]])  # (0, 0) and (0, 1) routed 3 times each
    _lookup(cache, banks, 1, [[4]])  # the third slot
    _lookup(cache, banks, 2, [[5]])  # evicts (1, 4), routed once: LRU would have evicted (0, 0)
    assert cache.resident(0) == [0, 1] and cache.resident(1) == [] and cache.resident(2) == [5]
    _lookup(cache, banks, 1, [[4]])  # back, now routed twice: evicts (2, 5), the one routed once
    assert cache.resident(1) == [4] and cache.resident(2) == []
    _lookup(cache, banks, 0, [[2]])  # a call never evicts its own: (1, 4) is the least routed left
    assert cache.resident(0) == [0, 1, 2] and cache.resident(1) == []
    assert cache.freq[0] == 3 and cache.freq[1 * E + 4] == 2
    _lookup(cache, banks, 2, [[6]])  # the 8th lookup halves every count first (3 -> 1, 2 -> 1, 1 -> 0)
    assert cache.freq[0] == 1 and cache.freq[1 * E + 4] == 1 and cache.freq[2 * E + 6] == 1
    assert cache.resident(0) == [0, 1] and cache.resident(2) == [6]  # (0, 2), counted 0 after the halving, went
    cache.check_integrity()


def test_lfu_hits_more_than_lru_under_skewed_routing():
    """The reason for the default: per-layer Zipf routing (as FREETOKEN_BENCH_ROUTING=zipf draws it) over a cache
    of a few experts a layer. Counts, not timings."""
    from freetoken.moe import bench_routing

    layers, experts, k, slots = 6, 64, 4, 48
    banks = [(torch.zeros(experts, 1, 1), torch.zeros(experts, 1, 1)) for _ in range(layers)]
    rates = {}
    for policy in ("lfu", "lru"):
        torch.manual_seed(0)
        cache = ExpertSlotCache(slots, layers, experts, (1, 1), (1, 1), torch.float32, torch.device("cpu"), policy)
        bench_routing.set_mode("zipf")
        try:
            for _ in range(300):
                for layer in range(layers):
                    cache.lookup(
                        layer,
                        *banks[layer],
                        bench_routing.override(torch.zeros(1, k, dtype=torch.long), layer, experts),
                    )
        finally:
            bench_routing.set_mode("off")
        rates[policy] = cache.hits / (cache.hits + cache.misses)
    assert rates["lfu"] > rates["lru"] + 0.05, rates


def test_slot_cache_refuses_a_step_needing_more_experts_than_slots():
    banks = _banks()
    cache = ExpertSlotCache(2, L, E, (6, 4), (4, 3), torch.float32, torch.device("cpu"))
    assert _lookup(cache, banks, 0, [[0, 1], [2, 0]]) is None
    assert (cache.hits, cache.misses) == (0, 0) and cache.resident(0) == []


def test_prefill_stream_returns_each_layer_whole():
    banks = _banks()
    stream = PrefillExpertStream(banks, (E, 6, 4), (E, 4, 3), torch.float32, torch.device("cpu"))
    assert not stream.overlap  # CPU: one buffer, synchronous copies
    for layer in (0, 1, 2, 2, 0):
        gate_up, down = stream.layer_weights(layer)
        assert torch.equal(gate_up, banks[layer][0]) and torch.equal(down, banks[layer][1])
    assert stream.layers_copied == 4  # the repeated layer 2 was still in the buffer


# ------------------------------------------------------------------------------------------------------------
# A tiny Qwen3.5-MoE through both backends
# ------------------------------------------------------------------------------------------------------------

CONFIG = R.qwen3_5_moe_config(num_experts=16, num_experts_per_tok=2)


@pytest.fixture(scope="module")
def hf():
    return R.build_hf_model(CONFIG, seed=3)


def _offloaded(hf, slots: int, device: str = "cpu", hit_d2d: bool = False):
    cfg = ModelConfig.from_dict(CONFIG)
    off = ExpertOffload(torch.device(device), torch.float32, top_k=2, hit_d2d=hit_d2d)
    with torch.device(device):
        model = model_class(cfg)(cfg, experts_factory=off.make_experts).float().eval()
    model.load_weights(list(hf.state_dict().items()))
    fuse_projections(model)
    off.finish_loading()
    off.allocate_cache(slots)
    return model, off


def _run(model, prompts, steps, device="cpu", late_prompts=()):
    """Prefill (two chunks per prompt, so a chunk continues from a cached prefix), then greedy decode of every
    sequence batched together; ``late_prompts`` are prefilled after half the decode steps (a prefill streamed
    while decode has filled the cache). Returns the logits of every step and the generated tokens."""
    eng = R.TinyEngine(model, max_seqs=len(prompts) + len(late_prompts), device=device)
    logits, out = [], {}

    def prefill(s, p):
        half = len(p) // 2
        eng.step([(s, p[:half], False)], all_logits=True)
        last = eng.step([(s, p[half:])], all_logits=True)[0]
        logits.append(last)
        out[s] = [int(last[-1].argmax())]

    for s, p in enumerate(prompts):
        prefill(s, p)
    for step in range(steps):
        if step == steps // 2:
            for s, p in enumerate(late_prompts, start=len(prompts)):
                prefill(s, p)
        rows = eng.step([(s, [out[s][-1]]) for s in out])
        logits.append(torch.stack(rows))
        for s, row in zip(out, rows):
            out[s].append(int(row.argmax()))
    return logits, out


@pytest.mark.parametrize("slots", [1, 3, 6, 8, 64])
def test_offload_matches_resident_experts(hf, slots):
    """1 and 3 slots: a decode step's 3 tokens x top-2 pairs could need more experts than the cache holds, so
    every layer is streamed; 6 (as many slots as pairs) and 8: churn; 64: every expert of every layer fits.
    Logits and greedy tokens equal the all-resident model's."""
    prompts = [R.prompt(24, seed=1), R.prompt(9, seed=2), R.prompt(17, seed=3)]
    ref_model = R.build_ours(CONFIG, hf)
    ref_logits, ref_tokens = _run(ref_model, prompts, steps=12)
    model, off = _offloaded(hf, slots)
    logits, tokens = _run(model, prompts, steps=12)
    assert tokens == ref_tokens
    for a, b in zip(logits, ref_logits):
        torch.testing.assert_close(a, b, atol=2e-5, rtol=1e-5)
    hits, misses = off.counters()
    if slots >= 6:  # decode steps (3 tokens x top-2 < 16 experts) went through the cache
        assert misses > 0
    if slots == 64:
        assert hits > misses  # the working set stays resident once loaded
    if slots < 6:
        assert (hits, misses) == (0, 0)  # nothing fit: every layer streamed
    assert off.stream.layers_copied > 0  # prefill chunks streamed whole layers
    off.cache.check_integrity()


def test_prefill_stream_copies_what_the_cache_holds_from_its_slots():
    """``--moe-prefill-hit-d2d``: after decode-like admissions the streamed layers still equal the banks, the
    cache's experts came from their slots (a slot read under a stale map would hold another expert's weights), and
    a later forward reads the map again after the cache moved."""
    from freetoken.moe.device_slot_cache import DeviceExpertCache

    banks = _banks()
    cache = DeviceExpertCache(10, L, E, (6, 4), (4, 3), torch.float32, torch.device("cpu"))
    stream = PrefillExpertStream(banks, (E, 6, 4), (E, 4, 3), torch.float32, torch.device("cpu"))
    stream.use_cache(cache)
    g = torch.Generator().manual_seed(5)
    for round_ in range(4):
        for _ in range(6):  # decode steps: every layer admits a few experts, evicting others
            for layer in range(L):
                cache.ensure(layer, *banks[layer], torch.randint(0, E, (2, 2), generator=g))
        resident = sum(len(cache.resident(layer)) for layer in range(L))
        assert resident > 0
        before = (stream.experts_from_cache, stream.experts_from_host)
        for layer in range(L):  # one streamed forward
            gate_up, down = stream.layer_weights(layer)
            assert torch.equal(gate_up, banks[layer][0]) and torch.equal(down, banks[layer][1]), (round_, layer)
        assert stream.experts_from_cache - before[0] == resident
        assert stream.experts_from_host - before[1] == L * E - resident
    assert stream.resident.refreshes == 4


@pytest.mark.parametrize("hit_d2d", [False, True])
def test_offload_prefill_after_decode_matches_resident_experts(hf, hit_d2d):
    """A prompt prefilled (streamed) while the cache holds decode's experts, with and without copying those from
    their slots: logits and greedy tokens equal the all-resident model's."""
    prompts, late = [R.prompt(24, seed=1), R.prompt(9, seed=2)], [R.prompt(31, seed=4)]
    ref_logits, ref_tokens = _run(R.build_ours(CONFIG, hf), prompts, steps=10, late_prompts=late)
    model, off = _offloaded(hf, 12, hit_d2d=hit_d2d)
    logits, tokens = _run(model, prompts, steps=10, late_prompts=late)
    assert tokens == ref_tokens
    for a, b in zip(logits, ref_logits):
        torch.testing.assert_close(a, b, atol=2e-5, rtol=1e-5)
    assert (off.stream.experts_from_cache > 0) == hit_d2d


@pytest.mark.parametrize("slots,fits", [(5, 2), (6, 3), (8, 4), (64, 4)])
def test_the_cache_takes_decode_batches_whose_pairs_fit_the_slots_and_the_layer(slots, fits):
    """8 experts, top-2: a batch runs over the cache while its pairs (all possibly distinct) fit the slots and are
    no more than the layer's experts (then the cache never fetches more than streaming copies); the decode CUDA
    graphs stop at the largest such batch."""
    from freetoken.moe.offload import ExpertOffload

    off = ExpertOffload(torch.device("cpu"), torch.float32, top_k=2)
    for layer in range(2):
        off.make_experts(layer, 8, 4, 2)
    off.finish_loading()
    off.allocate_cache(slots)
    assert off.max_cached_batch() == fits
    assert off.uses_cache(2 * fits, 8) and not off.uses_cache(2 * fits + 2, 8)
    # a graph capture (num_valid_tokens set) that would stream a layer is refused, not recorded
    from freetoken.moe.offloaded_experts import device_weights

    x, ids, w = torch.zeros(fits + 1, 4), torch.zeros(fits + 1, 2, dtype=torch.long), torch.ones(fits + 1, 2)
    off.num_valid_tokens = torch.tensor(fits + 1)
    with pytest.raises(RuntimeError, match="max_cached_batch"):
        device_weights(off, 0, off.layers[0].host_banks(), x, ids, w)
    off.num_valid_tokens = None
    assert device_weights(off, 0, off.layers[0].host_banks(), x, ids, w)[2].shape


def test_cache_policy_from_the_environment_and_a_bad_one_refused_before_loading(monkeypatch):
    from freetoken.moe.offload import ExpertOffload

    monkeypatch.setenv("FREETOKEN_MOE_CACHE_POLICY", "lru")
    off = ExpertOffload(torch.device("cpu"), torch.float32, top_k=2)
    off.make_experts(0, 8, 4, 2)
    off.finish_loading()
    off.allocate_cache(4)
    assert off.cache.policy == "lru"
    monkeypatch.setenv("FREETOKEN_MOE_CACHE_POLICY", "fifo")
    with pytest.raises(ValueError, match="FREETOKEN_MOE_CACHE_POLICY='fifo': expected one of lfu, lru"):
        ExpertOffload(torch.device("cpu"), torch.float32, top_k=2)


def test_expert_offload_sizes(hf):
    _, off = _offloaded(hf, 4)
    layers = CONFIG["text_config"]["num_hidden_layers"]
    H, I = CONFIG["text_config"]["hidden_size"], CONFIG["text_config"]["moe_intermediate_size"]
    assert off.total_experts == 16 * layers
    assert off.expert_bytes == 3 * H * I * 4
    assert off.cache.nbytes == 4 * off.expert_bytes
    assert off.cache_slots({"moe_cache_size": 10}, None) == (10, "--moe-cache-size")
    assert off.cache_slots({"moe_cache_size": 10**6}, None)[0] == off.total_experts
    assert off.cache_slots({"moe_cache_rate": 0.5}, None) == (off.total_experts // 2, "--moe-cache-rate")
    assert off.cache_slots({}, None) == (off.total_experts, "auto (every expert)")
    assert off.cache_slots({}, 5 * off.expert_bytes + 1) == (5, "auto")
    with pytest.raises(MemoryError, match="kv-reserve-tokens"):
        off.cache_slots({}, off.expert_bytes - 1)


@pytest.mark.parametrize("mode", ["uniform", "zipf", "hot"])
def test_bench_routing_draws_distinct_experts_with_the_asked_skew(monkeypatch, mode):
    import freetoken.layers.moe as moe
    from freetoken.moe import bench_routing

    monkeypatch.setattr(bench_routing, "_mode", mode)
    cfg = ModelConfig.from_dict(dict(hidden_size=8, num_experts=64, num_experts_per_tok=4, moe_intermediate_size=4))
    ids, w = moe.SparseMoeBlock(cfg, layer_id=1).route(torch.randn(4000, 8))
    assert ids.shape == w.shape == (4000, 4) and 0 <= int(ids.min()) and int(ids.max()) < 64
    assert all(len(set(row)) == 4 for row in ids.tolist())  # top-k experts are distinct
    share_of_top = torch.bincount(ids.flatten(), minlength=64).max().item() / ids.numel()
    # uniform: each expert ~1/64 of the picks; Zipf(1) over 64: the most popular ~1/H(64) ≈ 21% of draws;
    # hot: the same 4 experts for every token
    assert {"uniform": share_of_top < 0.03, "zipf": share_of_top > 0.1, "hot": share_of_top == 0.25}[mode]


def test_bench_routing_mode_switches_through_its_file(tmp_path, monkeypatch):
    from freetoken.moe import bench_routing

    monkeypatch.setattr(bench_routing, "_mode", "off")
    path = tmp_path / "routing"
    control = bench_routing.BenchRoutingControl(str(path))
    assert not control.poll()  # no file yet
    path.write_text("zipf\n")
    assert control.poll() and bench_routing.mode() == "zipf"
    assert not control.poll()  # unchanged
    with pytest.raises(ValueError, match="expected one of"):
        bench_routing.set_mode("sideways")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("hit_d2d", [False, True])
def test_offload_matches_resident_experts_on_cuda(hf, hit_d2d):
    """The CUDA paths: pinned banks, the two-buffer stream with its side-stream copies and events (with
    ``hit_d2d``, the gather kernel copying the cache's experts from their slots on the copy stream), the Triton
    grouped kernel over the slot pool."""
    prompts, late = [R.prompt(40, seed=1), R.prompt(23, seed=2)], [R.prompt(37, seed=4)]
    ref = R.build_ours(CONFIG, hf).cuda()
    model, off = _offloaded(hf, 5, "cuda", hit_d2d=hit_d2d)
    assert off.pinned and off.stream.overlap
    a_logits, a_tokens = _run(ref, prompts, 10, "cuda", late_prompts=late)
    b_logits, b_tokens = _run(model, prompts, 10, "cuda", late_prompts=late)
    assert a_tokens == b_tokens
    for a, b in zip(a_logits, b_logits):  # (the H200 showed one logit of 3200 off by 1.17e-3 at this scale)
        torch.testing.assert_close(a, b, atol=2e-3, rtol=1e-3)
    assert off.counters()[1] > 0 and off.stream.layers_copied >= 2 * len(off.layers)
    assert (off.stream.experts_from_cache > 0) == hit_d2d


def test_auto_backend_offloads_only_a_model_that_does_not_fit_on_cuda():
    from freetoken.errors import UnsupportedModel
    from freetoken.moe.backend_choice import device_bytes_needed, resolve_moe_backend

    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert resolve_moe_backend("auto", True, cuda, model_bytes=10, available_bytes=9) == "offload"
    assert resolve_moe_backend("auto", True, cuda, model_bytes=9, available_bytes=10) == "fused"
    assert resolve_moe_backend("auto", True, cpu, model_bytes=10, available_bytes=9) == "fused"
    assert resolve_moe_backend("offload", False, cuda) == "fused"  # dense: nothing to offload
    assert resolve_moe_backend("offload", True, cpu) == "offload"
    assert resolve_moe_backend("hybrid", True, cuda) == "hybrid" and resolve_moe_backend("cpu", True, cpu) == "cpu"
    with pytest.raises(UnsupportedModel, match="unknown --moe-backend magic"):
        resolve_moe_backend("magic", True, cuda)
    cfg = ModelConfig.from_dict(CONFIG)
    weights_only = device_bytes_needed(model_class(cfg), cfg, torch.bfloat16, 0)
    with torch.device("meta"):
        n = sum(p.numel() for p in model_class(cfg)(cfg).parameters())
    assert weights_only == 2 * n and device_bytes_needed(model_class(cfg), cfg, torch.bfloat16, 100) > weights_only
