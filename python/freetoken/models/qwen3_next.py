"""Qwen3-Next (``qwen3_next``, e.g. Qwen3-Next-80B-A3B, Qwen3-Coder-Next): flat config, tensors under ``model.``.

GDN projections come interleaved per key head (``in_proj_qkvz``, ``in_proj_ba``, REFERENCES §1.9); experts per
expert (``mlp.experts.{e}.*``, merged into the fused parameters at load) or fused; the router renormalises when
``norm_topk_prob`` (true in every release). ``mtp.*`` is skipped.
"""

from __future__ import annotations

from .hybrid_blocks import HybridMoeForCausalLM


class Qwen3NextForCausalLM(HybridMoeForCausalLM):
    interleaved_gdn = True
    weight_prefixes = ("model.",)
    skip_prefixes = ("mtp.",)
