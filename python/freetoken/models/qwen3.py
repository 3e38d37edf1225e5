"""Qwen3 dense (``qwen3``, ``Qwen3ForCausalLM``): the shared decoder (``dense_decoder.py``) with a plain-w RMSNorm
per head on q and k before RoPE (HF ``Qwen3Attention``); Qwen3-MoE builds on it."""

from __future__ import annotations

from .dense_decoder import DecoderForCausalLM


class Qwen3ForCausalLM(DecoderForCausalLM):
    qk_norm = True
