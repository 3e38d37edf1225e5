"""Which class serves which checkpoint: keyed by the config's ``model_type`` (outer and text)."""

from __future__ import annotations

import importlib

from ..errors import UnsupportedModel
from .base import CausalLM, ModelConfig

# model_type -> "module:Class", imported lazily so a model's dependencies load only when it is served.
_MODELS: dict[str, str] = {
    "llama": "freetoken.models.llama:LlamaForCausalLM",
    "qwen3": "freetoken.models.qwen3:Qwen3ForCausalLM",
    "qwen3_moe": "freetoken.models.qwen3_moe:Qwen3MoeForCausalLM",
    "qwen3_next": "freetoken.models.qwen3_next:Qwen3NextForCausalLM",
    "qwen3_5_moe": "freetoken.models.qwen3_5_moe:Qwen3_5MoeForCausalLM",
    "qwen3_5_moe_text": "freetoken.models.qwen3_5_moe:Qwen3_5MoeForCausalLM",
}


def register_model(model_type: str, target: str) -> None:
    _MODELS[model_type] = target


def model_class(config: ModelConfig) -> type[CausalLM]:
    for key in (config.get("model_type"), config.get("outer_model_type")):
        if key in _MODELS:
            module, name = _MODELS[key].split(":")
            return getattr(importlib.import_module(module), name)
    raise UnsupportedModel(
        f"model_type {config.get('model_type')!r} is not supported (supported: {', '.join(sorted(_MODELS))})"
    )
