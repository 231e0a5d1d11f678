"""``LLM.chat``'s tools and reasoning: the conversation's ``tools`` for the chat template, a
forced ``tool_choice`` as each request's grammar, and the answers parsed into
``CompletionOutput.tool_calls`` / ``reasoning_content`` / ``content`` with the same parsers
the OpenAI front ends use (``chat_parse``). Owns no state.

``text`` stays the model's whole answer, as vLLM's ``LLM.chat`` returns it; the parsed fields
are set only when there is something to parse (tools, or ``reasoning_parser`` on the LLM).
"""
from __future__ import annotations

from typing import Any

import msgspec

from pipeline.chat_parse import ChatParsers, ChatParsing
from pipeline.config import ModelConfig
from pipeline.outputs import RequestOutput
from pipeline.sampling_params import SamplingParams
from pipeline.sampling_params.structured import StructuredOutputsParams
from pipeline.tokenizer.tokenizer import check_tools


def chat_parsing(model: ModelConfig, tools: list[dict[str, Any]] | None,
                 tool_choice: str | dict[str, Any] | None,
                 parallel_tool_calls: bool | None) -> ChatParsing | None:
    """How a chat's answers are parsed (None: not at all); ValueError naming the argument."""
    if tools is not None:
        check_tools(tools)
    if tools is None and tool_choice is None and model.reasoning_parser is None:
        return None
    server = ChatParsers.of(model)
    if tool_choice is None and tools and not (server.enable_auto_tool_choice and server.tool_call_parser):
        tool_choice = "none"  # vLLM's LLM.chat: tools rendered, the answer left as text
    return ChatParsing(tools, tool_choice, parallel_tool_calls, server)


def forced(params: list[SamplingParams], parsing: ChatParsing | None) -> list[SamplingParams]:
    """Each request's SamplingParams with the grammar a forced tool_choice implies."""
    if parsing is not None and parsing.mode == "auto":
        # The call markers of some formats are special tokens: the parser must see them.
        params = [msgspec.structs.replace(sp, skip_special_tokens=False) for sp in params]
    if parsing is None or parsing.structured is None:
        return params
    out = []
    for sp in params:
        if sp.structured_outputs is not None:
            raise ValueError(f"tool_choice {parsing.mode!r} forces the answer's shape; it cannot be "
                             "combined with SamplingParams.structured_outputs")
        out.append(msgspec.structs.replace(sp, structured_outputs=StructuredOutputsParams(**parsing.structured)))
    return out


def parse_answers(outs: list[RequestOutput], parsing: ChatParsing | None) -> list[RequestOutput]:
    if parsing is None or not parsing.active:
        return outs
    for out in outs:
        for c in out.outputs:
            parser = parsing.answer()
            message = parser.message(c.text)
            c.content, c.tool_calls = message["content"], message.get("tool_calls")
            c.reasoning_content = message.get("reasoning_content")
            if c.finish_reason is not None:
                c.finish_reason = parser.finish_reason(c.finish_reason)
    return outs
