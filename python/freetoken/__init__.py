"""FreeToken: serve huge Mixture-of-Experts language models on a GPU too small to hold them.

``ft serve`` runs the OpenAI-compatible server; ``freetoken.LLM`` runs the same engine offline.
"""

from .llm import LLM, SamplingParams


def _version() -> str:
    """The installed distribution's version; from a source tree on ``PYTHONPATH``, the extension's (the same
    number: both come from the workspace's Cargo.toml)."""
    import importlib.metadata

    try:
        return importlib.metadata.version("freetoken")
    except importlib.metadata.PackageNotFoundError:
        from ._core import __version__ as core_version

        return core_version


__version__ = _version()

__all__ = ["LLM", "SamplingParams", "__version__"]
