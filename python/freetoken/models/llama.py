"""Llama family (Llama 2/3, Mistral without sliding window, SmolLM2, ...): the shared decoder
(``dense_decoder.py``) as it is: no q/k norms, a SiLU MLP, Llama-3 rope scaling where the config has it."""

from __future__ import annotations

from .dense_decoder import DecoderForCausalLM


class LlamaForCausalLM(DecoderForCausalLM):
    qk_norm = False
