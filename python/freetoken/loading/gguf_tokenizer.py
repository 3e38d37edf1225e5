"""A HF ``tokenizer.json`` rebuilt from a GGUF's tokenizer metadata, so the Rust server (HF ``tokenizers``
crate) and transformers tokenize a GGUF model the same way.

Byte-level BPE (``tokenizer.ggml.model == "gpt2"``: SmolLM2, Llama 3, Qwen) is built here directly, shaped
exactly like transformers' GGUF converter (``integrations/gguf/gguf_tokenizer_mapping.py``) builds it:
  - vocab: each token as the file spells it (already in the GPT-2 byte alphabet; a token that is not gets
    respelled byte by byte), merges as stored;
  - tokens of type CONTROL (3) become special added tokens, USER_DEFINED (4) plain added tokens;
  - pre-tokenizer: GPT-2's ByteLevel regex, unless ``tokenizer.ggml.pre`` names a split transformers knows
    (llama3 family, qwen2 family), then that regex followed by ByteLevel without its own regex.
    SmolLM2 says ``smollm``, which transformers does not special-case: plain GPT-2 ByteLevel. (The model's own
    HF tokenizer splits digits one by one first; its vocabulary has no multi-digit tokens, so only a space
    before a digit can differ. We follow transformers, which the tests compare against.)
  - ByteLevel decoder; no BOS added unless ``tokenizer.ggml.add_bos_token`` says so.
Other tokenizer models (sentencepiece "llama", "t5", ...) go through transformers' converter when it is
installed.

The result lands in ``$FREETOKEN_CACHE_DIR`` (default ``~/.cache/freetoken``) under ``tokenizers/<key>/``, keyed
by the GGUF's path, size and mtime, with a ``tokenizer_config.json`` (chat template, special tokens) beside it.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, field

from ..errors import UnsupportedModel
from ..log import get_logger
from .cache_dir import cache_dir

logger = get_logger(__name__)

_FORMAT_VERSION = "1"  # bump when the generated tokenizer.json changes shape

_CONTROL, _USER_DEFINED = 3, 4

_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# tokenizer.ggml.pre -> split regex (the subset of transformers' table we can vouch for); others: GPT-2 ByteLevel
_PRE_SPLITS = {
    **dict.fromkeys(["llama3", "llama-v3", "llama-bpe", "falcon3", "smaug-bpe", "dbrx", "pixtral"], _LLAMA3_SPLIT),
    **dict.fromkeys(["qwen2", "deepseek-r1-qwen", "megrez"], _QWEN2_SPLIT),
}


@dataclass
class TokenizerInfo:
    tokenizer_path: str  # the tokenizer.json file
    chat_template: str | None
    bos_token: str | None
    eos_token: str | None
    bos_token_id: int | None
    eos_token_id: int | None
    add_bos_token: bool
    eos_token_ids: list[int] = field(default_factory=list)  # eos plus end-of-turn tokens

    @property
    def tool_call_token_id(self) -> int | None:
        """The id of ``<tool_call>`` when the vocabulary has it as one token (Qwen's tool-call opener)."""
        if not self.tokenizer_path:
            return None
        from tokenizers import Tokenizer

        return Tokenizer.from_file(str(self.tokenizer_path)).token_to_id("<tool_call>")


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character map (the byte-level BPE alphabet)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


def _cache_dir(gguf_path: str) -> str:
    st = os.stat(gguf_path)
    key = f"{_FORMAT_VERSION}|{os.path.abspath(gguf_path)}|{st.st_size}|{st.st_mtime_ns}"
    return os.path.join(cache_dir(), "tokenizers", hashlib.sha256(key.encode()).hexdigest()[:16])


def _byte_level_bpe(
    tokens: list[str], token_types: list[int], merges: list[str], pre: str | None, add_bos: bool, bos: str | None
):
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors

    spelling = bytes_to_unicode()
    alphabet = set(spelling.values())
    vocab = {}
    for i, t in enumerate(tokens):
        vocab[t if set(t) <= alphabet else "".join(spelling[b] for b in t.encode("utf-8"))] = i
    pairs = [tuple(m.split(" ")) for m in merges]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=pairs, fuse_unk=False, byte_fallback=False))
    split = _PRE_SPLITS.get(pre or "")
    if split is None:
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    else:
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(split), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    tok.decoder = decoders.ByteLevel()
    if add_bos and bos is not None:
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, vocab.get(bos, tokens.index(bos)))]
        )
    # CONTROL tokens are special; a "control" token outside the byte alphabet is a llama.cpp mislabel that
    # transformers skips too (adding it would grow the vocabulary past the model's).
    specials = [
        AddedToken(t, normalized=False, special=True)
        for t, ty in zip(tokens, token_types)
        if ty == _CONTROL and set(t) <= alphabet
    ]
    tok.add_special_tokens(specials)
    user = [
        AddedToken(t, normalized=False, special=False)
        for t, ty in zip(tokens, token_types)
        if ty == _USER_DEFINED and t in vocab
    ]
    if user:
        tok.add_tokens(user)
    return tok


