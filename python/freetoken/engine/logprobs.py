"""The logprobs a step returns besides its sampled tokens (the ``extra`` of ``Worker.execute``, ``step_plan.py``).

Which logits a step computes: the last token of each sampled sequence, as always, plus every token of the chunks
that want prompt logprobs (``plp_seq``). The logits at token ``t`` of such a chunk predict token ``t + 1``: the next
new token, or ``plp_next`` after the chunk's last one (a chunk that ends the prompt has none: its last logits
predict the sampled token, whose logprob comes with it).

    chunk tokens  t4 t5 t6 t7 | plp_next t8       logits rows   4  5  6  7        sampled rows: last token of
    targets                                       predict      t5 t6 t7 t8       each sampled sequence

Everything is computed from the same fp32 logits the sampler reads, before penalties and filtering: one
``logsumexp`` over the computed rows, the targets gathered, one ``topk`` (k = the most any position of the step
asks) when alternatives are asked, and one copy to the host. A step that asks for nothing computes nothing more
than before (``LogitRows.sampled`` is None: the logits are the sampled rows, in order).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch

from ..layers.sampler import top_logprobs
from .step_plan import StepPlan

# Most alternatives a position may ask for (OpenAI's limit; the decode graph computes this many when any row asks).
MAX_TOP_LOGPROBS = 20


@dataclass
class LogitRows:
    """Where a step's logits come from and what each row is for (CPU int64 tensors)."""

    indices: torch.Tensor  # [R] token rows of the batch whose logits the model computes
    sampled: Optional[torch.Tensor]  # [S] logits rows of the sampled sequences, sample order (None: 0..S-1)
    prompt: torch.Tensor  # [P] logits rows at prompt positions whose next token's logprob is wanted
    targets: torch.Tensor  # [P] the token each of those rows predicts
    prompt_top: int  # most alternatives any prompt position asks for


def logit_rows(plan: StepPlan, all_logits: bool = False) -> LogitRows:
    """The rows ``plan`` needs (``all_logits``: every token, for offline per-position logits)."""
    last = plan.cu_seqlens[1:][plan.sampling.seq_index] - 1
    none = torch.zeros(0, dtype=torch.int64)
    if not all_logits and plan.plp_seq.numel() == 0:
        return LogitRows(last, None, none, none, 0)
    chunks, prompt, targets = [], [], []
    for b, nxt in zip(plan.plp_seq.tolist(), plan.plp_next.tolist()):
        start, end = int(plan.cu_seqlens[b]), int(plan.cu_seqlens[b + 1])
        chunks.append(torch.arange(start, end))
        prompt.append(torch.arange(start, end if nxt >= 0 else end - 1))  # the last predicts plp_next or the sample
        targets += [plan.input_ids[start + 1 : end], torch.tensor([nxt] if nxt >= 0 else [], dtype=torch.int64)]
    indices = torch.arange(plan.num_tokens) if all_logits else torch.unique(torch.cat([last, *chunks]))
    row_of = torch.full((plan.num_tokens,), -1, dtype=torch.int64)
    row_of[indices] = torch.arange(indices.numel())
    top = int(plan.plp_top.max()) if plan.plp_top.numel() else 0
    prompt_rows = row_of[torch.cat(prompt)] if prompt else none
    return LogitRows(indices, row_of[last], prompt_rows, torch.cat(targets) if targets else none, top)


def step_logprobs(logits: torch.Tensor, rows: LogitRows, num_top: torch.Tensor) -> dict:
    """The ``extra`` dict of a step: top logprobs of the sampled rows (``num_top [S]`` asked per row) and the prompt
    logprobs of ``rows``, from ``logits [R, V]`` (the model's output for ``rows.indices``)."""
    s = num_top.numel() if num_top.numel() and int(num_top.max()) > 0 else 0  # sampled rows with alternatives
    p = rows.prompt.numel()
    p_top = p if rows.prompt_top > 0 else 0  # prompt rows with alternatives
    if s == 0 and p == 0:
        return {}
    dev = logits.device
    lse = torch.logsumexp(logits, dim=-1)
    parts, k = [], 0
    if s or p_top:
        k = min(max(int(num_top.max()) if s else 0, rows.prompt_top if p_top else 0), logits.shape[-1])
        sampled = torch.arange(s) if rows.sampled is None else rows.sampled
        picked = torch.cat([sampled[:s], rows.prompt[:p_top]]).to(dev)
        ids, lps = top_logprobs(logits, k, lse)
        parts += [lps[picked].flatten(), ids[picked].flatten().float()]  # ids < 2^24: exact in fp32
    if p:
        pr, t = rows.prompt.to(dev), rows.targets.to(dev)
        parts.append(logits[pr, t] - lse[pr])
    host = torch.cat(parts).float().cpu().numpy()  # the one copy to the host
    return _unpack(host, k, s, p_top, p)


def _unpack(host: np.ndarray, k: int, s: int, p_top: int, p: int) -> dict:
    """Splits the packed host array (top logprobs of ``s`` sampled then ``p_top`` prompt rows, their ids, then the
    ``p`` prompt targets' logprobs) into the ``extra`` dict's little-endian arrays."""
    n = (s + p_top) * k
    lps, ids = host[:n].reshape(-1, max(k, 1)), host[n : 2 * n].reshape(-1, max(k, 1))
    f32 = lambda a: np.ascontiguousarray(a, dtype="<f4").tobytes()  # noqa: E731
    i32 = lambda a: np.ascontiguousarray(a, dtype="<i4").tobytes()  # noqa: E731
    out = {}
    if s:
        out.update(top_k=k, top_ids=i32(ids[:s]), top_logprobs=f32(lps[:s]))
    if p:
        out["prompt_logprobs"] = f32(host[2 * n : 2 * n + p])
    if p_top:
        out.update(prompt_top_k=k, prompt_top_ids=i32(ids[s:]), prompt_top_logprobs=f32(lps[s:]))
    return out


def graph_logprobs(num_top: np.ndarray, ids: np.ndarray, lps: np.ndarray) -> dict:
    """The ``extra`` dict of a decode-graph step: the graph's fixed ``MAX_TOP_LOGPROBS`` alternatives per row."""
    if not num_top.size or int(num_top.max()) == 0:
        return {}
    return {
        "top_k": int(ids.shape[1]),
        "top_ids": np.ascontiguousarray(ids, dtype="<i4").tobytes(),
        "top_logprobs": np.ascontiguousarray(lps, dtype="<f4").tobytes(),
    }
