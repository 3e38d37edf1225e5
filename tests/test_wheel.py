"""The wheel end to end (issue 14): ``maturin build --release`` gives an abi3 wheel holding the extension, the
package and the Triton kernels; installed into a fresh virtual environment (``packaging_env``: the test
environment's torch seen through a ``.pth``, the wheel with ``--no-deps``), its ``ft serve`` and the ``ft-server``
binary pointed at it answer "Paris" on the demo model."""

from __future__ import annotations

import os
import subprocess
import tempfile
import zipfile

import pytest
from packaging_env import ask_capital_of_france, build_ft_server, build_wheel, clean_env, venv_with_wheel
from server_harness import ServerProcess

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def workdir():
    # not tmp_path_factory: another pytest session starting meanwhile may prune this one's numbered directories
    with tempfile.TemporaryDirectory(prefix="ft-packaging-") as d:
        yield d


@pytest.fixture(scope="module")
def wheel(workdir) -> str:
    return build_wheel(os.path.join(workdir, "dist"))


@pytest.fixture(scope="module")
def venv(wheel, workdir) -> str:
    return venv_with_wheel(os.path.join(workdir, "venv"), wheel)


def test_wheel_holds_extension_package_and_kernels(wheel):
    assert os.path.basename(wheel).startswith("freetoken-") and "-cp310-abi3-" in wheel, wheel
    names = set(zipfile.ZipFile(wheel).namelist())
    for needed in ("freetoken/_core.abi3.so", "freetoken/worker.py", "freetoken/kernels/attention.py"):
        assert needed in names, sorted(names)
    kernels = {n for n in names if n.startswith("freetoken/kernels/")}
    here = os.path.join(os.path.dirname(os.path.dirname(__file__)), "kernels")
    assert kernels == {f"freetoken/kernels/{f}" for f in os.listdir(here) if f.endswith(".py")}


def test_installed_wheel_is_the_one_imported(venv, workdir):
    python = os.path.join(venv, "bin", "python")
    code = "import freetoken, freetoken.kernels; print(freetoken.__file__); print(freetoken.__version__)"
    r = subprocess.run([python, "-c", code], capture_output=True, text=True, cwd=workdir, env=clean_env())
    assert r.returncode == 0, r.stderr
    path, version = r.stdout.split()
    assert path.startswith(os.path.realpath(venv)) or path.startswith(venv), path
    version_line = subprocess.run(
        [os.path.join(venv, "bin", "ft"), "--version"], capture_output=True, text=True, env=clean_env()
    ).stdout
    assert version_line.startswith(f"ft {version} (commit ") and "(commit unknown)" not in version_line


def test_ft_serve_from_the_wheel_answers(venv, workdir):
    srv = ServerProcess([], command=[os.path.join(venv, "bin", "ft"), "serve"], cwd=workdir, env=clean_env())
    try:
        assert "Paris" in ask_capital_of_france(srv.url)
    finally:
        assert srv.stop() == 0, srv.log()[-3000:]


def test_ft_server_binary_on_the_wheel_answers(venv, workdir):
    binary = build_ft_server()
    srv = ServerProcess([], command=[binary, "--python-env", venv], cwd=workdir, env=clean_env())
    try:
        assert "Paris" in ask_capital_of_france(srv.url)
    finally:
        assert srv.stop() == 0, srv.log()[-3000:]
