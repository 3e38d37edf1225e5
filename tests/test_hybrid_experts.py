"""The hybrid and cpu MoE backends (``moe/hybrid_experts.py``): the expert cache admits at most ``max_fetch`` misses
a layer and the host CPU computes the pairs of the others. A tiny Qwen3.5-MoE through them against all-resident
experts, a call with wrong buffers refused, and on CUDA the hand-off (the mailbox's kernels and thread) inside a
captured decode graph replayed with new routing. The mailbox alone: ``test_host_expert_mailbox.py``."""

from __future__ import annotations

import hf_reference as R
import pytest
import torch

from freetoken.kernels.fused_moe import fused_moe_torch
from freetoken.layers.fused_linear import fuse_projections
from freetoken.models.base import ModelConfig
from freetoken.models.registry import model_class
from freetoken.moe.cpu_experts import CpuExperts
from freetoken.moe.fetch_cap import FetchCap
from freetoken.moe.offload import ExpertOffload

CONFIG = R.qwen3_5_moe_config(num_experts=16, num_experts_per_tok=2)
BF16 = torch.bfloat16


@pytest.fixture(scope="module")
def hf():
    return R.build_hf_model(CONFIG, seed=3)


def _hybrid(hf, slots: int, max_fetch, device: str = "cpu"):
    cfg = ModelConfig.from_dict(CONFIG)
    off = ExpertOffload(torch.device(device), BF16, top_k=2)
    with torch.device(device):
        model = model_class(cfg)(cfg, experts_factory=off.make_experts).to(BF16).eval()
    model.load_weights(list(hf.state_dict().items()))
    fuse_projections(model)
    off.finish_loading()
    if max_fetch is not None:
        off.enable_hybrid(max_fetch, threads=2)
    off.allocate_cache(slots)
    return model, off


def _decode(model, prompts, steps, device="cpu"):
    """Prefill each prompt (a streamed layer: no host work), then greedy decode of every sequence batched
    together (the cache path, with the host's pairs). Returns the decode steps' logits and the tokens."""
    eng = R.TinyEngine(model, max_seqs=len(prompts), device=device)
    logits, out = [], {s: [] for s in range(len(prompts))}
    for s, p in enumerate(prompts):
        out[s].append(int(eng.step([(s, p)])[0].argmax()))
    for _ in range(steps):
        rows = torch.stack(eng.step([(s, [out[s][-1]]) for s in out]))
        logits.append(rows.float())
        for s, row in zip(out, rows):
            out[s].append(int(row.argmax()))
    return logits, out


def _max_error(logits, ref_logits) -> float:
    return max(float((a - b).abs().max() / b.abs().max()) for a, b in zip(logits, ref_logits))


@pytest.mark.parametrize("slots,max_fetch", [(6, 0), (6, 1), (16, 1), (48, 2)])
def test_hybrid_matches_offload(hf, slots, max_fetch):
    """The same decode with and without the cap (``offload``, bf16 both): the pairs the cache leaves out come back
    from the host. Each decode step's logits match within bf16 rounding (the host sums in fp32; leaving its pairs
    out is off by far more, checked below), and the host took pairs at every cap."""
    prompts = [R.prompt(13, seed=1), R.prompt(9, seed=2), R.prompt(17, seed=3)]
    ref_model, _ = _hybrid(hf, slots, None)
    ref_logits, ref_tokens = _decode(ref_model, prompts, steps=8)
    model, off = _hybrid(hf, slots, max_fetch)
    logits, tokens = _decode(model, prompts, steps=8)
    hits, misses = off.counters()
    assert off.cache.spilled > 0 and misses >= off.cache.spilled
    if max_fetch == 0:  # the cpu backend: nothing is ever admitted
        assert hits == 0 and misses == off.cache.spilled and off.cache.resident(0) == []
    assert _max_error(logits, ref_logits) < 0.03, _max_error(logits, ref_logits)
    assert tokens[0][:4] == ref_tokens[0][:4]
    off.cache.check_integrity()
    off.hybrid.check_errors()


def test_leaving_the_host_pairs_out_is_caught(hf, monkeypatch):
    """What the tolerance above guards against: without the host's sums the logits are far off."""
    from freetoken.moe.hybrid_experts import HybridExperts

    prompts = [R.prompt(13, seed=1), R.prompt(9, seed=2)]
    ref_logits, _ = _decode(_hybrid(hf, 6, None)[0], prompts, steps=4)
    monkeypatch.setattr(HybridExperts, "finish", lambda self, work, y: y)
    logits, _ = _decode(_hybrid(hf, 6, 0)[0], prompts, steps=4)
    assert _max_error(logits, ref_logits) > 0.1


def _bank(E=6, H=64, I=32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(E, 2 * I, H, generator=g) * 0.1).to(BF16), (torch.randn(E, H, I, generator=g) * 0.1).to(BF16)


