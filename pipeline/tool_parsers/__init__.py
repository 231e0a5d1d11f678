"""Tool-call parsers: the model's output text -> OpenAI tool calls and content, whole or
streamed (``base.py`` has the interface and the rules they share).

A leaf package: it imports nothing of ours, so the HTTP front end, pipe mode and ``LLM.chat``
can all use it. ``TOOL_PARSERS`` are the ``--tool-call-parser`` choices; ``RequiredParser``
and ``NamedParser`` (``choice.py``) read the grammar-forced answers of ``tool_choice``
``required`` and a named function.

Owns / State: the registry of parser names (constant).
"""
from __future__ import annotations

from pipeline.tool_parsers.base import (
    ExtractedToolCalls,
    StreamDelta,
    ToolCall,
    ToolCallDelta,
    ToolParser,
)
from pipeline.tool_parsers.choice import NamedParser, RequiredParser, named_schema, required_schema
from pipeline.tool_parsers.hermes import HermesToolParser
from pipeline.tool_parsers.llama3_json import Llama3JsonToolParser
from pipeline.tool_parsers.mistral import MistralToolParser
from pipeline.tool_parsers.pythonic import PythonicToolParser

__all__ = [
    "TOOL_PARSERS", "ExtractedToolCalls", "NamedParser", "RequiredParser", "StreamDelta", "ToolCall",
    "ToolCallDelta", "ToolParser", "get_tool_parser", "named_schema", "required_schema",
]

TOOL_PARSERS: dict[str, type[ToolParser]] = {
    p.name: p for p in (HermesToolParser, Llama3JsonToolParser, MistralToolParser, PythonicToolParser)
}


def get_tool_parser(name: str) -> type[ToolParser]:
    try:
        return TOOL_PARSERS[name]
    except KeyError:
        raise ValueError(f"unknown tool call parser {name!r}; known: {', '.join(sorted(TOOL_PARSERS))}") from None
