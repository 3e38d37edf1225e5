"""The ``ft-server`` binary (issue 14): one executable taking exactly ``ft serve``'s flags (and ``--python-env``),
linking only the system C libraries and libpython, finding the Python environment (``--python-env``, else
``VIRTUAL_ENV``, else the build interpreter's), saying in one line what it lacks, and serving the demo model from
the test environment. (``tests/test_wheel.py`` runs it on an installed wheel.)"""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
from packaging_env import ask_capital_of_france, build_ft_server, clean_env
from server_harness import ServerProcess

pytestmark = pytest.mark.slow

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# what ldd may list besides libpython: the C runtime
_SYSTEM_LIBS = {"linux-vdso", "libgcc_s", "libm", "libc", "ld-linux-x86-64", "libpthread", "libdl", "librt", "libutil"}


@pytest.fixture(scope="module")
def binary() -> str:
    return build_ft_server()


def _long_flags(help_text: str) -> set[str]:
    return set(re.findall(r"^\s+(?:-\w, )?(--[a-z0-9-]+)", help_text, re.MULTILINE))


def test_takes_exactly_ft_serves_flags(binary):
    env = {**os.environ, "PYTHONPATH": os.path.join(_ROOT, "python")}
    ft = subprocess.run([sys.executable, "-m", "freetoken", "serve", "--help"], capture_output=True, text=True, env=env)
    own = subprocess.run([binary, "--help"], capture_output=True, text=True)
    assert own.returncode == 0
    assert _long_flags(own.stdout) == _long_flags(ft.stdout) | {"--python-env", "--version"}
    refused = subprocess.run([binary, "--tp-size", "2"], capture_output=True, text=True)
    assert refused.returncode == 2 and refused.stderr.count("\n") == 1, refused.stderr
    assert refused.stderr.startswith("error: --tensor-parallel-size 2 is not supported yet")


def test_links_only_system_libraries_and_libpython(binary):
    libs = [
        line.split()[0] for line in subprocess.run(["ldd", binary], capture_output=True, text=True).stdout.splitlines()
    ]
    names = {re.sub(r"\.so.*$", "", lib.rsplit("/", 1)[-1]) for lib in libs}
    assert any(n.startswith("libpython3.") for n in names), names
    assert {n for n in names if not n.startswith("libpython3.")} <= _SYSTEM_LIBS, names


def test_says_in_one_line_what_the_environment_lacks(binary, tmp_path):
    r = subprocess.run([binary, "--python-env", str(tmp_path / "nowhere")], capture_output=True, text=True)
    assert r.returncode == 1 and r.stderr.count("\n") == 1, r.stderr
    assert r.stderr.startswith("error: --python-env ") and "no such directory" in r.stderr
    # a Python of the embedded version without freetoken and torch: a bare virtual environment
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(tmp_path / "bare")], check=True)
    r = subprocess.run(
        [binary, "--python-env", str(tmp_path / "bare")], capture_output=True, text=True, env=clean_env()
    )
    assert r.returncode == 1 and r.stderr.count("\n") == 1, r.stderr
    assert "lacks freetoken and torch: pip install the freetoken wheel there" in r.stderr, r.stderr


def test_serves_the_demo_model_from_virtual_env(binary, tmp_path):
    """No --python-env: VIRTUAL_ENV names the test environment (editable freetoken, torch, the demo model)."""
    env = clean_env(VIRTUAL_ENV=sys.prefix)
    srv = ServerProcess([], command=[binary], cwd=str(tmp_path), env=env)
    try:
        assert "Paris" in ask_capital_of_france(srv.url)
        assert "Serving model SmolLM2-135M-Instruct" in srv.log()
    finally:
        assert srv.stop() == 0, srv.log()[-3000:]
