"""Chat answers as OpenAI messages: the reasoning part (``--reasoning-parser``), tool calls
(``tool_choice``: ``auto`` with ``--enable-auto-tool-choice --tool-call-parser NAME``,
``required`` and a named function enforced by a grammar) and the content, for the HTTP
front end, pipe mode's OpenAI batch lines and ``LLM.chat``. Owns no state but each answer's
parsers (``AnswerParser``: one per choice, fed the choice's text as it streams).

The reasoning parser sees the text first; the tool parser sees only what follows the
reasoning (its content part). A body's ``tool_choice`` is resolved once (``ChatParsing``):
``required`` and a named function become the request's ``structured_outputs`` (a JSON schema
of the calls, or of the function's arguments), so even a model never trained on tools
answers with a valid call.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pipeline.reasoning import ReasoningParser, get_reasoning_parser
from pipeline.reasoning.base import THINK_CLOSE
from pipeline.tool_parsers import (
    NamedParser,
    RequiredParser,
    StreamDelta,
    ToolCall,
    ToolParser,
    get_tool_parser,
    named_schema,
    required_schema,
)


class ChatParseError(ValueError):
    """A body's tools / tool_choice the server cannot honour (400, naming the field)."""

    def __init__(self, message: str, field: str) -> None:
        super().__init__(message)
        self.field = field


# ModelConfig's fields (the flags) that pick the parsers; the HTTP front end's spec carries them.
CHAT_PARSER_FIELDS = ("tool_call_parser", "enable_auto_tool_choice", "reasoning_parser")


@dataclass(frozen=True)
class ChatParsers:
    """The server's choice (vLLM's flags): which formats its model answers in."""
    tool_call_parser: str | None = None
    enable_auto_tool_choice: bool = False
    reasoning_parser: str | None = None

    @classmethod
    def of(cls, model_config: Any) -> ChatParsers:
        """A ModelConfig's (or anything with the same fields)."""
        return cls(**{k: getattr(model_config, k) for k in CHAT_PARSER_FIELDS})