def test_a_call_over_wrong_buffers_is_refused():
    """The native call reads its buffers by address for as long as the mailbox lives: anything but the contiguous
    CPU tensors of the layer's shapes and dtypes is refused when it is registered."""
    from freetoken import _core

    experts = CpuExperts(_bank(), threads=2)
    control = torch.zeros(3, dtype=torch.int64)
    mailbox = _core.CpuExpertMailbox(control, control.data_ptr(), False)
    T, k, H = 3, 2, 64
    x, ids, w, out = (
        torch.randn(T, H).to(BF16),
        torch.zeros(T, k, dtype=torch.int64),
        torch.rand(T, k),
        torch.ones(T, H),
    )
    assert experts.mailbox_call(mailbox, x, ids, w, out) == 0
    for bad, message in (
        ((x, ids.int(), w, out), "ids must be a contiguous torch.int64"),
        ((x, ids, w, torch.ones(T, H + 1)), "out must be a contiguous torch.float32 CPU tensor of shape \\[3, 64\\]"),
        ((x.t().contiguous().t(), ids, w, out), "x must be a contiguous torch.bfloat16"),
    ):
        with pytest.raises(ValueError, match=message):
            experts.mailbox_call(mailbox, *bad)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("max_fetch", [0, 1, 3, "auto"])
def test_hybrid_layers_captured_in_a_cuda_graph(max_fetch):
    """Two offloaded layers in one CUDA graph (admission with the cap, the hand-off to the host: the mailbox's
    kernels, the fetch, the GPU kernel, the host's sums added); each replay gets new routing. Every layer's output
    equals the all-resident reference within bf16 rounding, and the host took pairs. ``auto``: a floor of 1 and the
    share measured at start-up (``hybrid_fetch_share.py``)."""
    E, H, I, T, k = 16, 256, 128, 4, 4
    off = ExpertOffload(torch.device("cuda"), BF16, top_k=k)
    banks = []
    for layer in range(2):
        experts = off.make_experts(layer, E, H, I)
        gate_up, down = _bank(E, H, I, seed=layer)
        experts.gate_up_proj.data.copy_(gate_up)
        experts.down_proj.data.copy_(down)
        banks.append((gate_up.cuda(), down.cuda()))
    off.finish_loading()
    share = off.enable_hybrid(1 if max_fetch == "auto" else max_fetch, threads=4, auto_share=max_fetch == "auto")
    assert off.hybrid.mailbox is not None and off.hybrid.mailbox.polling
    if max_fetch == "auto":  # both sides measured (a few GB/s at least)
        assert share.pcie_gb_s > 1 and share.cpu_gb_s > 0.1 and 0 < share.per_mille < 1000, share
        assert off.hybrid.fetch_cap == FetchCap(1, share.per_mille, one_token=1)  # (never above the floor)
        # these banks are tiny (their copy outruns one CPU call: a share near 1000 fetches every miss), so the
        # graph below gets a share that leaves the host pairs at this test's ~10 misses a layer
        off.hybrid.fetch_cap = FetchCap(1, 500, one_token=1)
    off.allocate_cache(3 * T * k)
    assert off.cache.fetch_cap == off.hybrid.fetch_cap
    x = torch.randn(T, H, device="cuda", dtype=BF16)
    ids = torch.zeros(2, T, k, dtype=torch.int64, device="cuda")
    w = torch.rand(2, T, k, device="cuda")
    gen = torch.Generator().manual_seed(0)

    def new_routing():
        for layer in range(2):
            ids[layer].copy_(torch.stack([torch.randperm(E, generator=gen)[:k] for _ in range(T)]))
        x.copy_(torch.randn(T, H, generator=gen).to(BF16))

    def step():
        return [off.layers[layer](x, ids[layer], w[layer]) for layer in range(2)]

    new_routing()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()  # warm-up: Triton compiles, native calls made
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = step()
    for _ in range(4):
        new_routing()
        graph.replay()
        torch.cuda.synchronize()
        off.hybrid.check_errors()
        for layer in range(2):
            want = fused_moe_torch(x.float(), *(b.float() for b in banks[layer]), ids[layer], w[layer])
            # against the output's scale: the GPU's bf16 output and the host's sums are rounded apart before they
            # are added, and where they cancel an element is left with their rounding (H100: 0.04 at ~5)
            err = float((outs[layer].float() - want).abs().max() / want.abs().max())
            assert err < 0.02, (layer, err)
    assert off.cache.spilled > 0


# ------------------------------------------------------------------------------------------------------------
# Served: freetoken.LLM with an NVFP4 checkpoint (the offload host rows, read in place by the executor)
# ------------------------------------------------------------------------------------------------------------

from test_nvfp4_offload import LLM_ARGS, PROMPT, nvfp4_dir, resident  # noqa: E402, F401 (fixtures)


