"""What a new user meets first (issue 14): ``ft`` alone and ``ft --version`` say something useful, ``ft serve --help``
is grouped by topic, a busy port or too little host memory fails at once in one line (before the model loads),
start-up errors are said once, ``freetoken.__version__`` exists and the demo model's CPU KV cache holds one context."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import textwrap
import time

import pytest

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _ft(*args: str, env: dict | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    pythonpath = [os.path.join(_ROOT, "python"), (env or {}).get("PYTHONPATH"), os.environ.get("PYTHONPATH")]
    full_env = {**os.environ, **(env or {}), "PYTHONPATH": os.pathsep.join(filter(None, pythonpath))}
    return subprocess.run(
        [sys.executable, "-m", "freetoken", *args], capture_output=True, text=True, timeout=timeout, env=full_env
    )


def test_ft_alone_lists_the_subcommands():
    r = _ft()
    assert r.returncode == 0, r.stderr
    assert "Usage: ft <COMMAND>" in r.stdout and "serve" in r.stdout and r.stderr == ""
    assert not r.stdout.endswith("\n\n")


def test_version_reports_build_and_environment_without_torch():
    t0 = time.monotonic()
    r = _ft("--version")
    assert r.returncode == 0, r.stderr
    lines = r.stdout.rstrip("\n").split("\n")
    assert "" not in lines and not r.stdout.endswith("\n\n"), r.stdout
    assert lines[0].startswith("ft ") and "(commit " in lines[0], lines
    for prefix in ("python 3.", "torch", "triton", "CUDA"):
        assert any(line.startswith(prefix) for line in lines), (prefix, lines)
    assert time.monotonic() - t0 < 20
    # torch is never imported to answer (it takes seconds and may be broken)
    code = "import sys; from freetoken.cli import main; main(['--version']); print('torch' in sys.modules)"
    env = {**os.environ, "PYTHONPATH": os.path.join(_ROOT, "python")}
    probe = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=60)
    assert probe.stdout.rstrip().endswith("False"), probe.stdout + probe.stderr


def test_package_version():
    import freetoken
    from freetoken import _core

    assert freetoken.__version__ == _core.__version__
    assert len(_core.GIT_COMMIT) >= 7


def test_serve_help_grouped_by_topic():
    r = _ft("serve", "--help")
    assert r.returncode == 0
    topics = ["Model and device:", "Memory and batching:", "Mixture of experts:", "Prefix cache:", "API:"]
    at = [r.stdout.index(f"\n{t}\n") for t in [*topics, "Reliability and logging:"]]
    assert at == sorted(at), at
    assert "[default: 1919]" in r.stdout and "[default: 0.9]" in r.stdout


def test_busy_port_fails_before_loading_in_one_line():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        t0 = time.monotonic()
        r = _ft("serve", "--port", str(port), timeout=60)
        elapsed = time.monotonic() - t0
    assert r.returncode == 1, r.stderr
    assert r.stderr.strip().count("\n") == 0, r.stderr
    assert r.stderr.startswith(f"error: cannot listen on 127.0.0.1:{port}: "), r.stderr
    assert elapsed < 15, elapsed  # the interpreter's start only: nothing was loaded


def test_too_little_host_memory_is_one_line(tmp_path):
    """psutil reports 100 MiB available (a sitecustomize in the server's interpreter): the demo model's 0.5 GiB
    of float32 weights are refused before they are allocated, with what they need."""
    (tmp_path / "sitecustomize.py").write_text(
        textwrap.dedent(
            """
            import psutil
            _real = psutil.virtual_memory
            psutil.virtual_memory = lambda: _real()._replace(available=100 * 2**20)
            """
        )
    )
    r = _ft("serve", "--port", "0", "--device", "cpu", env={"PYTHONPATH": str(tmp_path)})
    assert r.returncode == 1, r.stderr
    errors = [line for line in r.stderr.splitlines() if "not enough host memory" in line]
    assert len(errors) == 1 and errors[0].startswith("error: "), r.stderr
    assert "the weights (float32, on the CPU) need 0.5 GiB, 0.1 GiB are available" in errors[0], errors
    assert "Traceback" not in r.stderr and "Loaded" not in r.stderr


def test_start_up_errors_are_said_once(tmp_path):
    missing = str(tmp_path / "no-such-model")
    r = _ft("serve", "--port", "0", "--model-path", missing)
    assert r.returncode == 1, r.stderr
    assert r.stderr.count(missing) == 1 and "error: " in r.stderr, r.stderr
    assert "Traceback" not in r.stderr


@pytest.mark.slow
def test_demo_kv_cache_holds_one_context_on_cpu():
    """The demo model (8,192-token context) gets 8,192 KV tokens on the CPU, not 4 rows x 8,192."""
    from freetoken.worker import Worker

    w = Worker({"device": "cpu", "load_progress": False})
    assert w.max_context == 8192 and w.kv_capacity_tokens == 8192