def tool_calls_json(calls: list[ToolCall]) -> list[dict[str, Any]]:
    return [{"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
            for c in calls]


def _delta_json(d: StreamDelta) -> list[dict[str, Any]]:
    out = []
    for t in d.tool_calls:
        item: dict[str, Any] = {"index": t.index}
        fn: dict[str, Any] = {"arguments": t.arguments}
        if t.id is not None:
            item |= {"id": t.id, "type": "function"}
            fn = {"name": t.name, "arguments": t.arguments}
        out.append(item | {"function": fn})
    return out


class ChatParsing:
    """One chat body's parsing: its tool mode (none, auto, required, named), the grammar that
    mode forces (``structured``) and a factory of per-choice parsers."""

    def __init__(self, tools: list[dict[str, Any]] | None, tool_choice: str | dict[str, Any] | None,
                 parallel_tool_calls: bool | None, server: ChatParsers) -> None:
        self.tools = tools or []
        self.parallel = parallel_tool_calls is not False
        self.reasoning: type[ReasoningParser] | None = (
            get_reasoning_parser(server.reasoning_parser) if server.reasoning_parser else None)
        # A forced answer's grammar starts after the reasoning (structured_outputs.reasoning_end)
        self.reasoning_end = THINK_CLOSE if self.reasoning is not None else None
        self.structured: dict[str, Any] | None = None
        self.named: str | None = None
        self.auto: type[ToolParser] | None = None
        if isinstance(tool_choice, dict):
            self.named = str((tool_choice.get("function") or {}).get("name", ""))
        choice = "named" if self.named is not None else tool_choice or ("auto" if self.tools else "none")
        if choice != "none" and not self.tools:
            raise ChatParseError(f"field `tool_choice`: {choice!r} needs `tools`", "tool_choice")
        self.mode = choice
        if choice == "auto":
            if not (server.enable_auto_tool_choice and server.tool_call_parser):
                raise ChatParseError(
                    'field `tool_choice`: "auto" tool choice (the default with `tools`) needs the '
                    "server started with --enable-auto-tool-choice and --tool-call-parser; send "
                    'tool_choice "required", "none" or a named function', "tool_choice")
            self.auto = get_tool_parser(server.tool_call_parser)
        elif choice == "required":
            schema = required_schema(self.tools)
            self.structured = {"json": schema if self.parallel else schema | {"maxItems": 1}}
        elif choice == "named":
            try:
                self.structured = {"json": named_schema(self.tools, self.named or "")}
            except ValueError as exc:
                raise ChatParseError(str(exc), "tool_choice") from None
        if self.structured is not None and self.reasoning_end is not None:
            self.structured["reasoning_end"] = self.reasoning_end

    @property
    def active(self) -> bool:
        """Whether answers need parsing at all (else the text is the content)."""
        return self.mode != "none" or self.reasoning is not None

    def answer(self) -> AnswerParser:
        tools: ToolParser | None = None
        if self.mode == "auto" and self.auto is not None:
            tools = self.auto(self.tools)
        elif self.mode == "required":
            tools = RequiredParser(self.tools)
        elif self.mode == "named" and self.named is not None:
            tools = NamedParser(self.tools, self.named)
        return AnswerParser(self.reasoning() if self.reasoning else None, tools, self.parallel,
                            self.mode != "named")


class AnswerParser:
    """One choice's text -> reasoning_content, content and tool_calls, whole or as deltas."""

    def __init__(self, reasoning: ReasoningParser | None, tools: ToolParser | None, parallel: bool,
                 calls_finish: bool) -> None:
        self.reasoning, self.tools = reasoning, tools
        self.parallel = parallel
        self.calls_finish = calls_finish  # OpenAI: a forced named call still finishes "stop"
        self.called = False

    def message(self, text: str) -> dict[str, Any]:
        """The non-streamed message's fields (``content`` always; ``reasoning_content`` with a
        reasoning parser; ``tool_calls`` when there are calls)."""
        out: dict[str, Any] = {}
        content: str | None = text
        if self.reasoning is not None:
            out["reasoning_content"], content = self.reasoning.extract(text)
        if self.tools is not None:
            got = self.tools.extract(content or "")
            calls = got.calls if self.parallel else got.calls[:1]
            content = got.content
            if calls:
                self.called = True
                out["tool_calls"] = tool_calls_json(calls)
        return {"content": content} | out

    def feed(self, text: str) -> dict[str, Any]:
        """A streamed delta's fields for the next ``text`` of the answer ({} if nothing yet)."""
        return self._parts(*self.reasoning.feed(text) if self.reasoning else ("", text), last=False)

    def finish(self) -> dict[str, Any]:
        """What the parsers held back, once the answer ended."""
        reasoning, content = self.reasoning.finish() if self.reasoning else ("", "")
        return self._parts(reasoning, content, last=True)

    def _parts(self, reasoning: str, content: str, last: bool) -> dict[str, Any]:
        out: dict[str, Any] = {}
        if reasoning:
            out["reasoning_content"] = reasoning
        if self.tools is None:
            if content:
                out["content"] = content
            return out
        d = self.tools.feed(content) if content else StreamDelta()
        if last:
            tail = self.tools.finish()
            d = StreamDelta(d.content + tail.content, d.tool_calls + tail.tool_calls)
        if d.content:
            out["content"] = d.content
        calls = [c for c in d.tool_calls if self.parallel or c.index == 0]
        if calls:
            self.called = True
            out["tool_calls"] = _delta_json(StreamDelta(tool_calls=calls))
        return out

    def finish_reason(self, reason: str) -> str:
        """``tool_calls`` for an answer that called (and ended by itself), as OpenAI's."""
        return "tool_calls" if self.called and self.calls_finish and reason == "stop" else reason