def _via_transformers(gguf_path: str, out_dir: str) -> None:
    try:
        from transformers import AutoTokenizer
    except ImportError as e:  # pragma: no cover
        raise UnsupportedModel(
            "this GGUF's tokenizer is not byte-level BPE; converting it needs transformers (pip install transformers)"
        ) from e
    t = AutoTokenizer.from_pretrained(os.path.dirname(gguf_path), gguf_file=os.path.basename(gguf_path))
    t.save_pretrained(out_dir)


def _end_of_turn_ids(tokens: list[str], chat_template: str | None, meta) -> list[int]:
    """Tokens that end an assistant turn besides EOS: llama.cpp's eot/eom ids, and the chat template's turn
    closers (<|im_end|>, <|eot_id|>, <|end|>, <end_of_turn>) when the template uses them."""
    ids = [meta(k) for k in ("tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id")]
    out = [int(i) for i in ids if i is not None]
    if chat_template:
        for closer in ("<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<|end|>", "<end_of_turn>", "<|endoftext|>"):
            if closer in chat_template and closer in tokens:
                out.append(tokens.index(closer))
    return out


def tokenizer_from_gguf(ckpt) -> TokenizerInfo:
    """Write (once) and describe the HF tokenizer of a ``GGUFCheckpoint``."""
    meta = ckpt.metadata
    out_dir = _cache_dir(ckpt.path)
    tok_json = os.path.join(out_dir, "tokenizer.json")
    tokens = [str(t) for t in meta("tokenizer.ggml.tokens")]
    bos_id, eos_id = meta("tokenizer.ggml.bos_token_id"), meta("tokenizer.ggml.eos_token_id")
    bos = tokens[bos_id] if bos_id is not None else None
    eos = tokens[eos_id] if eos_id is not None else None
    model = meta("tokenizer.ggml.model")
    add_bos = meta("tokenizer.ggml.add_bos_token")
    add_bos = bool(add_bos) if add_bos is not None else model == "llama"  # llama.cpp's default for sentencepiece
    chat_template = meta("tokenizer.chat_template")
    if not os.path.isfile(tok_json):
        tmp = out_dir + f".tmp{os.getpid()}"
        os.makedirs(tmp, exist_ok=True)
        if model == "gpt2":
            tok = _byte_level_bpe(
                tokens,
                list(meta("tokenizer.ggml.token_type") or []),
                list(meta("tokenizer.ggml.merges")),
                meta("tokenizer.ggml.pre"),
                add_bos,
                bos,
            )
            tok.save(os.path.join(tmp, "tokenizer.json"))
        else:
            _via_transformers(ckpt.path, tmp)
        pad_id = meta("tokenizer.ggml.padding_token_id")
        unk_id = meta("tokenizer.ggml.unknown_token_id")
        tcfg = {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": bos,
            "eos_token": eos,
            "pad_token": tokens[pad_id] if pad_id is not None else None,
            "unk_token": tokens[unk_id] if unk_id is not None else None,
            "add_bos_token": add_bos,
            "chat_template": chat_template,
        }
        with open(os.path.join(tmp, "tokenizer_config.json"), "w") as f:
            json.dump(tcfg, f, indent=2, ensure_ascii=False)
        try:
            os.replace(tmp, out_dir)
        except OSError:  # another process won the race; its copy is identical
            import shutil

            shutil.rmtree(tmp, ignore_errors=True)
        logger.info(f"Wrote tokenizer for {os.path.basename(ckpt.path)} to {out_dir}")
    eos_ids = ([int(eos_id)] if eos_id is not None else []) + _end_of_turn_ids(tokens, chat_template, meta)
    return TokenizerInfo(
        tokenizer_path=tok_json,
        chat_template=chat_template,
        bos_token=bos,
        eos_token=eos,
        bos_token_id=int(bos_id) if bos_id is not None else None,
        eos_token_id=int(eos_id) if eos_id is not None else None,
        add_bos_token=add_bos,
        eos_token_ids=list(dict.fromkeys(eos_ids)),
    )
