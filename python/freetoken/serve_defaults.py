"""The worker's settings: ``ft serve``'s flags, with the defaults the Rust CLI declares (the one place they live:
crates/ft-server/src/cli.rs). ``freetoken.LLM`` and tests pass a partial dict; every key they leave out takes the
flag's default, read from the extension, so no default is restated here.

Worker-only keys (not flags): ``device`` is a flag too; ``load_progress`` (a tqdm bar while loading; by default
only when stderr is a terminal: a log file gets the start-up phases as log lines instead, ``startup_progress``) and
``emulate_cuda_graphs`` (tests: CPU stand-in graphs audited for host syncs).
"""

from __future__ import annotations

import functools
import json
import sys
from typing import Optional

# worker-only settings, not `ft serve` flags
_WORKER_ONLY = {"load_progress": True, "emulate_cuda_graphs": False}
# spellings the flags accept besides the field name
_ALIASES = {
    "model": "model_path",
    "max_running_req": "max_running_requests",
    "max_extend_tokens": "max_prefill_length",
    "max_extend_length": "max_prefill_length",
    "attn": "attention_backend",
    "tp_size": "tensor_parallel_size",
    "graph": "cuda_graph_max_bs",
}


@functools.lru_cache(maxsize=1)
def serve_defaults() -> dict:
    """Every ``ft serve`` flag with its default (snake_case keys), from the Rust CLI."""
    from . import _core

    return json.loads(_core.serve_defaults())


def normalize_args(args: Optional[dict]) -> dict:
    """``args`` over the defaults; aliases resolved; a ``None`` value means "the default"."""
    out = {**serve_defaults(), **_WORKER_ONLY, "load_progress": sys.stderr.isatty()}
    for k, v in (args or {}).items():
        k = _ALIASES.get(k, k)
        if v is not None or k not in out:
            out[k] = v
    return out
