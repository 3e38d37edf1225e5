"""Static activation scales for the quantizer: the largest |input| each quantized Linear sees while the BF16 model
runs over calibration tokens, through our own worker (``freetoken.LLM``).

The projections are unfused for the run (the worker fuses q|k|v, gate|up, ... into one GEMM; unfused, each Linear is
called and its hook fires; the weights are views of the fused tensors, so nothing is copied). Routed experts follow
ModelOpt's fused-experts quantizers: gate/up see the whole block input, down one amax shared by the layer's experts
(the largest ``silu(gate)·up`` of any token routed to any of them).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .config import normalize

_FUSED_ATTRS = ("_qkv", "_in_proj", "_fused", "_gate_up")


def _unfuse(model: nn.Module) -> None:
    for m in model.modules():
        for attr in _FUSED_ATTRS:
            if getattr(m, attr, None) is not None:
                setattr(m, attr, None)


def _track(amax: dict, key: str, value: torch.Tensor) -> None:
    v = value.detach().abs().amax().float().cpu()
    amax[key] = v if key not in amax else torch.maximum(amax[key], v)


def _expert_hook(amax: dict, prefix: str, experts):
    def hook(_module, args):
        x, topk_ids = args[0], args[1]
        w13, I = experts.gate_up_proj, experts.intermediate_size
        down = torch.zeros(())
        for e in torch.unique(topk_ids).tolist():
            xe = x[(topk_ids == e).any(dim=-1)]
            gate, up = F.linear(xe, w13[e].to(x.device)).split(I, dim=-1)
            down = torch.maximum(down, (F.silu(gate) * up).abs().amax().float().cpu())
        for e in range(experts.num_experts):
            for p in ("gate_proj", "up_proj"):
                _track(amax, f"{prefix}.{e}.{p}", x)
            _track(amax, f"{prefix}.{e}.down_proj", down)

    return hook


def calibrate_input_amax(model_path: str, token_ids: list[int], device: str = "auto") -> dict[str, torch.Tensor]:
    """Activation amax per Linear (normalized names, experts per expert) over one forward of ``token_ids``."""
    from ..layers.moe import FusedExperts
    from ..llm import LLM

    llm = LLM(model_path, device=device, moe_backend="fused", load_progress=False)
    model = llm.worker.model
    _unfuse(model)
    amax: dict[str, torch.Tensor] = {}
    hooks = []
    for name, m in model.named_modules():
        if isinstance(m, nn.Linear):
            key = normalize(name)
            hooks.append(m.register_forward_pre_hook(lambda _m, a, k=key: _track(amax, k, a[0])))
        elif isinstance(m, FusedExperts):
            hooks.append(m.register_forward_pre_hook(_expert_hook(amax, normalize(name), m)))
    try:
        with torch.no_grad():
            llm.logits(token_ids)
    finally:
        for h in hooks:
            h.remove()
    return amax


def calibration_tokens(model_path: str, n: int, seed: int = 0) -> list[int]:
    """``n`` token ids: the built-in calibration text through the model's tokenizer, repeated; random ids when the
    checkpoint has no tokenizer."""
    import os

    tok_path = os.path.join(model_path, "tokenizer.json")
    if os.path.isfile(tok_path):
        from tokenizers import Tokenizer

        ids = Tokenizer.from_file(tok_path).encode(_TEXT).ids
        return (ids * (n // max(1, len(ids)) + 1))[:n]
    import json

    with open(os.path.join(model_path, "config.json")) as f:
        cfg = json.load(f)
    vocab = int((cfg.get("text_config") or cfg)["vocab_size"])
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


_TEXT = (
    "The quick brown fox jumps over the lazy dog. In 1905 Albert Einstein published four papers that changed "
    "physics. def fibonacci(n):\n    return n if n < 2 else fibonacci(n - 1) + fibonacci(n - 2)\n"
    "東京は日本の首都であり、世界で最も人口の多い都市圏の一つです。La mer Méditerranée borde l'Europe du Sud. "
    'Q: What is 17 * 23? A: 391. <tool_call>{"name": "search", "arguments": {"q": "weather"}}</tool_call>'
)
