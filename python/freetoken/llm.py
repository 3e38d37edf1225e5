"""The offline API: ``LLM(model_path).generate(prompts, SamplingParams(...))``.

It runs the production path minus HTTP: the Rust scheduler (``_core.OfflineEngine``, same admission,
chunking and prefix cache as ``ft serve``) stepping the same ``Worker``. ``logits(ids)`` gives per-position
logits of one sequence for tests and notebooks.
"""

from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass, field
from typing import Optional, Sequence, Union


@dataclass
class SamplingParams:
    """The OpenAI-named sampling fields; checked by the server's validation layer (a bad value raises
    ``ValueError`` naming the field)."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: Optional[int] = None
    max_tokens: int = 64
    ignore_eos: bool = False


@dataclass
class RequestOutput:
    prompt_token_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    text: str = ""
    finish_reason: Optional[str] = None
    cached_tokens: int = 0
    error: Optional[str] = None


class LLM:
    def __init__(self, model_path: Optional[str] = None, **worker_args):
        from . import _core
        from .worker import Worker

        self.worker = Worker({"model_path": model_path, **worker_args})
        self.info = self.worker.info()
        self._tokenizer = None
        # the scheduler as `ft serve` configures it, from the worker's settings and engine description
        self.engine = _core.OfflineEngine(self.worker)
        self._ids = itertools.count(1)

    @property
    def tokenizer(self):
        """A ``tokenizers.Tokenizer`` for the model (the same file the server uses)."""
        if self._tokenizer is None:
            from tokenizers import Tokenizer

            self._tokenizer = Tokenizer.from_file(str(self.info["tokenizer_path"]))
        return self._tokenizer

    def encode(self, text: str) -> list[int]:
        ids = self.tokenizer.encode(text, add_special_tokens=False).ids
        if self.info.get("add_bos_token") and self.info.get("bos_token_id") is not None:
            ids = [self.info["bos_token_id"], *ids]
        return ids

    def generate(
        self,
        prompts: Sequence[Union[str, Sequence[int]]],
        sampling: Union[SamplingParams, Sequence[SamplingParams], None] = None,
    ) -> list[RequestOutput]:
        """Runs every prompt to completion (batched by the scheduler) and returns outputs in prompt order."""
        if isinstance(prompts, (str, bytes)) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # one prompt given bare
        sampling = sampling or SamplingParams()
        params = list(sampling) if isinstance(sampling, (list, tuple)) else [sampling] * len(prompts)
        outputs: dict[int, RequestOutput] = {}
        order = []
        stop_ids = [int(t) for t in self.info.get("eos_token_ids", [])]
        for prompt, sp in zip(prompts, params):
            ids = self.encode(prompt) if isinstance(prompt, str) else [int(t) for t in prompt]
            rid = next(self._ids)
            order.append(rid)
            outputs[rid] = RequestOutput(prompt_token_ids=ids)
            self.engine.add_request(rid, ids, dataclasses.asdict(sp))
        while not self.engine.is_idle():
            for kind, rid, a, b in self.engine.step():
                out = outputs.get(rid)
                if out is None:
                    continue
                if kind == "started":
                    out.cached_tokens = int(b)
                elif kind == "token":
                    out.token_ids.append(int(a))
                    out.logprobs.append(float(b))
                elif kind == "finished":
                    out.finish_reason = a
                elif kind == "failed":
                    out.finish_reason, out.error = "error", a
        for out in outputs.values():
            text_ids = [t for t in out.token_ids if t not in stop_ids]
            out.text = self.tokenizer.decode(text_ids, skip_special_tokens=True)
        return [outputs[r] for r in order]

    def logits(self, token_ids: Sequence[int]):
        """Per-position logits ``[T, vocab]`` (fp32) of one sequence, computed by the serving worker."""
        return self.worker.forward_logits(list(token_ids))
