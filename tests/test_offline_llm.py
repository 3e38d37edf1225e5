"""The offline API (``freetoken.LLM``) runs the production scheduler (``_core.OfflineEngine``) over the same
worker: batched generation equals one-by-one generation, a repeated prompt hits the prefix cache with the same
output, and ``logits`` gives per-position logits equal to the worker's."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def llm(demo_gguf_path):
    from freetoken import LLM

    return LLM(
        demo_gguf_path,
        device="cpu",
        num_tokens=4096,
        max_seq_len_override=1024,
        load_progress=False,
        max_prefill_length=64,
    )


def test_batch_equals_single_and_cache_hit(llm):
    from freetoken import SamplingParams

    prompts = ["The capital of France is", "Water boils at a temperature of", "One, two, three,"]
    sp = SamplingParams(max_tokens=8, ignore_eos=True)
    batched = llm.generate(prompts, sp)
    single = [llm.generate([p], sp)[0] for p in prompts]
    assert [o.token_ids for o in batched] == [o.token_ids for o in single]
    assert all(len(o.token_ids) == 8 and o.finish_reason == "length" for o in batched)
    assert "Paris" in batched[0].text
    # the one-by-one run repeated the batched prompts: their prefixes came from the radix cache
    assert all(o.cached_tokens >= len(o.prompt_token_ids) - 1 for o in single)
    llm.engine.check_integrity()


def test_seeded_sampling_is_reproducible(llm):
    from freetoken import SamplingParams

    sp = SamplingParams(temperature=0.9, top_p=0.95, seed=7, max_tokens=6, ignore_eos=True)
    a = llm.generate(["Once upon a time"], sp)[0].token_ids
    b = llm.generate(["Once upon a time", "Another prompt entirely"], sp)[0].token_ids
    assert a == b


def test_per_position_logits(llm):
    ids = llm.encode("The quick brown fox jumps over the lazy dog")
    logits = llm.logits(ids)
    assert logits.shape == (len(ids), llm.info["vocab_size"]) and logits.dtype == torch.float32
    greedy = llm.generate([ids], None)[0].token_ids[0]
    assert int(logits[-1].argmax()) == greedy
