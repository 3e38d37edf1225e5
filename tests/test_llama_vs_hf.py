"""Our Llama forward vs HF transformers.

1. The demo model (SmolLM2-135M-Instruct, Q4_1/Q8_0 GGUF): per-position logits over a few hundred tokens of
   English, greedy decoding through real prefill + decode steps, chunked prefill, and a 3-sequence batch.
2. A tiny random HF Llama saved with ``save_pretrained``: loaded through loading/checkpoint.py, and built with
   ``dummy_weight`` from config.json alone (its random weights then loaded into HF).
Everything fp32 on CPU.
"""

from __future__ import annotations

import os
import shutil

import pytest
import torch
from conftest import make_tiny_llama_dir

from freetoken.engine.step_plan import StepPlan

PARAGRAPH = (
    "The history of the printing press begins in the middle of the fifteenth century, when Johannes Gutenberg, "
    "a goldsmith from Mainz, combined several existing technologies into a single practical system. Movable "
    "type had been used in East Asia for centuries, but the large number of characters in Chinese writing made "
    "it less attractive there than in Europe, where an alphabet of a few dozen letters could be cast in metal "
    "and reused indefinitely. Gutenberg developed a hand mould for casting type quickly and accurately, an "
    "oil-based ink that adhered well to metal, and a press adapted from those used to make wine and olive oil. "
    "His Bible, completed around 1455, demonstrated that printed books could rival the beauty of manuscripts "
    "while being produced far more quickly. Within fifty years, presses had spread to more than two hundred "
    "cities, and millions of books were in circulation. The consequences were profound: scholars could compare "
    "identical copies of a text, errors could be corrected in later editions, and ideas travelled faster than "
    "ever before. Many historians argue that the Reformation, the Scientific Revolution and the rise of modern "
    "newspapers would have been impossible without the steady flow of cheap printed material. Literacy rates "
    "climbed, vernacular languages gained prestige, and the authority of those who had controlled access to "
    "knowledge began to weaken. Today, when information moves around the world in an instant, it is easy to "
    "forget how radical it once was to own a book."
)

CHAT = (
    "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
    "<|im_start|>user\nExplain in a few sentences why the sky is blue.<|im_end|>\n<|im_start|>assistant\n"
)


@pytest.fixture(scope="module")
def tok(demo_worker):
    from tokenizers import Tokenizer

    return Tokenizer.from_file(demo_worker.info()["tokenizer_path"])


