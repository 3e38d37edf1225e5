"""Runs a Triton test script on the CPU under ``TRITON_INTERPRET=1``, in a fresh interpreter: the variable is read
when triton is first imported, so it cannot be switched on inside the pytest process that already imported it."""

from __future__ import annotations

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_under_interpreter(script: str, timeout: int = 600, **fields) -> str:
    """Formats ``script`` with ``tests`` (this directory, for its imports) and ``fields``, runs it and checks that
    it exits 0 printing OK; returns (and prints) its stdout."""
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=os.path.join(ROOT, "python"))
    code = script.format(tests=os.path.join(ROOT, "tests"), **fields)
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=timeout)
    print(r.stdout)
    assert r.returncode == 0 and "OK" in r.stdout, r.stdout[-4000:] + r.stderr[-4000:]
    return r.stdout
