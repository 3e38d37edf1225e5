"""GGUF checkpoints (llama.cpp's format): the HF-style config from the metadata, and the tensors under their HF
names, dequantized to fp32 with ``gguf.quants.dequantize`` (F32, F16, BF16, Q4_0/1, Q5_0/1, Q8_0, the K-quants,
IQ types: whatever the installed ``gguf`` can unpack).

llama.cpp's converter rewrites two things we undo here, exactly as transformers' GGUF loader does:
  - names (``blk.N.attn_q.weight`` ↔ ``model.layers.N.self_attn.q_proj.weight``);
  - for Llama, the rows of ``attn_q`` / ``attn_k`` are permuted from HF's rotate-half RoPE layout into the
    interleaved (GPT-J) layout llama.cpp uses. ``_unpermute`` is the inverse of the converter's ``permute``.
"""

from __future__ import annotations

import os
from typing import Iterator

import numpy as np
import torch

from ..errors import UnsupportedModel
from ..log import get_logger

logger = get_logger(__name__)

# GGUF architecture -> HF model_type. Mistral files say "llama" too, and are the same network.
_ARCHITECTURES = {"llama": "llama"}

# per-layer GGUF name -> HF name (Llama family)
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GLOBAL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
# Tensors that are not weights of the network: rope_freqs is folded into the config (llama3 rope scaling).
_SKIP = {"rope_freqs.weight"}


def hf_name(gguf_name: str) -> str | None:
    """``blk.3.attn_q.weight`` -> ``model.layers.3.self_attn.q_proj.weight``; None for names we do not map."""
    parts = gguf_name.split(".")
    if parts[0] == "blk" and len(parts) == 4 and parts[2] in _LAYER_NAMES:
        return f"model.layers.{parts[1]}.{_LAYER_NAMES[parts[2]]}.{parts[3]}"
    if len(parts) == 2 and parts[0] in _GLOBAL_NAMES:
        return f"{_GLOBAL_NAMES[parts[0]]}.{parts[1]}"
    return None


def _unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    """Inverse of llama.cpp's ``permute(w, n_head)``: ``w.reshape(n_head, 2, d/2, ...).swapaxes(1, 2)``.
    Same as transformers' ``LlamaTensorProcessor._reverse_permute_weights`` (for rows of q or k)."""
    half = w.shape[0] // n_head // 2
    return w.reshape(n_head, half, 2, *w.shape[1:]).swapaxes(2, 1).reshape(w.shape)


