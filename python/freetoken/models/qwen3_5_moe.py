"""Qwen3.5 / Qwen3.6 MoE (``qwen3_5_moe``, text config ``qwen3_5_moe_text``): the language model of
``Qwen3_5MoeForConditionalGeneration`` checkpoints, served text-only.

Config: the outer config with ``text_config`` flattened in by ``ModelConfig.from_dict`` (a bare text config works
too). Tensors live under ``model.language_model.`` in the released checkpoints and under ``model.`` in transformers
5.x text-only saves; both are accepted. ``mtp.*`` (MTP head) and ``model.visual.*`` (vision tower) are skipped.
GDN projections are separate (``in_proj_qkv``, ``in_proj_z``, ``in_proj_b``, ``in_proj_a``); experts fused
(``experts.gate_up_proj``) or per expert (quantized checkpoints); the router always renormalises.
"""

from __future__ import annotations

from .hybrid_blocks import HybridMoeForCausalLM


class Qwen3_5MoeForCausalLM(HybridMoeForCausalLM):
    interleaved_gdn = False
    weight_prefixes = ("model.language_model.", "model.")
    skip_prefixes = ("mtp.", "model.visual.", "visual.")
