"""Batched sampling on the device: one token per row of ``logits [S, V]`` with per-row settings as tensors.

Per row, in this order (as vLLM / SGLang do): temperature (0 = greedy argmax of the raw logits, and top_k = 1
is greedy too) → softmax → top-k (<= 0 disables) → top-p (1 disables; keeps the smallest set of most likely
tokens whose mass reaches top_p, never fewer than one) → min-p (0 disables; drops tokens with probability below
min_p × the most likely token's) → draw from what is left.

Everything is fixed-shape tensor work with no host sync, so a decode CUDA graph can capture it: ``greedy_tokens``
sits at the end of the forward graph, ``draw_tokens`` in a second graph replayed only when some row samples.

Determinism: the draw of a row uses one uniform number derived from that row's seed by SplitMix64 in integer
tensor arithmetic (inverse-CDF over the filtered distribution sorted by probability, ties by token id). So a
row's token depends only on its logits, its settings and its seed: not on the batch it runs in, nor the device.

Presence and frequency penalties (``apply_penalties``) change the logits first, greedy rows included.

Logprob returned: ``log_softmax`` of the raw logits (temperature 1, before penalties and any filtering) at the
chosen token, i.e. the model's own log-probability, which is what OpenAI-style ``logprobs`` report (vLLM's default
``raw_logprobs`` too). ``top_logprobs`` gives the most likely tokens of the same distribution.
"""

from __future__ import annotations

from typing import Optional

import torch

# SplitMix64 constants as signed int64 (tensor arithmetic wraps modulo 2^64)
_GOLDEN = -7046029254386353131  # 0x9E3779B97F4A7C15
_MIX1 = -4658895280553007687  # 0xBF58476D1CE4E5B9
_MIX2 = -7723592293110705685  # 0x94D049BB133111EB


def _shr(x: torch.Tensor, n: int) -> torch.Tensor:
    """Logical right shift of int64 bit patterns (``>>`` on int64 is arithmetic)."""
    return (x >> n) & ((1 << (64 - n)) - 1)


def uniform_from_seed(seeds: torch.Tensor) -> torch.Tensor:
    """One U[0, 1) per seed (u64 bits carried in an i64): SplitMix64's first output, top 53 bits, as float64."""
    z = seeds.to(torch.int64) + _GOLDEN
    z = (z ^ _shr(z, 30)) * _MIX1
    z = (z ^ _shr(z, 27)) * _MIX2
    z = z ^ _shr(z, 31)
    return _shr(z, 11).to(torch.float64) * (1.0 / (1 << 53))


def greedy_tokens(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(argmax int64 [S], its log-probability f32 [S])`` of ``logits [S, V]`` (fp32)."""
    tokens = torch.argmax(logits, dim=-1)
    return tokens, token_logprobs(logits, tokens)


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """The raw model log-probability of ``tokens`` (``log_softmax`` at temperature 1), f32 [S]."""
    picked = logits.gather(1, tokens[:, None]).squeeze(1)
    return (picked - torch.logsumexp(logits, dim=-1)).float()


def top_logprobs(logits: torch.Tensor, k: int, lse: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``k`` most likely tokens of each row of ``logits [R, V]`` (fp32), most likely first, with their raw
    log-probabilities: ``(int64 [R, k], f32 [R, k])``. ``topk`` of the logits minus their ``logsumexp`` (``lse [R]``
    when the caller has it) is ``topk`` of ``log_softmax`` without materializing it. Fixed shapes, no host sync (the
    decode graph runs it)."""
    values, ids = torch.topk(logits, k, dim=-1)
    lse = torch.logsumexp(logits, dim=-1) if lse is None else lse
    return ids, (values - lse[:, None]).float()


def apply_penalties(
    logits: torch.Tensor, counts: torch.Tensor, presence: torch.Tensor, frequency: torch.Tensor
) -> torch.Tensor:
    """OpenAI's presence and frequency penalties over the tokens a row generated before: ``logits - presence ·
    [count > 0] - frequency · count``. ``counts [S, V]`` int, the penalties ``[S]``; zeros leave a row unchanged."""
    c = counts.to(torch.float32)
    return logits - presence.to(torch.float32)[:, None] * (c > 0) - frequency.to(torch.float32)[:, None] * c


def is_greedy(temperature: torch.Tensor, top_k: torch.Tensor) -> torch.Tensor:
    return (temperature <= 0) | (top_k == 1)


def draw_tokens(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_p: torch.Tensor,
    top_k: torch.Tensor,
    min_p: torch.Tensor,
    seeds: torch.Tensor,
) -> torch.Tensor:
    """A filtered draw for every row (greedy rows included: callers pick the argmax for those). All settings are
    tensors of length S on the logits' device; no host sync."""
    s, v = logits.shape
    dev = logits.device
    temp = torch.where(temperature > 0, temperature, torch.ones_like(temperature)).to(torch.float32)[:, None]
    probs = torch.softmax(logits.float() / temp, dim=-1)
    sorted_p, order = torch.sort(probs, dim=-1, descending=True, stable=True)
    rank = torch.arange(v, device=dev)[None, :]
    k = top_k.to(torch.int64)
    k = torch.where(k <= 0, torch.full_like(k, v), k)[:, None]
    keep = rank < k
    mass_before = torch.cumsum(sorted_p, dim=-1) - sorted_p  # mass of the more likely tokens
    keep &= mass_before < top_p.to(torch.float32)[:, None]
    keep &= sorted_p >= min_p.to(torch.float32)[:, None] * sorted_p[:, :1]
    keep |= rank == 0  # the most likely token always survives (no scalar write: a CUDA graph replays it)
    kept = torch.where(keep, sorted_p, torch.zeros_like(sorted_p))
    cdf = torch.cumsum(kept.double(), dim=-1)
    u = uniform_from_seed(seeds) * cdf[:, -1]
    pick = torch.searchsorted(cdf, u[:, None], right=True).clamp_(max=v - 1)
    # never land on a filtered-out token (u * total == total, or float rounding at a zero-width step)
    last_kept = keep.long().cumsum(-1).argmax(-1, keepdim=True)
    pick = torch.minimum(pick, last_kept)
    pick = torch.where(keep.gather(1, pick), pick, last_kept)
    return order.gather(1, pick).squeeze(1)


def sample(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_p: torch.Tensor,
    top_k: torch.Tensor,
    min_p: torch.Tensor,
    seeds: torch.Tensor,
    all_greedy: Optional[bool] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``logits [S, V]`` (fp32, any device); settings are tensors of length S (host or device). Returns
    ``(tokens int64 [S], logprobs f32 [S])`` on the logits' device. ``all_greedy`` skips the filtered draw; when
    None it is read from host-side settings (device-side ones are assumed to need the draw)."""
    dev = logits.device
    logits = logits.float()
    if logits.shape[0] == 0:
        return torch.zeros(0, dtype=torch.int64, device=dev), torch.zeros(0, dtype=torch.float32, device=dev)
    greedy_tok = torch.argmax(logits, dim=-1)
    if all_greedy is None:
        all_greedy = temperature.device.type == "cpu" and bool(is_greedy(temperature, top_k).all())
    if all_greedy:
        return greedy_tok, token_logprobs(logits, greedy_tok)
    params = [t.to(dev, non_blocking=True) for t in (temperature, top_p, top_k, min_p, seeds)]
    drawn = draw_tokens(logits, *params)
    tokens = torch.where(is_greedy(params[0], params[2]), greedy_tok, drawn)
    return tokens, token_logprobs(logits, tokens)