@pytest.fixture(scope="module")
def hf_demo(demo_gguf_path):
    from transformers import AutoModelForCausalLM

    d, name = os.path.split(demo_gguf_path)
    return AutoModelForCausalLM.from_pretrained(d, gguf_file=name, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def paragraph_ids(tok):
    ids = tok.encode(PARAGRAPH).ids
    assert 250 <= len(ids) <= 400
    return ids


@pytest.fixture(scope="module")
def ours_paragraph(demo_worker, paragraph_ids):
    return demo_worker.forward_logits(paragraph_ids)


# Tolerance: both sides dequantize the same Q4_1 / Q8_0 blocks to fp32 with the same numpy code (gguf.quants)
# and run the same fp32 math, so the only differences are summation order (our per-sequence attention over the
# paged cache and unbatched matmuls vs HF's SDPA). Measured max |Δlogit| = 5.0e-5 over 280 positions with
# |logit| up to 38 (fp32 eps 1.2e-7 × |logit| × accumulation through 30 layers); 2e-3 leaves 40x headroom while
# any real bug (a wrong permute, norm, rope or mask) moves logits by >= 0.1.
LOGIT_ATOL = 2e-3


def test_demo_logits_match_hf(hf_demo, paragraph_ids, ours_paragraph):
    with torch.inference_mode():
        ref = hf_demo(torch.tensor([paragraph_ids])).logits[0].float()
    assert ours_paragraph.shape == ref.shape == (len(paragraph_ids), 49152)
    diff = (ours_paragraph - ref).abs().max().item()
    print(
        f"demo model: max |dlogit| = {diff:.3e} over {len(paragraph_ids)} tokens, max |logit| = {ref.abs().max():.1f}"
    )
    assert diff < LOGIT_ATOL
    assert torch.equal(ours_paragraph.argmax(-1), ref.argmax(-1))


def _greedy_via_steps(worker, prompt: list[int], n: int, row: int = 0, slot0: int = 0) -> list[int]:
    """Prefill then n-1 one-token decode steps, page table and slots managed like the Rust side does."""
    greedy = {"temperature": 0.0}
    plan = StepPlan.build(
        [
            {
                "tokens": prompt,
                "prefix_len": 0,
                "row": row,
                "table_from": 0,
                "table_slots": list(range(slot0, slot0 + len(prompt))),
                "sample": greedy,
            }
        ]
    )
    out = worker.execute_plan(plan).tokens
    while len(out) < n:
        pos = len(prompt) + len(out) - 1
        plan = StepPlan.build(
            [
                {
                    "tokens": [out[-1]],
                    "prefix_len": pos,
                    "row": row,
                    "table_from": pos,
                    "table_slots": [slot0 + pos],
                    "sample": greedy,
                }
            ]
        )
        out += worker.execute_plan(plan).tokens
    return out


def test_demo_greedy_matches_hf(demo_worker, hf_demo, tok):
    prompt = tok.encode(CHAT).ids
    n = 24
    with torch.inference_mode():
        out = hf_demo(torch.tensor([prompt]), use_cache=True)
        ref = [int(out.logits[0, -1].argmax())]
        while len(ref) < n:
            out = hf_demo(torch.tensor([[ref[-1]]]), cache=out.cache, use_cache=True)
            ref.append(int(out.logits[0, -1].argmax()))
    ours = _greedy_via_steps(demo_worker, prompt, n)
    print("greedy:", repr(tok.decode(ours)))
    assert ours == ref


def test_demo_chunked_prefill_equals_one_pass(demo_worker, paragraph_ids, ours_paragraph, monkeypatch):
    monkeypatch.setattr(demo_worker, "max_prefill_length", 100)  # 3-4 chunks, each continuing a cached prefix
    chunked = demo_worker.forward_logits(paragraph_ids)
    diff = (chunked - ours_paragraph).abs().max().item()
    print(f"chunked vs one pass: max |dlogit| = {diff:.3e}")
    assert diff < 1e-3


def test_demo_batch_of_three_equals_each_alone(demo_worker, paragraph_ids, ours_paragraph):
    seqs = [paragraph_ids[:37], paragraph_ids[:150], paragraph_ids[:5]]
    # rows 2, 0, 1 and disjoint slot ranges placed out of order
    rows, starts = [2, 0, 1], [3000, 100, 2000]
    plan = StepPlan.build(
        [
            {
                "tokens": s,
                "prefix_len": 0,
                "row": r,
                "table_from": 0,
                "table_slots": list(range(a, a + len(s))),
                "sample": {"temperature": 0.0},
            }
            for s, r, a in zip(seqs, rows, starts)
        ]
    )
    res = demo_worker.execute_plan(plan, all_logits=True)
    at = 0
    for s in seqs:
        got = res.logits[at : at + len(s)]
        at += len(s)
        # causal: the prefix of the paragraph has the same logits as the paragraph's first positions
        diff = (got - ours_paragraph[: len(s)]).abs().max().item()
        assert diff < 1e-3, diff
    assert res.tokens == [int(ours_paragraph[len(s) - 1].argmax()) for s in seqs]


# ---------------------------------------------------------------- tiny random Llama, HF checkpoint dir

TINY_VARIANTS = {
    "plain": {},
    "tied_llama3_rope_bias_headdim": dict(
        tie_word_embeddings=True,
        attention_bias=True,
        head_dim=32,
        num_attention_heads=4,
        num_key_value_heads=1,
        rope_parameters={
            "rope_type": "llama3",
            "rope_theta": 50000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
    ),
}

TINY_IDS = [5, 17, 200, 3, 99, 42, 42, 7, 128, 255, 0, 1, 2, 64, 33, 91, 150, 12, 8, 77] * 4  # 80 tokens


def _hf_logits(model_dir: str, ids: list[int]) -> torch.Tensor:
    from transformers import LlamaForCausalLM

    hf = LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.inference_mode():
        return hf(torch.tensor([ids])).logits[0]


def _tiny_worker(model_dir: str, **over):
    from freetoken.worker import Worker

    args = {"model_path": model_dir, "device": "cpu", "dtype": "float32", "num_tokens": 512, "load_progress": False}
    args.update(over)
    return Worker(args)


@pytest.mark.parametrize("variant", list(TINY_VARIANTS))
def test_tiny_llama_checkpoint_matches_hf(tmp_path, variant):
    d = make_tiny_llama_dir(tmp_path / variant, **TINY_VARIANTS[variant])
    w = _tiny_worker(d, max_prefill_length=32)  # 3 chunks
    got = w.forward_logits(TINY_IDS)
    ref = _hf_logits(d, TINY_IDS)
    diff = (got - ref).abs().max().item()
    print(f"tiny {variant}: max |dlogit| = {diff:.3e}")
    assert diff < 1e-5


def test_tiny_llama_dummy_weights_have_hf_shapes(tmp_path, tiny_llama_dir):
    """--dummy-weight from config.json alone; the random weights load into HF's model strictly (same names and
    shapes) and give the same logits."""
    from transformers import LlamaConfig, LlamaForCausalLM

    d = tmp_path / "config-only"
    d.mkdir()
    shutil.copy(os.path.join(tiny_llama_dir, "config.json"), d / "config.json")
    w = _tiny_worker(str(d), dummy_weight=True)
    sd = w.model.state_dict()
    norms = [v for k, v in sd.items() if "norm" in k]
    assert norms and all(bool((v == 1).all()) for v in norms)
    others = [v for k, v in sd.items() if "norm" not in k]
    assert all(0.005 < float(v.std()) < 0.05 for v in others)
    hf = LlamaForCausalLM(LlamaConfig.from_pretrained(str(d))).float().eval()
    hf.load_state_dict(sd, strict=True)
    with torch.inference_mode():
        ref = hf(torch.tensor([TINY_IDS])).logits[0]
    diff = (w.forward_logits(TINY_IDS) - ref).abs().max().item()
    assert diff < 1e-5
