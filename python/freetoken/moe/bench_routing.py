"""Routing driven by the benchmark, not the router (benchmarks only; REFERENCES §5.4).

A random model's greedy decode keeps routing to the same few experts, so an expert-cache benchmark with dummy
weights would report an all-hit cache. ``FREETOKEN_BENCH_ROUTING`` replaces each token's expert ids (the router's
weights are kept):

- ``uniform``: k distinct experts drawn uniformly per token (the worst case for a cache);
- ``zipf``: k distinct experts drawn from a fixed per-layer Zipf(1) popularity (skewed, more realistic);
- ``hot``: the same k experts per layer for every token (an all-hit cache once warm);
- unset or ``off``: the router's own choice.

Draws are fixed-shape device work (Gumbel top-k: sampling without replacement), so they run inside decode CUDA
graphs. ``FREETOKEN_BENCH_ROUTING_FILE=path`` lets a benchmark switch the mode while the server runs: the worker
polls the file's modification time once per step (``BenchRoutingControl``), and recaptures its graphs on a change.
"""

from __future__ import annotations

import os
from typing import Optional

import torch

MODES = ("off", "uniform", "zipf", "hot")

_mode = os.environ.get("FREETOKEN_BENCH_ROUTING", "") or "off"


def mode() -> str:
    return _mode


def set_mode(name: str) -> None:
    global _mode
    name = name.strip() or "off"
    if name not in MODES:
        raise ValueError(f"FREETOKEN_BENCH_ROUTING={name!r}: expected one of {', '.join(MODES)}")
    _mode = name


set_mode(_mode)  # fail at import on a bad value


# per (kind, layer, experts, device): made on the first (eager) call, so a CUDA-graph capture, which cannot copy
# pageable host memory to the device, finds them there
_tables: dict = {}


def _table(kind: str, layer_id: int, num_experts: int, k: int, device) -> torch.Tensor:
    key = (kind, layer_id, num_experts, k, str(device))
    if key not in _tables:
        if kind == "zipf":  # log of Zipf(1) weights over a fixed per-layer permutation of the experts
            g = torch.Generator().manual_seed(layer_id)
            weights = 1.0 / torch.arange(1, num_experts + 1, dtype=torch.float32)
            t = torch.log(weights[torch.randperm(num_experts, generator=g)])
        else:  # hot: k fixed experts per layer
            g = torch.Generator().manual_seed(1000 + layer_id)
            t = torch.randperm(num_experts, generator=g)[:k]
        _tables[key] = t.to(device)
    return _tables[key]


def override(ids: torch.Tensor, layer_id: int, num_experts: int) -> torch.Tensor:
    """The expert ids ``[T, k]`` the current mode routes to instead of ``ids`` (``ids`` itself when off)."""
    if _mode == "off":
        return ids
    T, k = ids.shape
    if _mode == "hot":
        return _table("hot", layer_id, num_experts, k, ids.device).to(ids.dtype).expand(T, k).contiguous()
    u = torch.rand(T, num_experts, device=ids.device).clamp_(min=1e-20)
    gumbel = -torch.log(-torch.log(u))
    if _mode == "zipf":
        gumbel = gumbel + _table("zipf", layer_id, num_experts, k, ids.device)
    return gumbel.topk(k, dim=-1).indices.to(ids.dtype)


class BenchRoutingControl:
    """Polls ``FREETOKEN_BENCH_ROUTING_FILE`` (if set) and applies a changed mode; ``poll()`` is True when the
    mode changed (the caller recaptures its CUDA graphs)."""

    def __init__(self, path: Optional[str] = None):
        self.path = path if path is not None else os.environ.get("FREETOKEN_BENCH_ROUTING_FILE")
        self._mtime: Optional[float] = None

    def poll(self) -> bool:
        if not self.path:
            return False
        try:
            mtime = os.stat(self.path).st_mtime_ns
        except OSError:
            return False
        if mtime == self._mtime:
            return False
        self._mtime = mtime
        with open(self.path) as f:
            new = f.read().strip() or "off"
        if new == _mode:
            return False
        set_mode(new)
        return True
