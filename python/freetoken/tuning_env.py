"""Kernel-dispatch cuts and policies that an A/B benchmark run moves through the environment (``FREETOKEN_NVFP4_*``,
``FREETOKEN_MOE_CACHE_POLICY``, the graphs' on/off switches), read at start-up (the switches again at every step).
The one place that parses them, so a bad value is refused the same way everywhere; also the one check of a
launcher's ``tune`` overrides (benchmark sweeps, tests)."""

from __future__ import annotations

import os
from typing import Mapping, Optional


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


def choice_from_env(name: str, default: str, choices: tuple) -> str:
    """``$name`` if it is one of ``choices``, ``default`` when unset; anything else is refused in one line."""
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    if raw not in choices:
        raise ValueError(f"{name}={raw!r}: expected one of {', '.join(choices)}")
    return raw


def switch_from_env(name: str, env: Optional[Mapping[str, str]] = None) -> bool:
    """An on/off switch that is on unless ``$name`` is ``0`` (A/B runs switch an optimization off, some read at every
    step); ``1``, empty or unset is on, anything else is refused in one line (a typo must not silently keep it on).
    ``env``: where to read it (tests), ``os.environ`` by default."""
    raw = (os.environ if env is None else env).get(name, "").strip() or "1"
    if raw not in ("0", "1"):
        raise ValueError(f"{name}={raw!r}: expected 1 (on, the default) or 0 (off)")
    return raw == "1"


def with_overrides(defaults: dict, tune: Optional[dict], what: str) -> dict:
    """``defaults`` with ``tune``'s settings over them (a launcher's ``tune=``); a setting it does not have is
    refused, naming the known ones."""
    unknown = set(tune or {}) - set(defaults)
    if unknown:
        raise ValueError(f"unknown {what} launch settings {sorted(unknown)}; known: {sorted(defaults)}")
    return {**defaults, **(tune or {})}