@pytest.mark.parametrize("backend,max_fetch", [("cpu", -1), ("hybrid", 1)])
def test_llm_with_hybrid_nvfp4_experts_gives_the_resident_tokens(nvfp4_dir, resident, backend, max_fetch):  # noqa: F811 (fixtures)
    from freetoken import LLM, SamplingParams

    args = dict(moe_hybrid_max_fetch=max_fetch) if backend == "hybrid" else {}
    llm = LLM(nvfp4_dir, moe_backend=backend, moe_cache_size=6, moe_cpu_threads=2, **args, **LLM_ARGS)
    off = llm.worker.offload
    assert off.hybrid is not None and off.cache.fetch_cap == FetchCap(0 if backend == "cpu" else 1)
    assert off.hybrid.layers[0].format == "nvfp4"
    # prefill copies the cache's experts on the device by default; the cpu backend's cache stays empty: no map read
    assert off.hit_d2d and (off.stream.resident is None) == (backend == "cpu")
    # 5 tokens: the 6th of the first prompt is a near-tie on the resident model (its top two logits 5e-5 apart
    # at ~15), which the host's fp32 sums (no bf16 rounding of gate, up and the product) may break the other way
    sp = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
    tokens = [o.token_ids for o in llm.generate([PROMPT, PROMPT[:9]], sp)]
    assert tokens == [t[:5] for t in resident[1]]
    assert off.cache.spilled > 0
    # every host miss went into some step's statistics (expert_host_misses: /v1/stats, the metrics), and the
    # host's time on them (expert_host_busy_ms)
    assert llm.worker._experts_reported == off.all_counters()
    assert (
        llm.worker._host_busy_reported == pytest.approx(off.hybrid.busy_seconds * 1e3) and off.hybrid.busy_seconds > 0
    )


def test_the_auto_share_balances_the_two_bandwidths():
    """q* = pcie / (pcie + cpu): the fetched misses take as long over PCIe as the others on the host. On a CPU
    device there is no PCIe to measure: the fixed floor alone (no share)."""
    from freetoken.moe.hybrid_fetch_share import share_of

    assert share_of(55.0, 40.0) == 579 and share_of(20.0, 0.0) == 1000 and share_of(0.0, 0.0) == 1000
    # 26 misses at 4 streams: 16 fetched (16 / 55 ~ 10 / 40), where a fixed cap of 3 left 23 to the host
    cap = FetchCap(3, share_of(55.0, 40.0))
    assert cap.of(26, tokens=4) == 16 and cap.of(4, tokens=4) == 3
    off = ExpertOffload(torch.device("cpu"), BF16, top_k=2)
    off.make_experts(0, 8, 64, 32)
    off.finish_loading()
    assert off.enable_hybrid(3, threads=2, auto_share=True) is None and off.hybrid.fetch_cap == FetchCap(3)


def test_a_failed_share_measurement_keeps_the_fixed_cap(monkeypatch, caplog):
    """The start-up measurement (CUDA only) failing is injected: the server goes on with the fixed floor as its
    cap, and says so in one warning."""
    import logging

    from freetoken.moe import hybrid_fetch_share

    def fail(offload, k):
        raise RuntimeError("injected: no copy engine")

    monkeypatch.setattr(hybrid_fetch_share, "measure", fail)
    off = ExpertOffload(torch.device("cpu"), BF16, top_k=2)
    off.make_experts(0, 8, 64, 32)
    off.finish_loading()
    off.enable_hybrid(3, threads=2)
    logging.getLogger("freetoken").addHandler(caplog.handler)
    try:
        assert off._measure_fetch_share(3) is None
    finally:
        logging.getLogger("freetoken").removeHandler(caplog.handler)
    assert off.hybrid.fetch_cap == FetchCap(3)
    assert any("measuring the fetch share failed" in m and "injected" in m and "the cap stays 3" in m
               for m in caplog.messages), caplog.messages  # fmt: skip
    off.allocate_cache(4)
    assert off.cache.fetch_cap == FetchCap(3)


def test_a_failed_host_call_fails_the_next_check():
    """The mailbox's thread cannot raise: a failed call writes zeros and keeps its error, and the worker's per-step
    ``check_errors`` raises it, naming the layer (the step fails instead of decoding on zeros)."""
    from freetoken.moe.hybrid_experts import HybridExperts

    gate_up, down = _bank()
    hybrid = HybridExperts([(gate_up, down)], torch.device("cpu"), max_fetch=0, threads=2)
    hybrid._open_mailbox(torch.device("cpu"), start=False)  # the call is run below, as the thread would
    hybrid.check_errors()  # nothing failed (or only calls of other objects, whose errors were taken)
    x, ids, w, out = torch.randn(2, 64).to(BF16), torch.tensor([[1, 2], [3, 9]]), torch.rand(2, 2), torch.ones(2, 64)
    call = hybrid._calls[(0, 2, 2)] = hybrid.layers[0].mailbox_call(hybrid.mailbox, x, ids, w, out)
    with pytest.raises(ValueError):
        hybrid.mailbox.run(call)  # what the thread runs, raising here as well
    assert torch.equal(out, torch.zeros_like(out))
    with pytest.raises(RuntimeError, match="CPU experts of MoE layer 0 \\(2 tokens\\): .*outside the bank"):
        hybrid.check_errors()
    hybrid.check_errors()  # reported once
