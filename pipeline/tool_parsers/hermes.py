"""The ``hermes`` format (Hermes 2 Pro, Qwen2.5, Qwen3): calls in tags, content around them.

    Let me look.<tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

The text before the first tag (and between or after the calls) is content. A call needs its
name; the closing tag may be missing at the end of the output (Qwen often stops right after
the object). A tag followed by no call object is content, tag included.

Owns / State: the mode (``content``: looking for ``<tool_call>``; ``body``: the call object;
``end``: looking for ``</tool_call>``) and the call object being scanned.
"""
from __future__ import annotations

from pipeline.tool_parsers.base import ToolParser
from pipeline.tool_parsers.json_scan import CallObject
from pipeline.tool_parsers.stream import find_marker, starts

START = "<tool_call>"
END = "</tool_call>"


class HermesToolParser(ToolParser):
    name = "hermes"

    def __init__(self, tools: list[dict] | None = None) -> None:
        super().__init__(tools)
        self._mode = "content"
        self._obj = CallObject(self, ("arguments",))

    def _step(self, final: bool) -> bool:
        if self._mode == "content":
            i, found = find_marker(self._buf, START)
            if found:
                self._content_upto(i)
                self._take(len(START))
                self._obj = CallObject(self, ("arguments",))
                self._mode = "body"
                return True
            n = len(self._buf) if final else i  # hold what could be the start of a tag
            self._content_upto(n)
            return n > 0
        if self._mode == "body":
            return self._call_step(self._obj, after="end", broken="content")
        # "end": whitespace, then the closing tag (or anything else: content again)
        if not self._take_ws():
            return False
        s = starts(self._buf, END)
        if s is None and not final:
            return False
        if s:
            self._take(len(END))
            self._clean()
        else:
            self._break()
        self._mode = "content"
        return True

    def _eof(self) -> None:
        if self._mode == "body":
            self._obj.eof()
