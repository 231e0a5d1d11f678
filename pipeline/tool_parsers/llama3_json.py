"""The ``llama3_json`` format (Llama 3.1/3.2/3.3 and 4 with JSON tool calling): the whole
output is the calls.

    <|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}; {"name": "now"}

The tag is optional; the arguments key is ``parameters`` (Meta's templates) or ``arguments``;
several calls are separated by ``;``. An output that does not start with ``{`` (after the tag
and whitespace) is plain content, tag included; so is whatever follows the calls when it is
not another call.

Owns / State: the mode (``start``/``next``: before a call; ``call``; ``sep``: after one;
``plain``: the rest is content) and the call object being scanned.
"""
from __future__ import annotations

from pipeline.tool_parsers.base import ObjectCallsParser
from pipeline.tool_parsers.stream import starts

PYTHON_TAG = "<|python_tag|>"


class Llama3JsonToolParser(ObjectCallsParser):
    name = "llama3_json"

    def _between(self, final: bool) -> bool:
        mode = self._mode
        if mode == "sep":
            if self._buf[0] == ";":
                self._take(1)
                self._mode = "next"
            else:
                self._to_content()
            return True
        if mode == "start":  # the tag may open the output, once
            s = starts(self._buf, PYTHON_TAG)
            if s is None and not final:
                return False
            if s:
                self._take(len(PYTHON_TAG))
                self._mode = "next"
                return True
        if self._buf[0] == "{":
            self._open_call()
        else:
            self._to_content()
        return True
