"""FreeToken built the ways it ships, installed apart from this checkout, for the packaging tests:

- the wheel, ``maturin build --release`` as a release builds it, installed with ``--no-deps`` into a fresh virtual
  environment. torch is not downloaded again: a ``.pth`` file in the fresh environment puts the test environment's
  site-packages after its own (torch, triton, the demo model: what ``pip install freetoken`` brings), so the wheel's
  ``freetoken`` comes first and this checkout's ``python/`` is nowhere on the path;
- the ``ft-server`` binary, ``cargo build --release -p ft-server`` (PyO3 embeds the test environment's Python).
"""

from __future__ import annotations

import glob
import os
import subprocess
import sys
import sysconfig

import requests

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run(cmd: list[str], timeout: float = 1200, **kw) -> subprocess.CompletedProcess:
    """Runs ``cmd``; on failure raises with the tail of its output."""
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, **kw)
    if r.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} exited with {r.returncode}:\n{(r.stdout + r.stderr)[-4000:]}")
    return r


def build_wheel(out_dir: str) -> str:
    """``maturin build --release`` of this checkout into ``out_dir``; returns the wheel's path."""
    run([sys.executable, "-m", "maturin", "build", "--release", "--out", out_dir], cwd=ROOT)
    (wheel,) = glob.glob(os.path.join(out_dir, "freetoken-*.whl"))
    return wheel


def venv_with_wheel(venv_dir: str, wheel: str) -> str:
    """A fresh virtual environment holding ``wheel`` (``--no-deps``) that sees the test environment's packages
    after its own; returns its root."""
    run([sys.executable, "-m", "venv", venv_dir])
    python = os.path.join(venv_dir, "bin", "python")
    site_packages = run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"]).stdout.strip()
    with open(os.path.join(site_packages, "_test_environment.pth"), "w") as f:
        f.write(sysconfig.get_paths()["purelib"] + "\n")
    run([python, "-m", "pip", "install", "--quiet", "--no-deps", "--no-index", wheel])
    return venv_dir


def build_ft_server() -> str:
    """``cargo build --release -p ft-server``; returns the binary's path."""
    run(["cargo", "build", "--release", "-p", "ft-server"], cwd=ROOT)
    return os.path.join(ROOT, "target", "release", "ft-server")


def clean_env(**extra: str) -> dict:
    """The environment without this checkout on ``PYTHONPATH`` and without an active virtual environment."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME")}
    return {**env, **extra}


def ask_capital_of_france(url: str) -> str:
    """The demo model's answer to "What is the capital of France?" (greedy)."""
    body = {
        "model": "demo",
        "messages": [{"role": "user", "content": "What is the capital of France?"}],
        "max_tokens": 16,
        "temperature": 0,
    }
    r = requests.post(f"{url}/v1/chat/completions", json=body, timeout=120)
    r.raise_for_status()
    return r.json()["choices"][0]["message"]["content"]
