"""Rotary position embeddings, rotate-half (NeoX) layout, optionally on only the first ``rotary_dim`` dims of
each head (Qwen3-Next/3.5: 64 of 256). Supports Llama-3 frequency scaling."""

from __future__ import annotations

import math

import torch
from torch import nn


def _llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict) -> torch.Tensor:
    factor = scaling["factor"]
    low, high = scaling.get("low_freq_factor", 1.0), scaling.get("high_freq_factor", 4.0)
    old_ctx = scaling["original_max_position_embeddings"]
    low_wl, high_wl = old_ctx / low, old_ctx / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wl, inv_freq / factor, inv_freq)
    smooth = (old_ctx / wavelen - low) / (high - low)
    mid = (1 - smooth) * scaled / factor + smooth * scaled
    is_mid = (wavelen >= high_wl) & (wavelen <= low_wl)
    return torch.where(is_mid, mid, scaled)


def rope_config(config, default_partial: float = 1.0) -> tuple[float, float, dict | None]:
    """``(theta, partial_rotary_factor, scaling)`` from either spelling: transformers >= 5 ``rope_parameters`` or
    the flat ``rope_theta`` / ``rope_scaling`` / ``partial_rotary_factor`` fields. ``scaling`` is None for plain
    RoPE; ``mrope`` counts as plain, since interleaved MRoPE equals 1-D RoPE for text (all three position axes
    are equal). Llama-3 scaling is supported; any other scaling type is refused rather than ignored."""
    params = {**(config.get("rope_scaling") or {}), **(config.get("rope_parameters") or {})}
    theta = float(params.get("rope_theta") or config.get("rope_theta") or 10000.0)
    partial = float(params.get("partial_rotary_factor", config.get("partial_rotary_factor", default_partial)))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type in ("default", "mrope", None):
        return theta, partial, None
    if rope_type == "llama3":
        return theta, partial, params
    from ..errors import UnsupportedModel

    raise UnsupportedModel(f"config.json: rope_type {rope_type!r} is not supported (default, mrope and llama3 are)")


class RotaryEmbedding(nn.Module):
    def __init__(self, head_dim: int, rotary_dim: int, base: float, max_positions: int, scaling: dict | None = None):
        super().__init__()
        self.head_dim = head_dim
        self.rotary_dim = rotary_dim
        inv_freq = 1.0 / (base ** (torch.arange(0, rotary_dim, 2, dtype=torch.float64) / rotary_dim))
        if scaling and scaling.get("rope_type", scaling.get("type")) == "llama3":
            inv_freq = _llama3_inv_freq(inv_freq, scaling)
        self.register_buffer("inv_freq", inv_freq.float(), persistent=False)

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions.float()[:, None] * self.inv_freq.to(positions.device)[None, :]
        emb = torch.cat([freqs, freqs], dim=-1)
        return emb.cos(), emb.sin()

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        """``q [T, nh, D]``, ``k [T, nkv, D]``; rotates the first ``rotary_dim`` dims in fp32."""
        cos, sin = self.cos_sin(positions)
        return self._rotate(q, cos, sin), self._rotate(k, cos, sin)

    def _rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        r = self.rotary_dim
        rot, rest = x[..., :r].float(), x[..., r:]
        half = r // 2
        rotated = torch.cat([-rot[..., half:], rot[..., :half]], dim=-1)
        out = rot * cos[:, None, :] + rotated * sin[:, None, :]
        return torch.cat([out.to(x.dtype), rest], dim=-1) if r < x.shape[-1] else out.to(x.dtype)
