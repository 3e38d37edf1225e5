"""Runs a Triton test script on the CPU under ``TRITON_INTERPRET=1``, in a fresh interpreter: the variable is read
when triton is first imported, so it cannot be switched on inside the pytest process that already imported it."""

from __future__ import annotations

import functools
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# A loop over a runtime bound: triton 3.6's interpreter holds scalar arguments as 1-element numpy arrays and turns
# them into Python ints with int(), which numpy 2.x refuses ("only 0-dimensional arrays can be converted"); later
# triton releases convert them themselves. The compiled kernels are unaffected (the GPU machine's stack, 2026-12-07).
_PROBE = """
import numpy, torch, triton, triton.language as tl
print(f"triton {triton.__version__}'s interpreter with numpy {numpy.__version__}", flush=True)

@triton.jit
def count(out_ptr, n):
    total = 0
    for _ in range(0, n):
        total += 1
    tl.store(out_ptr, total)

out = torch.zeros(1, dtype=torch.int32)
count[(1,)](out, 3)
assert int(out) == 3, int(out)
print("OK")
"""
_KNOWN_BUG = "only 0-dimensional arrays can be converted"


def _env() -> dict:
    return dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=os.path.join(ROOT, "python"))


@functools.lru_cache(maxsize=None)
def interpreter_bug() -> str | None:
    """Why this stack's Triton interpreter cannot run our kernels' runtime loops (the known triton 3.6 / numpy 2
    failure), or None when it can (the probe passes, or fails some other way: the tests then say how)."""
    r = subprocess.run([sys.executable, "-c", _PROBE], env=_env(), capture_output=True, text=True, timeout=300)
    if r.returncode != 0 and _KNOWN_BUG in r.stderr:
        return f"{r.stdout.strip()}: {_KNOWN_BUG} (a runtime loop bound; the compiled kernels are unaffected)"
    return None


def run_under_interpreter(script: str, timeout: int = 600, **fields) -> str:
    """Formats ``script`` with ``tests`` (this directory, for its imports) and ``fields``, runs it and checks that
    it exits 0 printing OK; returns (and prints) its stdout. Skipped, saying why, on a Triton whose interpreter
    cannot run a loop over a runtime bound (``interpreter_bug``)."""
    bug = interpreter_bug()
    if bug:
        pytest.skip(bug)
    code = script.format(tests=os.path.join(ROOT, "tests"), **fields)
    r = subprocess.run([sys.executable, "-c", code], env=_env(), capture_output=True, text=True, timeout=timeout)
    print(r.stdout)
    assert r.returncode == 0 and "OK" in r.stdout, r.stdout[-4000:] + r.stderr[-4000:]
    return r.stdout
