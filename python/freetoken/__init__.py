"""FreeToken: serve huge Mixture-of-Experts language models on a GPU too small to hold them.

``ft serve`` runs the OpenAI-compatible server; ``freetoken.LLM`` runs the same engine offline.
"""

from .llm import LLM, SamplingParams

__all__ = ["LLM", "SamplingParams"]
