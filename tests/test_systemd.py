"""FreeToken under systemd (issue 14). The test plays systemd's side of ``Type=notify``: a datagram socket named by
``NOTIFY_SOCKET`` (and ``WATCHDOG_USEC``) collects what the server says. ``ft serve`` and ``ft-server`` both say
STATUS= at start-up phases, READY=1 once the API answers, WATCHDOG=1 while steps progress, STOPPING=1 when SIGTERM
starts the drain; after an injected stall (``FREETOKEN_FAULT=hang@N``) the pings stop and the process exits 1.
``packaging/systemd/freetoken.service`` passes ``systemd-analyze verify`` where the tool exists."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest
import requests
from bounded_clients import chat_body, post_json
from packaging_env import ask_capital_of_france, build_ft_server
from server_harness import ServerProcess

pytestmark = pytest.mark.slow

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_UNIT = os.path.join(_ROOT, "packaging", "systemd", "freetoken.service")
_ENV_FILE = os.path.join(_ROOT, "packaging", "systemd", "freetoken.env")
_SERVER_ARGS = ["--device", "cpu", "--num-tokens", "2048", "--max-seq-len-override", "2048"]


class NotifySocket:
    """systemd's end: every datagram received, with the time it arrived."""

    def __init__(self, path: str):
        self.path = path
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(path)
        self.sock.settimeout(0.2)
        self.received: list[tuple[float, str]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._collect, daemon=True)
        self._thread.start()

    def _collect(self) -> None:
        while not self._stop.is_set():
            try:
                data = self.sock.recv(4096)
            except TimeoutError:
                continue
            self.received.append((time.monotonic(), data.decode()))

    def env(self, watchdog_s: float) -> dict:
        return {"NOTIFY_SOCKET": self.path, "WATCHDOG_USEC": str(int(watchdog_s * 1e6))}

    def times(self, assignment: str) -> list[float]:
        """When each message holding ``assignment`` (a whole line, e.g. ``READY=1``) arrived."""
        return [t for t, m in list(self.received) if assignment in m.split("\n")]

    def statuses(self) -> list[str]:
        return [line[7:] for _, m in list(self.received) for line in m.split("\n") if line.startswith("STATUS=")]

    def wait_for(self, assignment: str, timeout: float) -> float:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if seen := self.times(assignment):
                return seen[0]
            time.sleep(0.02)
        raise AssertionError(f"no {assignment} within {timeout} s; got {self.received}")

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        self.sock.close()


@pytest.fixture
def notify(tmp_path):
    sock = NotifySocket(str(tmp_path / "notify.sock"))
    yield sock
    sock.close()


def _ready_pings_and_stopping(srv: ServerProcess, notify: NotifySocket) -> None:
    """READY once /health answers, pings every WATCHDOG_USEC / 4, STOPPING at SIGTERM, then exit 0."""
    ready = notify.wait_for("READY=1", timeout=30)
    assert requests.get(srv.url + "/health", timeout=10).status_code == 200
    statuses = notify.statuses()
    assert any(s.startswith("Loading the model") for s in statuses), statuses
    assert any(s.startswith("Loading weights") for s in statuses), statuses
    assert any(s.startswith("Serving SmolLM2-135M-Instruct on 127.0.0.1:") for s in statuses), statuses
    time.sleep(2.5)
    assert len([t for t in notify.times("WATCHDOG=1") if t > ready]) >= 3, notify.received
    assert not notify.times("STOPPING=1")
    srv.proc.send_signal(signal.SIGTERM)
    notify.wait_for("STOPPING=1", timeout=10)
    assert srv.proc.wait(60) == 0, srv.log()[-3000:]


def test_ft_serve_speaks_notify(notify, tmp_path):
    env = {**notify.env(watchdog_s=2.0), "FREETOKEN_API_KEY": "k-123"}
    srv = ServerProcess(_SERVER_ARGS, env=env)
    try:
        # the key comes from the environment (as the unit's environment file sets it), not the command line
        assert requests.get(srv.url + "/v1/models", timeout=10).status_code == 401
        r = requests.get(srv.url + "/v1/models", headers={"Authorization": "Bearer k-123"}, timeout=10)
        assert r.status_code == 200
        _ready_pings_and_stopping(srv, notify)
    finally:
        srv.stop(signal.SIGKILL)


def test_ft_server_binary_speaks_notify(notify, tmp_path):
    binary = build_ft_server()
    env = {**notify.env(watchdog_s=2.0), "VIRTUAL_ENV": sys.prefix}
    srv = ServerProcess(_SERVER_ARGS, env=env, command=[binary], cwd=str(tmp_path))
    try:
        assert "Paris" in ask_capital_of_france(srv.url)
        _ready_pings_and_stopping(srv, notify)
    finally:
        srv.stop(signal.SIGKILL)


def test_watchdog_pings_stop_after_a_stall(notify):
    """The first request's decode hangs (hang@2): pings go on until --step-timeout, then stop for good, and the
    process exits 1 by itself (systemd would restart it; were it stuck, the missing pings would)."""
    env = {**notify.env(watchdog_s=1.0), "FREETOKEN_FAULT": "hang@2"}
    srv = ServerProcess([*_SERVER_ARGS, "--step-timeout", "3"], env=env)
    try:
        notify.wait_for("READY=1", timeout=30)
        asked = time.monotonic()
        answer = post_json(srv.url, chat_body("Hello", max_tokens=8), deadline=60)
        answered = time.monotonic()
        assert answer.status == 503 and "engine stalled" in answer.message, answer
        assert srv.proc.wait(60) == 1, srv.log()[-3000:]
        pings = notify.times("WATCHDOG=1")
        assert any(asked < t for t in pings), "pings go on while the step is within --step-timeout"
        late = [round(t - answered, 2) for t in pings if t > answered + 0.5]
        assert not late, f"pings after the stall was declared: {late}"
        assert any("stalled" in s for s in notify.statuses()), notify.statuses()
    finally:
        srv.stop(signal.SIGKILL)


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze is not installed")
def test_unit_verifies(tmp_path):
    """The unit as shipped, with ExecStart and EnvironmentFile pointed at files that exist here (verify checks
    that the command is executable)."""
    with open(_UNIT) as f:
        unit = f.read()
    assert "Type=notify" in unit and "WatchdogSec=" in unit and "Restart=on-failure" in unit
    ft = os.path.join(sys.prefix, "bin", "ft")
    unit = unit.replace("/opt/freetoken/venv/bin/ft", ft).replace("/etc/freetoken/freetoken.env", _ENV_FILE)
    path = tmp_path / "freetoken.service"
    path.write_text(unit)
    r = subprocess.run(["systemd-analyze", "verify", str(path)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and r.stderr.strip() == "", r.stderr
