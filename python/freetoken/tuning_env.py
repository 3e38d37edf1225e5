"""Kernel-dispatch cuts that an A/B benchmark run moves through the environment (``FREETOKEN_NVFP4_*``), read once
at import, i.e. at start-up. The one place that parses them, so a bad value is refused the same way everywhere."""

from __future__ import annotations

import os


def int_from_env(name: str, default: int, unit: str = "pairs") -> int:
    """``$name`` as an int, ``default`` when unset; a value that is not a number is refused in one line naming the
    variable (the server's start-up error)."""
    raw = os.environ.get(name)
    if raw is None:
        return default
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"{name}={raw!r}: expected a number of {unit}") from None
