"""What every model looks like to the worker.

A model is an ``nn.Module`` built from a plain config (``ModelConfig``: the checkpoint's ``config.json``, with
``text_config`` flattened in), loaded from HF-named tensors, and run on a ``ForwardBatch``. It declares the
caches it needs so the worker can size the pools before the first step.
"""

from __future__ import annotations

from abc import abstractmethod
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Iterable, Optional

import torch
from torch import nn

from ..engine.forward_batch import ForwardBatch
from ..errors import UnsupportedModel

# The key spellings HF's config classes accept for one another: their ``attribute_map`` (the name our models read
# -> the key transformers writes), by ``model_type``. transformers >= 5.2 saves Qwen3-MoE's expert count as
# ``num_local_experts``. tests/test_model_config.py checks this table against the installed transformers.
CONFIG_KEY_ALIASES: dict[str, dict[str, str]] = {
    "qwen3_moe": {"num_experts": "num_local_experts"},
    "qwen3_next": {},
    "qwen3_5_moe": {},
    "qwen3_5_moe_text": {},
    "qwen3": {},
    "llama": {},
}


class MissingConfigKey(UnsupportedModel, AttributeError):
    """A key the model needs is not in its config.json. An ``AttributeError`` too, so ``getattr`` with a default
    and ``hasattr`` keep working; ``ft serve`` prints it as one line."""


class ModelConfig(SimpleNamespace):
    """Attribute access over a checkpoint config dict; ``get`` with a default for optional fields. Keys spelled as
    another transformers version writes them (``CONFIG_KEY_ALIASES``) read under both names; reading a key the
    config lacks raises ``MissingConfigKey`` naming it."""

    @classmethod
    def from_dict(cls, d: dict) -> "ModelConfig":
        flat = dict(d)
        text = d.get("text_config")
        if isinstance(text, dict):  # Qwen3.5/3.6: the language model's fields live under text_config
            flat.update(text)
            flat.setdefault("architectures", d.get("architectures"))
            flat["outer_model_type"] = d.get("model_type")
        for model_type in (flat.get("model_type"), flat.get("outer_model_type")):
            for ours, written in CONFIG_KEY_ALIASES.get(model_type, {}).items():
                if ours not in flat and written in flat:
                    flat[ours] = flat[written]
                elif written not in flat and ours in flat:
                    flat[written] = flat[ours]
        return cls(**flat)

    def get(self, key: str, default=None):
        return getattr(self, key, default)

    def __getattr__(self, key: str):
        # Only reached when the key is absent.
        if key.startswith("__"):
            raise AttributeError(key)
        model_type = self.__dict__.get("model_type")
        written = {w for aliases in CONFIG_KEY_ALIASES.values() for o, w in aliases.items() if o == key}
        also = f" (nor {', '.join(sorted(written))})" if written else ""
        raise MissingConfigKey(f"config.json has no {key!r}{also}, which a {model_type} model needs")


@dataclass(frozen=True)
class KVLayout:
    """Full-attention KV the model needs: one pool layer per attention layer."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    v_head_dim: Optional[int] = None


@dataclass(frozen=True)
class StateLayout:
    """Per-sequence recurrent state of hybrid models (Gated DeltaNet layers)."""

    num_layers: int
    conv_shape: tuple[int, ...]  # per slot, e.g. (conv_dim, kernel - 1)
    ssm_shape: tuple[int, ...]  # per slot, e.g. (Hv, dk, dv)
    ssm_dtype: torch.dtype = torch.float32


class CausalLM(nn.Module):
    config: ModelConfig

    @property
    @abstractmethod
    def kv_layout(self) -> KVLayout: ...

    @property
    def state_layout(self) -> Optional[StateLayout]:
        return None

    @abstractmethod
    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        """Logits in fp32, ``[len(batch.logits_indices), vocab]``."""

    @abstractmethod
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Take tensors by their HF checkpoint names; unknown names (MTP, vision) are skipped on purpose,
        missing ones raise."""
