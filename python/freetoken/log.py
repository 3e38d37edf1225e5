"""Python-side logging in FreeToken's line format, so worker lines interleave cleanly with the Rust side's:

    [2025-01-31|12:00:00|pid=1234|core|rank=0] INFO     Allocating 131072 tokens for KV cache, K + V = 1.50 GiB

Everything goes to stderr. ``get_logger(__name__)`` is all a module needs.
"""

from __future__ import annotations

import logging
import os
import sys

_CONFIGURED = False


class _FreeTokenFormatter(logging.Formatter):
    def __init__(self, component: str = "core", rank: int = 0):
        super().__init__()
        self.component = component
        self.rank = rank

    def format(self, record: logging.LogRecord) -> str:
        stamp = self.formatTime(record, "%Y-%m-%d|%H:%M:%S")
        line = f"[{stamp}|pid={record.process}|{self.component}|rank={self.rank}] {record.levelname:<8} {record.getMessage()}"
        if record.exc_info:
            line += "\n" + self.formatException(record.exc_info)
        return line


def setup_logging(level: str | int | None = None, component: str = "core", rank: int = 0) -> None:
    """Install the FreeToken handler on the ``freetoken`` logger (idempotent). Level from the argument, else
    ``FREETOKEN_LOG_LEVEL``, else INFO."""
    global _CONFIGURED
    root = logging.getLogger("freetoken")
    if level is None:
        level = os.environ.get("FREETOKEN_LOG_LEVEL", "INFO")
    root.setLevel(level.upper() if isinstance(level, str) else level)
    if _CONFIGURED:
        return
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(_FreeTokenFormatter(component, rank))
    root.addHandler(handler)
    root.propagate = False
    _CONFIGURED = True


def get_logger(name: str) -> logging.Logger:
    setup_logging()
    if not name.startswith("freetoken"):
        name = "freetoken." + name
    return logging.getLogger(name)
