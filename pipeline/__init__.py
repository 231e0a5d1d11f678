"""pipeline: an LLM serving engine whose stages are OS processes joined by shared-memory rings."""
from __future__ import annotations

from pipeline.sampling_params import SamplingParams

__all__ = ["LLM", "SamplingParams"]
__version__ = "0.1.0"


def __getattr__(name: str):
    if name == "LLM":
        from pipeline.llm import LLM
        return LLM
    raise AttributeError(name)
