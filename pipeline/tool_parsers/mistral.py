"""The ``mistral`` format: content, then ``[TOOL_CALLS]`` and the calls.

    Sure.[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}]   (v0.3 tokenizers)
    Sure.[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]now[ARGS]{}     (v11+)

The newer form (one marker per call) is also accepted without ``[ARGS]`` (``name{...}``).
Ids are 9 alphanumerics, as Mistral's templates require (and vLLM sends). The markers are
special tokens: the detokenizer must keep them (skip_special_tokens=False).

Owns / State: the mode (``content``; ``after``: just past the marker; ``item``/``call``/``sep``:
the JSON array; ``name``/``args``: the newer form), the call object, the name being read and
the arguments value being streamed.
"""
from __future__ import annotations

import re

from pipeline.tool_parsers.base import ToolParser
from pipeline.tool_parsers.json_scan import WS, CallObject, JsonValue
from pipeline.tool_parsers.stream import find_marker, starts

MARKER = "[TOOL_CALLS]"
ARGS = "[ARGS]"
ARGS_KEYS = ("arguments", "parameters")
_NAME = re.compile(r"[A-Za-z0-9_.\-]+")


class MistralToolParser(ToolParser):
    name = "mistral"
    id_chars = 9

    def __init__(self, tools: list[dict] | None = None) -> None:
        super().__init__(tools)
        self._mode = "content"
        self._obj = CallObject(self, ARGS_KEYS)
        self._name = ""
        self._value = JsonValue()

    def _new_id(self) -> str:
        return super()._new_id()[len("call_"):]

    def _step(self, final: bool) -> bool:
        mode = self._mode
        if mode == "content":
            i, found = find_marker(self._buf, MARKER)
            if found:
                self._content_upto(i)
                self._take(len(MARKER))
                self._mode = "after"
                return True
            n = len(self._buf) if final else i
            self._content_upto(n)
            return n > 0
        if mode == "call":
            return self._call_step(self._obj, after="sep", broken="content")
        if mode == "name":
            return self._name_step(final)
        if mode == "args":
            return self._args_step()
        if not self._take_ws():
            return False
        c = self._buf[0]
        if mode == "after" and c == "[":
            self._take(1)
            self._mode = "item"
        elif mode == "after" and _NAME.match(c):
            self._name = ""
            self._mode = "name"
        elif mode == "item" and c == "{":
            self._obj = CallObject(self, ARGS_KEYS)
            self._mode = "call"
        elif mode == "sep" and c == ",":
            self._take(1)
            self._mode = "item"
        elif mode == "sep" and c == "]":
            self._take(1)
            self._clean()
            self._mode = "content"
        else:
            self._break()
            self._mode = "content"
        return True

    def _name_step(self, final: bool) -> bool:
        m = _NAME.match(self._buf)
        if m:
            self._name += self._take(m.end())
            return True
        s = starts(self._buf, ARGS)
        if s is None and not final:
            return False
        if s or self._buf[0] == "{":
            self._take(len(ARGS) if s else 0)
            self._commit(self._name)
            self._value = JsonValue()
            self._mode = "args"
        else:
            self._break()
            self._mode = "content"
        return True

    def _args_step(self) -> bool:
        """The arguments object, streamed as written; it ends with its closing brace."""
        v, n = self._value, 0
        for c in self._buf:
            if not v.first and c not in WS and c != "{":
                break  # no object: the call has no arguments, the rest is content
            n += 1
            self._args(v.push(c) or "")
            if v.complete:
                break
        self._buf = self._buf[n:]
        if v.complete or self._buf:
            self._close_call()
            self._mode = "content"
        return True
