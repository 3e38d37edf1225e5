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


class ModelConfig(SimpleNamespace):
    """Attribute access over a checkpoint config dict; ``get`` with a default for optional fields."""

    @classmethod
    def from_dict(cls, d: dict) -> "ModelConfig":
        flat = dict(d)
        text = d.get("text_config")
        if isinstance(text, dict):  # Qwen3.5/3.6: the language model's fields live under text_config
            flat.update(text)
            flat.setdefault("architectures", d.get("architectures"))
            flat["outer_model_type"] = d.get("model_type")
        return cls(**flat)

    def get(self, key: str, default=None):
        return getattr(self, key, default)


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