class GGUFCheckpoint:
    """One ``.gguf`` file: ``config`` (HF-style dict), ``tensors()`` (HF names, fp32), ``metadata(key)``."""

    def __init__(self, path: str):
        from gguf import GGUFReader

        self.path = os.path.abspath(path)
        self.reader = GGUFReader(self.path)
        self.architecture = self.metadata("general.architecture")
        if self.architecture not in _ARCHITECTURES:
            raise UnsupportedModel(
                f"GGUF architecture {self.architecture!r} is not supported (supported: {', '.join(_ARCHITECTURES)})"
            )
        self._tensor_names = {t.name for t in self.reader.tensors}
        self.config = self._build_config()

    def metadata(self, key: str, default=None):
        field = self.reader.fields.get(key)
        if field is None:
            return default
        return field.contents()

    def _arch(self, key: str, default=None):
        return self.metadata(f"{self.architecture}.{key}", default)

    def _build_config(self) -> dict:
        hidden = int(self._arch("embedding_length"))
        heads = int(self._arch("attention.head_count"))
        kv_heads = self._arch("attention.head_count_kv", heads)
        if isinstance(kv_heads, list):  # per-layer list in some files; Llama has one value
            kv_heads = max(kv_heads)
        head_dim = int(self._arch("attention.key_length", hidden // heads))
        vocab = self._arch("vocab_size")
        if vocab is None:
            vocab = len(self.reader.fields["tokenizer.ggml.tokens"].data)
        cfg = {
            "model_type": _ARCHITECTURES[self.architecture],
            "architectures": ["LlamaForCausalLM"],
            "hidden_size": hidden,
            "intermediate_size": int(self._arch("feed_forward_length")),
            "num_hidden_layers": int(self._arch("block_count")),
            "num_attention_heads": heads,
            "num_key_value_heads": int(kv_heads),
            "head_dim": head_dim,
            "rope_theta": float(self._arch("rope.freq_base", 10000.0)),
            "rms_norm_eps": float(self._arch("attention.layer_norm_rms_epsilon", 1e-5)),
            "vocab_size": int(vocab),
            "max_position_embeddings": int(self._arch("context_length", 4096)),
            "tie_word_embeddings": "output.weight" not in self._tensor_names,
            "hidden_act": "silu",
            "attention_bias": "blk.0.attn_q.bias" in self._tensor_names,
            "bos_token_id": self.metadata("tokenizer.ggml.bos_token_id"),
            "eos_token_id": self.metadata("tokenizer.ggml.eos_token_id"),
        }
        rotary_dim = self._arch("rope.dimension_count")
        if rotary_dim is not None and int(rotary_dim) != head_dim:
            raise UnsupportedModel(f"partial rotary ({rotary_dim} of {head_dim}) in a Llama GGUF is not supported")
        scaling_type = self._arch("rope.scaling.type")
        if scaling_type == "linear":
            cfg["rope_scaling"] = {"rope_type": "linear", "factor": float(self._arch("rope.scaling.factor"))}
        elif scaling_type not in (None, "none"):
            raise UnsupportedModel(f"GGUF rope scaling {scaling_type!r} is not supported")
        if "rope_freqs.weight" in self._tensor_names:
            # Llama 3.1+: llama.cpp stores the llama3 scaling as per-frequency divisors instead of metadata.
            t = next(t for t in self.reader.tensors if t.name == "rope_freqs.weight")
            cfg["rope_freq_factors"] = [float(x) for x in np.asarray(t.data, dtype=np.float32).reshape(-1)]
        return cfg

    def tensors(self, progress: bool = True) -> Iterator[tuple[str, torch.Tensor]]:
        """(HF name, fp32 CPU tensor) for every weight, one at a time (peak memory: one dequantized tensor)."""
        from gguf.quants import dequantize
        from tqdm import tqdm

        heads, kv_heads = self.config["num_attention_heads"], self.config["num_key_value_heads"]
        permute = self.config["model_type"] == "llama"
        bar = tqdm(self.reader.tensors, desc="Loading GGUF tensors", unit="tensor", disable=not progress, leave=False)
        for t in bar:
            if t.name in _SKIP:
                continue
            name = hf_name(t.name)
            if name is None:
                logger.warning(f"Skipping unknown GGUF tensor {t.name}")
                continue
            w = dequantize(t.data, t.tensor_type)
            # numpy shape is (ne[1], ne[0]) = (out, in): already HF's Linear layout
            w = np.asarray(w, dtype=np.float32).reshape([int(x) for x in reversed(t.shape)])
            if permute and ".attn_q." in t.name:
                w = _unpermute(w, heads)
            elif permute and ".attn_k." in t.name:
                w = _unpermute(w, kv_heads)
            if not (w.flags.writeable and w.flags.c_contiguous):  # F32/F16 tensors are views of the mmap
                w = np.array(w, dtype=np.float32, order="C")
            yield name, torch.from_numpy(w)

    def tensor_types(self) -> dict[str, int]:
        from collections import Counter

        return dict(Counter(t.tensor_type.name for t in self.reader.tensors))


def find_gguf(path: str) -> str | None:
    """``path`` itself if it is a .gguf file, the one .gguf inside a directory, else None."""
    if os.path.isfile(path) and path.endswith(".gguf"):
        return path
    if os.path.isdir(path):
        found = sorted(f for f in os.listdir(path) if f.endswith(".gguf"))
        if len(found) == 1:
            return os.path.join(path, found[0])
        if len(found) > 1:
            raise UnsupportedModel(f"{path} holds several .gguf files ({', '.join(found)}); pass one of them")
    return None
