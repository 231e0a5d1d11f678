"""pipeline: an LLM serving engine whose stages are OS processes joined by shared-memory rings.

The in-process API (``LLM`` and what it returns) is loaded on first use, so a process that
only needs ``SamplingParams`` (a client) does not import the engine.
"""
from __future__ import annotations

from pipeline.sampling_params import SamplingParams
from pipeline.version import __version__

__all__ = ["LLM", "CompletionOutput", "Logprob", "RequestOutput", "SamplingParams", "__version__"]

_OUTPUT_NAMES = ("CompletionOutput", "Logprob", "RequestOutput")


def __getattr__(name: str):
    if name == "LLM":
        import pipeline.llm
        return pipeline.llm.LLM
    if name in _OUTPUT_NAMES:
        import pipeline.outputs
        return getattr(pipeline.outputs, name)
    raise AttributeError(name)
