"""Pipe mode's chat lines with tools or a reasoning parser: a JSON line's ``tool_choice`` and
``parallel_tool_calls`` (OpenAI's, as on /v1/chat/completions), and its final answer line
with the parsed parts beside ``text``: ``content``, ``tool_calls``, ``reasoning_content`` and
``finish_reason`` ``tool_calls`` (per completion in ``outputs`` too). Streamed delta lines stay
the raw text (the parts are certain only once the answer ended).

The daemon's wire protocol has no ``tool_choice``: choosing and parsing calls is a front
end's job (``chat_parse``), so this front end takes the two fields off the line before the
rest is decoded as a request, turns a forced choice into the request's grammar, and parses
each final answer it writes. Owns each chat request's parsing until its final answer.
"""
from __future__ import annotations

from typing import Any

import msgspec
from pydantic import ValidationError

from pipeline.chat_parse import ChatParseError, ChatParsers, ChatParsing
from pipeline.http.openai_api import NamedToolChoice
from pipeline.messages import GatewayRequest, RequestResult
from pipeline.sampling_params.structured import StructuredOutputsParams

TOOL_FIELDS = ("tool_choice", "parallel_tool_calls")
ToolFields = dict[str, Any]


def split_tool_fields(line: str) -> tuple[str | dict[str, Any], ToolFields]:
    """A JSON line without its ``tool_choice`` / ``parallel_tool_calls`` (decoded only when it
    names one), and their values."""
    if not any(f'"{f}"' in line for f in TOOL_FIELDS):
        return line, {}
    try:
        obj = msgspec.json.decode(line)
    except msgspec.DecodeError:
        return line, {}  # the request decoder names what is wrong
    if not isinstance(obj, dict):
        return line, {}
    return obj, {f: obj.pop(f) for f in TOOL_FIELDS if f in obj}


def _choice(value: Any) -> str | dict[str, Any] | None:
    if value is None or value in ("none", "auto", "required"):
        return value
    try:  # the API's own model of a named choice
        return NamedToolChoice.model_validate(value).model_dump()
    except ValidationError:
        raise ValueError('field `tool_choice`: must be "none", "auto", "required" or '
                         '{"type": "function", "function": {"name": ...}}') from None


class PipeChats:
    def __init__(self, parsers: ChatParsers) -> None:
        self.parsers = parsers
        self.answers: dict[str, ChatParsing] = {}  # request id -> how its answer is parsed

    def prepare(self, req: GatewayRequest, fields: ToolFields, key: str) -> None:
        """Before ``req`` is submitted as ``key`` (the id its answers will carry): its parsing,
        and a forced choice's grammar; ValueError naming the field."""
        if req.messages is None:
            if fields:
                raise ValueError(f"field `{next(iter(fields))}`: only valid with `messages` (a chat request)")
            return
        parallel = fields.get("parallel_tool_calls")
        if parallel is not None and not isinstance(parallel, bool):
            raise ValueError("field `parallel_tool_calls`: must be a boolean")
        choice = _choice(fields.get("tool_choice"))
        if not (req.tools or choice is not None or self.parsers.reasoning_parser):
            return
        try:
            parsing = ChatParsing(req.tools, choice, parallel, self.parsers)
        except ChatParseError as exc:
            raise ValueError(str(exc)) from None
        if parsing.structured is not None:
            if req.sampling_params.structured_outputs is not None:
                raise ValueError(f"field `tool_choice`: {parsing.mode!r} forces the answer's shape; it "
                                 "cannot be combined with structured_outputs")
            req.sampling_params = msgspec.structs.replace(
                req.sampling_params, structured_outputs=StructuredOutputsParams(**parsing.structured))
        if parsing.mode == "auto":
            # The call markers of some formats are special tokens: the parser must see them.
            req.sampling_params = msgspec.structs.replace(req.sampling_params, skip_special_tokens=False)
        if parsing.active:
            self.answers[key] = parsing

    def result(self, res: RequestResult) -> dict[str, Any] | None:
        """The final line's parsed parts, per completion in ``outputs`` (and mirrored at the
        top for completion 0, as ``text`` is); the request's parsers are dropped."""
        parsing = self.answers.pop(res.id, None)
        if parsing is None or res.finish_reason == "error":
            return None
        outs = []
        for text, reason in [(c.text, c.finish_reason) for c in res.outputs] or [(res.text, res.finish_reason)]:
            p = parsing.answer()
            outs.append(p.message(text) | {"finish_reason": p.finish_reason(reason)})
        top = dict(outs[0])
        if res.outputs:
            top["outputs"] = [msgspec.to_builtins(c) | o for c, o in zip(res.outputs, outs)]
        return top

    def drop(self, req_id: str) -> None:
        self.answers.pop(req_id, None)
