"""The hybrid radix cache end to end (issue 12): a tiny random Qwen3.5-MoE (Gated DeltaNet + gated attention)
through the offline engine, which runs the production scheduler. A prefix hit on a hybrid model resumes the
linear-attention layers from a recurrent-state snapshot, so every hit must give the tokens (and logprobs) of the
same request run cold on the naive cache: multi-turn conversations, a repeated prompt, a shared system prompt
(alone and batched), and a snapshot pool small enough to evict. Each test also checks that hits happened, so
equality cannot come from both runs computing everything. Every test runs on the CPU and, under the ``gpu``
marker, on CUDA (the Triton attention, GDN decode and conv kernels and decode graphs, in fp32 so that the cached
and cold runs' different chunkings can only reorder float sums, never flip a bf16 near-tie)."""

from __future__ import annotations

import hf_reference as R
import pytest
import torch

pytestmark = pytest.mark.slow

GRID = 64  # snapshots sit on the GDN chunk grid
ENGINE_ARGS = dict(
    dtype="float32",
    num_tokens=8192,
    max_seq_len_override=4096,
    load_progress=False,
    max_prefill_length=128,
    max_running_requests=4,
)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    d = str(tmp_path_factory.mktemp("tiny-qwen3_5_moe-radix"))
    R.write_released_qwen3_5_moe(d, seed=11, max_position_embeddings=4096)
    return d


_CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.fixture(scope="module", params=["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, _CUDA])])
def device(request):
    """On CUDA the Gated DeltaNet prefill runs the torch reference: fla computes in TF32 even on fp32 inputs (its
    triangular solve and dots), which moves a cached run's logprobs ~1e-3 from the cold run's and can flip a
    near-tie; everything else (Triton attention, GDN decode and conv kernels, decode graphs) runs as served."""
    with pytest.MonkeyPatch.context() as mp:
        if request.param == "cuda":
            mp.setenv("FREETOKEN_GDN_BACKEND", "torch")
        yield request.param


@pytest.fixture(scope="module")
def cached(checkpoint, device):
    from freetoken import LLM

    return LLM(checkpoint, device=device, **ENGINE_ARGS)  # --cache-type radix (default), resolved to hybrid_radix


@pytest.fixture(scope="module")
def cold(checkpoint, device):
    from freetoken import LLM

    return LLM(checkpoint, device=device, cache_type="naive", **ENGINE_ARGS)


def greedy(n: int):
    from freetoken import SamplingParams

    return SamplingParams(max_tokens=n, ignore_eos=True)


def assert_same(hit, ref):
    """Same tokens; logprobs equal up to the float reordering of a different chunking."""
    assert hit.token_ids == ref.token_ids
    assert max(abs(a - b) for a, b in zip(hit.logprobs, ref.logprobs)) < 1e-4


def test_resolved_cache_and_snapshot_pool(cached, cold):
    assert cached.worker.info()["cache_types"][0] == "hybrid_radix"
    s = cached.engine.stats()
    # --linear-state-cache-ratio 2.0 x 4 running requests = 8, raised to the floor of 16
    assert s["snapshot_slots_total"] == 16
    assert cold.engine.stats()["snapshot_slots_total"] == 0


def test_multi_turn_conversation_resumes_where_the_last_answer_ended(cached, cold):
    history = R.prompt(150, seed=1)
    previous = 0  # tokens of the previous turn's prompt and answer
    for turn in range(3):
        (hit,) = cached.generate([history], greedy(10))
        (ref,) = cold.generate([history], greedy(10))
        assert_same(hit, ref)
        assert ref.cached_tokens == 0
        if turn:  # the previous request donated its live state at the end of its answer
            assert hit.cached_tokens == previous - 1
        previous = len(history) + len(hit.token_ids)
        history = history + hit.token_ids + R.prompt(40, seed=100 + turn)
    cached.engine.check_integrity()


def test_turn_two_of_a_2000_token_conversation_reuses_at_least_1900(cached, cold):
    history = R.prompt(2000, seed=4)
    (first,) = cached.generate([history], greedy(4))
    turn2 = history + first.token_ids + R.prompt(30, seed=5)
    (hit,) = cached.generate([turn2], greedy(4))
    assert hit.cached_tokens >= 1900, hit.cached_tokens
    assert_same(hit, cold.generate([turn2], greedy(4))[0])


def test_same_prompt_twice_resumes_at_the_last_grid_point_below_its_length(cached, cold):
    prompt = R.prompt(200, seed=2)
    (first,) = cached.generate([prompt], greedy(6))
    (again,) = cached.generate([prompt], greedy(6))
    (ref,) = cold.generate([prompt], greedy(6))
    assert first.cached_tokens == 0
    assert again.cached_tokens == (len(prompt) - 1) // GRID * GRID == 192
    assert_same(first, ref)
    assert_same(again, ref)


def test_shared_system_prompt_alone_and_batched(cached, cold):
    system = R.prompt(130, seed=3)
    questions = [R.prompt(20 + 7 * i, seed=30 + i) for i in range(5)]
    prompts = [system + q for q in questions]
    hits0 = cached.engine.stats()["snapshot_hits"]
    alone = [cached.generate([p], greedy(8))[0] for p in prompts[:2]]
    batched = cached.generate(prompts[2:], greedy(8))
    refs = [cold.generate([p], greedy(8))[0] for p in prompts]
    for out, ref in zip(alone + batched, refs):
        assert_same(out, ref)
    # the second request captures the branch point, where every later one resumes (it finds the first one's
    # chunk-end snapshot too when the full pool has not evicted that, cold, capture yet)
    assert alone[0].cached_tokens == 0
    assert alone[1].cached_tokens == 0 or GRID <= alone[1].cached_tokens <= len(system)
    assert all(GRID <= o.cached_tokens <= len(system) for o in batched), [o.cached_tokens for o in batched]
    assert cached.engine.stats()["snapshot_hits"] >= hits0 + 3
    cached.engine.check_integrity()


def test_small_snapshot_pool_evicts_and_stays_exact(checkpoint, device, cold):
    """Four conversations on two snapshot slots: the second turns, most recent first, find the latest
    conversations' snapshots and miss the evicted ones, and every answer equals the cold run."""
    from freetoken import LLM

    small = LLM(checkpoint, device=device, num_snapshot_slots=2, **ENGINE_ARGS)
    assert small.engine.stats()["snapshot_slots_total"] == 2
    first_turns = [R.prompt(140 + 10 * i, seed=50 + i) for i in range(4)]
    answers = []
    for p in first_turns:
        (out,) = small.generate([p], greedy(5))
        assert_same(out, cold.generate([p], greedy(5))[0])
        answers.append(out.token_ids)
    resumed = []
    for i in reversed(range(4)):
        p = first_turns[i] + answers[i] + R.prompt(30, seed=60 + i)
        (out,) = small.generate([p], greedy(5))
        assert_same(out, cold.generate([p], greedy(5))[0])
        resumed.append(out.cached_tokens == len(first_turns[i]) + 4)
        small.engine.check_integrity()
    assert resumed[0] and not all(resumed), resumed
    assert small.engine.stats()["snapshot_slots_used"] <= 2
