"""Batched sampling: one token per row of ``logits [S, V]`` with per-row settings.

Per row, in this order (as vLLM / SGLang do): temperature (0 = greedy argmax of the raw logits, and top_k = 1
is greedy too) → softmax → top-k (<= 0 disables) → top-p (1 disables; keeps the smallest set of most likely
tokens whose mass reaches top_p, never fewer than one) → min-p (0 disables; drops tokens with probability below
min_p × the most likely token's) → draw from what is left.

Determinism: the draw of a row uses one uniform number from a CPU ``torch.Generator`` seeded with that row's
seed (inverse-CDF over the filtered distribution sorted by probability, ties by token id). So a row's token
depends only on its logits, its settings and its seed: not on the batch it runs in, nor the device.

Logprob returned: ``log_softmax`` of the raw logits (temperature 1, before any filtering) at the chosen token,
i.e. the model's own log-probability, which is what OpenAI-style ``logprobs`` report.
"""

from __future__ import annotations

import torch

_U64 = (1 << 64) - 1


def _uniforms(seeds: torch.Tensor) -> torch.Tensor:
    """One U[0, 1) per row from a generator seeded with that row's seed (u64 bits carried in an i64)."""
    out = torch.empty(seeds.numel(), dtype=torch.float64)
    g = torch.Generator()
    for i, s in enumerate(seeds.tolist()):
        g.manual_seed(int(s) & _U64)
        out[i] = torch.rand((), generator=g, dtype=torch.float64)
    return out


def sample(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_p: torch.Tensor,
    top_k: torch.Tensor,
    min_p: torch.Tensor,
    seeds: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``logits [S, V]`` (fp32, any device); settings are CPU tensors of length S. Returns
    ``(tokens int64 [S], logprobs f32 [S])`` on the logits' device."""
    s, v = logits.shape
    dev = logits.device
    logits = logits.float()
    logprobs_all = torch.log_softmax(logits, dim=-1)
    greedy_tok = torch.argmax(logits, dim=-1)
    if s == 0:
        return greedy_tok, logprobs_all.new_empty(0)
    greedy = (temperature <= 0) | (top_k == 1)
    tokens = greedy_tok
    rows = torch.nonzero(~greedy).flatten()
    if rows.numel():
        rows_d = rows.to(dev)
        temp = temperature[rows].to(dev, torch.float32)[:, None]
        probs = torch.softmax(logits[rows_d] / temp, dim=-1)
        sorted_p, order = torch.sort(probs, dim=-1, descending=True, stable=True)
        rank = torch.arange(v, device=dev)[None, :]
        k = top_k[rows].to(dev)
        k = torch.where(k <= 0, torch.full_like(k, v), k)[:, None]
        keep = rank < k
        mass_before = torch.cumsum(sorted_p, dim=-1) - sorted_p  # mass of the more likely tokens
        keep &= mass_before < top_p[rows].to(dev, torch.float32)[:, None]
        keep &= sorted_p >= min_p[rows].to(dev, torch.float32)[:, None] * sorted_p[:, :1]
        keep[:, 0] = True  # the most likely token always survives
        kept = torch.where(keep, sorted_p, torch.zeros_like(sorted_p))
        cdf = torch.cumsum(kept.double(), dim=-1)
        u = _uniforms(seeds[rows]).to(dev) * cdf[:, -1]
        pick = torch.searchsorted(cdf, u[:, None], right=True).clamp_(max=v - 1)
        # never land on a filtered-out token (u * total == total, or float rounding at a zero-width step)
        last_kept = keep.long().cumsum(-1).argmax(-1, keepdim=True)
        pick = torch.minimum(pick, last_kept)
        pick = torch.where(keep.gather(1, pick), pick, last_kept)
        tokens = tokens.clone()
        tokens[rows_d] = order.gather(1, pick).squeeze(1)
    return tokens, logprobs_all.gather(1, tokens[:, None]).squeeze(1)
