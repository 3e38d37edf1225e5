"""Run first in ft-server's embedded interpreter: make ``root`` (a virtual environment or a Python prefix) the
environment imports come from, as its own ``bin/python`` would, and check that it holds freetoken and torch.
Failures are one-line ``RuntimeError``s that ft-server prints as ``error: ...``."""

import importlib.util
import os
import site
import sys


def activate(root, source):
    sys.argv = ["ft-server"]  # libraries read sys.argv[0]; an embedded interpreter has none
    if root is not None:
        _use_environment(root, source)
    missing = [name for name in ("freetoken", "torch") if importlib.util.find_spec(name) is None]
    if missing:
        raise RuntimeError(
            f"the Python environment {root or sys.prefix} (from {source}) lacks {' and '.join(missing)}: "
            "pip install the freetoken wheel there (torch comes with it), or name another with --python-env DIR"
        )


def _use_environment(root, source):
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    site_packages = os.path.join(root, "lib", f"python{version}", "site-packages")
    if not os.path.isdir(site_packages):
        lib = os.path.join(root, "lib")
        found = sorted(n for n in os.listdir(lib) if n.startswith("python3")) if os.path.isdir(lib) else []
        has = f"it has {', '.join(found)}" if found else "it has no lib/python3.*"
        raise RuntimeError(
            f"{root} (from {source}) is not a Python {version} environment ({has}); ft-server embeds Python "
            f"{version}: make the environment with python{version}, or build ft-server with its interpreter "
            "(PYO3_PYTHON=ENV/bin/python cargo build --release -p ft-server)"
        )
    base = set(site.getsitepackages()) | {site.getusersitepackages()}
    rest = [p for p in sys.path if p not in base]
    before = set(sys.path)
    site.addsitedir(site_packages)  # runs its .pth files (an editable install is one)
    added = [p for p in sys.path if p not in before]
    # Like the environment's own python: the standard library, the environment, and the base installation's
    # site-packages only when pyvenv.cfg lets them in.
    shared = [p for p in sys.path if p in base] if _includes_system_site_packages(root) else []
    sys.path[:] = rest + added + shared
    sys.prefix = sys.exec_prefix = root
    python = os.path.join(root, "bin", "python")
    if os.path.exists(python):
        sys.executable = python  # what multiprocessing and subprocesses start (never ft-server itself)


def _includes_system_site_packages(root):
    try:
        with open(os.path.join(root, "pyvenv.cfg"), encoding="utf-8") as f:
            lines = [line.partition("=") for line in f]
    except OSError:
        return False  # a plain prefix: its own site-packages only
    settings = {k.strip(): v.strip().lower() for k, _, v in lines}
    return settings.get("include-system-site-packages") == "true"
