"""Python run from the checkout's root (``python -m pytest``, ``python -m freetoken``, ``python -c``) has the root
first on ``sys.path``: nothing there may shadow an installed package. transformers (>= 5.25) imports the Hugging
Face ``kernels`` package, and our ``kernels/`` (a namespace package, no ``__init__.py``; ``kernels/README.md``)
must give way to it, while ``freetoken.kernels`` still imports."""

from __future__ import annotations

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_an_installed_kernels_package_wins_over_the_checkouts(tmp_path):
    site = tmp_path / "site"
    (site / "kernels").mkdir(parents=True)
    (site / "kernels" / "__init__.py").write_text("WHO = 'installed'\n")
    code = "import kernels, freetoken.kernels.attention_cudnn as a; print(kernels.WHO, a.CHOICES[0])"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), os.path.join(ROOT, "python")])}
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.split() == ["installed", "triton"], r.stdout + r.stderr


def test_the_checkouts_top_level_directories_are_not_regular_packages():
    """A top-level directory with an ``__init__.py`` would shadow any installed package of its name."""
    packages = [d for d in os.listdir(ROOT) if os.path.isfile(os.path.join(ROOT, d, "__init__.py"))]
    assert packages == [], packages
