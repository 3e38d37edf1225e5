"""Start a real ``ft serve`` process for end-to-end tests and tear it down.

The server runs as ``python -m freetoken serve`` from the test's interpreter (so the installed extension and
package are the ones under test), on a free loopback port, with its log captured to a file the test can read.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time

import requests

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """``command`` (default ``python -m freetoken serve`` with this checkout's ``python/`` on ``PYTHONPATH``) runs
    with ``args``; a command of another installation (an installed wheel's ``ft``, the ``ft-server`` binary) runs
    with the environment as given, from ``cwd``."""

    def __init__(
        self,
        args: list[str],
        env: dict | None = None,
        ready_timeout: float = 240.0,
        command: list[str] | None = None,
        cwd: str | None = None,
    ):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_file = tempfile.NamedTemporaryFile("w+", prefix="ft-serve-", suffix=".log", delete=False)
        full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        if command is None:
            command = [sys.executable, "-m", "freetoken", "serve"]
            full_env["PYTHONPATH"] = os.pathsep.join(
                filter(None, [os.path.join(_ROOT, "python"), full_env.get("PYTHONPATH")])
            )
        cmd = [*command, "--host", "127.0.0.1", "--port", str(self.port), *args]
        self.proc = subprocess.Popen(cmd, stdout=self.log_file, stderr=subprocess.STDOUT, env=full_env, cwd=cwd)
        self._wait_ready(ready_timeout)

    def log(self) -> str:
        with open(self.log_file.name, encoding="utf-8", errors="replace") as f:
            return f.read()

    def request_path_events(self) -> list[str]:
        """The log's warnings of served steps that compiled Triton kernels (``engine/kernel_compiles.py``: what the
        warm-up missed) or grew or flushed the CUDA caching allocator (``engine/allocator_events.py``), each from
        its "Step " on: the one-off stalls a benchmark's figures may hide."""
        marks = ("Triton kernel(s) on the", "new CUDA segment", "caching allocator freed")
        lines = self.log().splitlines()
        return [ln[ln.find("Step ") :] for ln in lines if "Step " in ln and any(m in ln for m in marks)]

    def _wait_ready(self, timeout: float) -> None:
        deadline = time.time() + timeout
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"ft serve exited with {self.proc.returncode} during start-up:\n{self.log()[-4000:]}"
                )
            if "API server is ready to serve" in self.log():
                return
            time.sleep(0.25)
        self.stop()
        raise RuntimeError(f"ft serve not ready after {timeout} s:\n{self.log()[-4000:]}")

    def get(self, path: str, **kw) -> requests.Response:
        return requests.get(self.url + path, timeout=kw.pop("timeout", 30), **kw)

    def post(self, path: str, json=None, **kw) -> requests.Response:
        return requests.post(self.url + path, json=json, timeout=kw.pop("timeout", 120), **kw)

    def wait_idle(self, timeout: float = 30.0) -> dict:
        """Polls /v1/stats until nothing runs or waits; returns the last stats."""
        deadline = time.time() + timeout
        stats = {}
        while time.time() < deadline:
            stats = self.get("/v1/stats").json()
            if stats.get("running_requests") == 0 and stats.get("queued_requests") == 0:
                return stats
            time.sleep(0.1)
        raise AssertionError(f"server not idle after {timeout} s: {stats}")

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode
