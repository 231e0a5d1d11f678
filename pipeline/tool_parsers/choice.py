"""The answers of ``tool_choice`` ``required`` and a named function, and the JSON schemas
that force them through the grammar engine (so they are valid calls, from any model).

- ``required``: a JSON array of calls, ``[{"name": "f", "parameters": {...}}, ...]`` (vLLM's
  shape); ``required_schema(tools)`` forces it (one item at least; each item one of the
  tools, its parameters that tool's schema). ``RequiredParser`` reads it: every element a
  call, arguments streamed as written.
- a named function: the output is that function's arguments object; ``named_schema`` is its
  parameters schema, ``NamedParser`` sends the call (id and name on the first delta) with the
  whole output as its arguments.

Owns / State: ``RequiredParser``'s mode and call object; ``NamedParser``'s function name and
the leading whitespace it holds.
"""
from __future__ import annotations

from typing import Any

from pipeline.tool_parsers.base import ObjectCallsParser, ToolParser


def _functions(tools: list[dict] | None) -> list[dict]:
    return [t["function"] for t in tools or [] if isinstance(t, dict) and isinstance(t.get("function"), dict)]


def _parameters(function: dict) -> dict[str, Any]:
    params = function.get("parameters")
    return params if isinstance(params, dict) and params else {"type": "object"}


def required_schema(tools: list[dict] | None, parallel: bool = True) -> dict[str, Any]:
    """The schema of ``required``'s answer; ``parallel=False`` (parallel_tool_calls) allows one call."""
    items = [{"type": "object",
              "properties": {"name": {"type": "string", "const": f["name"]}, "parameters": _parameters(f)},
              "required": ["name", "parameters"], "additionalProperties": False}
             for f in _functions(tools)]
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": items}}
    if not parallel:
        schema["maxItems"] = 1
    return schema


def named_schema(tools: list[dict] | None, name: str) -> dict[str, Any]:
    for f in _functions(tools):
        if f.get("name") == name:
            return _parameters(f)
    raise ValueError(f"field `tool_choice`: no function named {name} in `tools`")


class RequiredParser(ObjectCallsParser):
    name = "required"

    def _between(self, final: bool) -> bool:
        mode, c = self._mode, self._buf[0]
        if (mode == "start" and c == "[") or (mode == "sep" and c == ","):
            self._take(1)
            self._mode = "item"
        elif mode == "item" and c == "{":
            self._open_call()
        elif mode == "sep" and c == "]":
            self._take(1)
            self._clean()
            self._mode = "plain"
        else:
            self._to_content()
        return True


class NamedParser(ToolParser):
    name = "named"

    def __init__(self, tools: list[dict] | None = None, name: str = "") -> None:
        super().__init__(tools)
        self.function = name
        self._lead: str | None = ""  # leading whitespace: arguments only if something follows

    def _fresh(self) -> ToolParser:
        return NamedParser(self.tools, self.function)

    def _run(self, final: bool) -> None:
        if not self.called:
            self._commit(self.function)  # the call is the whole answer: name and id first
        super()._run(final)

    def _step(self, final: bool) -> bool:
        text, self._buf = self._buf, ""
        if self._lead is not None:
            text = self._lead + text
            if not text.strip():
                self._lead = text
                return True
            self._lead = None
        self._args(text)
        return True
