"""Hugging Face checkpoint directories: ``config.json``, ``*.safetensors`` (bf16 / fp16 / fp32), and the
tokenizer files the server needs (``tokenizer.json``, ``tokenizer_config.json`` with the chat template or a
``chat_template.jinja`` / ``chat_template.json``, ``generation_config.json`` for the EOS ids)."""

from __future__ import annotations

import json
import os
from typing import Iterator

import torch

from ..errors import UnsupportedModel
from .gguf_tokenizer import TokenizerInfo

_DTYPES = {
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float32": torch.float32,
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
    "fp32": torch.float32,
    "half": torch.float16,
    "float": torch.float32,
}


def _read_json(path: str) -> dict | None:
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        return json.load(f)


def _token_str(tok) -> str | None:
    """``bos_token`` is a string or an AddedToken dict (``{"content": ...}``) in tokenizer_config.json."""
    if isinstance(tok, dict):
        return tok.get("content")
    return tok


class HFCheckpoint:
    def __init__(self, path: str):
        self.path = os.path.abspath(path)
        config = _read_json(os.path.join(self.path, "config.json"))
        if config is None:
            raise UnsupportedModel(f"{path} has no config.json (and no .gguf file)")
        self.config = config
        self.files = self._weight_files()

    def _weight_files(self) -> list[str]:
        index = _read_json(os.path.join(self.path, "model.safetensors.index.json"))
        if index is not None:
            return [os.path.join(self.path, f) for f in sorted(set(index["weight_map"].values()))]
        return sorted(os.path.join(self.path, f) for f in os.listdir(self.path) if f.endswith(".safetensors"))

    @property
    def torch_dtype(self) -> torch.dtype | None:
        """The checkpoint's dtype: ``torch_dtype`` or ``dtype``, at the top level or in ``text_config``."""
        for cfg in (self.config, self.config.get("text_config") or {}):
            for key in ("torch_dtype", "dtype"):
                v = cfg.get(key)
                if isinstance(v, str) and v in _DTYPES:
                    return _DTYPES[v]
        return None

    def tensors(self, progress: bool = True) -> Iterator[tuple[str, torch.Tensor]]:
        """(HF name, CPU tensor) for every tensor of every shard."""
        from safetensors import safe_open
        from tqdm import tqdm

        if not self.files:
            raise UnsupportedModel(f"{self.path} has no .safetensors files (use --dummy-weight for random weights)")
        for file in tqdm(
            self.files, desc="Loading safetensors shards", unit="shard", disable=not progress, leave=False
        ):
            with safe_open(file, framework="pt", device="cpu") as f:
                for name in f.keys():
                    yield name, f.get_tensor(name)

    def generation_config(self) -> dict:
        return _read_json(os.path.join(self.path, "generation_config.json")) or {}

    def tokenizer_info(self) -> TokenizerInfo:
        tcfg = _read_json(os.path.join(self.path, "tokenizer_config.json")) or {}
        template = tcfg.get("chat_template")
        jinja = os.path.join(self.path, "chat_template.jinja")
        if os.path.isfile(jinja):
            with open(jinja) as f:
                template = f.read()
        elif template is None:
            template = (_read_json(os.path.join(self.path, "chat_template.json")) or {}).get("chat_template")
        if isinstance(template, list):  # named templates: take "default"
            template = next((t["template"] for t in template if t.get("name") == "default"), template[0]["template"])
        bos, eos = _token_str(tcfg.get("bos_token")), _token_str(tcfg.get("eos_token"))
        tok_path = os.path.join(self.path, "tokenizer.json")
        vocab = _vocab_lookup(tok_path)
        gen = self.generation_config()
        ids = gen.get("eos_token_id", self.config.get("eos_token_id"))
        eos_ids = [ids] if isinstance(ids, int) else list(ids or [])
        bos_id = vocab(bos) if bos else gen.get("bos_token_id", self.config.get("bos_token_id"))
        eos_id = vocab(eos) if eos else (eos_ids[0] if eos_ids else None)
        if eos_id is not None and eos_id not in eos_ids:
            eos_ids.insert(0, eos_id)
        for closer in ("<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<|end|>", "<end_of_turn>"):
            cid = vocab(closer)
            if template and closer in template and cid is not None and cid not in eos_ids:
                eos_ids.append(cid)
        add_bos = tcfg.get("add_bos_token")
        return TokenizerInfo(
            tokenizer_path=tok_path if os.path.isfile(tok_path) else None,
            chat_template=template,
            bos_token=bos,
            eos_token=eos,
            bos_token_id=bos_id,
            eos_token_id=eos_id,
            add_bos_token=bool(add_bos) if add_bos is not None else False,
            eos_token_ids=eos_ids,
        )


def _vocab_lookup(tokenizer_json: str):
    """token string -> id through tokenizer.json (added tokens first), None when absent."""
    if not os.path.isfile(tokenizer_json):
        return lambda s: None
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(tokenizer_json)
    return lambda s: tok.token_to_id(s) if s is not None else None
