"""The Python side of ``ft --version``: the interpreter, torch (and the CUDA it was built for), triton and the CUDA
driver this environment would serve with. Read from package metadata, ``torch/version.py`` as text and the driver
library, so ``ft --version`` answers at once and works where torch is broken or absent."""

from __future__ import annotations

import ctypes
import importlib.metadata
import importlib.util
import os
import platform
import re
import sys
from typing import Optional


def describe(with_package: bool = False) -> str:
    """One line each: [freetoken,] python, torch, triton, CUDA."""
    lines = [package_line()] if with_package else []
    lines.append(f"python {platform.python_version()} ({sys.executable or 'embedded'})")
    lines.append(torch_line())
    triton = _dist_version("triton")
    lines.append(f"triton {triton}" if triton else "triton: not installed")
    lines.append(cuda_line())
    return "\n".join(lines)


def package_line() -> str:
    from . import __version__, _core

    commit = getattr(_core, "GIT_COMMIT", "unknown")
    return f"freetoken {__version__} (commit {commit}) at {os.path.dirname(os.path.abspath(__file__))}"


def torch_line() -> str:
    version = _dist_version("torch")
    if version is None:
        return "torch: not installed"
    cuda = torch_cuda_build()
    return f"torch {version} ({f'CUDA {cuda} build' if cuda else 'CPU-only build'})"


def torch_cuda_build() -> Optional[str]:
    """The CUDA version torch was built for, from ``torch/version.py`` read as text (``None``: a CPU build)."""
    spec = importlib.util.find_spec("torch")  # finds the package without running it
    if spec is None or spec.origin is None:
        return None
    try:
        with open(os.path.join(os.path.dirname(spec.origin), "version.py"), encoding="utf-8") as f:
            text = f.read()
    except OSError:
        return None
    m = re.search(r"^cuda\s*(?::[^=]*)?=\s*['\"]([^'\"]+)['\"]", text, re.MULTILINE)
    return m.group(1) if m else None


def cuda_line() -> str:
    """The CUDA driver and its devices, asked of ``libcuda`` directly (what torch will find)."""
    try:
        cuda = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return "CUDA: no driver found (ft serve runs on the CPU)"
    if cuda.cuInit(0) != 0:
        return "CUDA: driver found, but no usable device (cuInit failed; ft serve runs on the CPU)"
    version, count = ctypes.c_int(0), ctypes.c_int(0)
    cuda.cuDriverGetVersion(ctypes.byref(version))
    cuda.cuDeviceGetCount(ctypes.byref(count))
    v = version.value
    return f"CUDA: driver {v // 1000}.{v % 1000 // 10}, {count.value} device(s)"


def _dist_version(name: str) -> Optional[str]:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None
