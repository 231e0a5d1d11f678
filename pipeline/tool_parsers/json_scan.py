"""Incremental scanners for the JSON of tool calls: one character at a time, no lookahead, so
what they decide never depends on where the deltas split the text.

- ``JsonValue``: the extent of one JSON value (strings and nesting tracked, nothing else
  validated): the text of an arguments object exactly as the model wrote it.
- ``ArgsValue``: an arguments value. An object is streamed as it arrives; anything else is
  held to its end and then converted: ``null`` is no arguments, a JSON string holding the
  object (some models encode it twice) is that string's text.
- ``CallObject``: one ``{"name": "f", "arguments": {...}}`` object, keys in any order. It
  commits the call on its parser when the name's value ends, streams the arguments from then
  on (arguments seen before the name are sent at the commit), and ends with ``status``
  ``done`` (its closing brace consumed) or ``error`` (the offending character not consumed).

Owns / State: each scanner is one value's or one object's parse state.
"""
from __future__ import annotations

import json
from typing import Protocol

WS = " \t\r\n"


class Sink(Protocol):
    def _commit(self, name: str) -> None: ...
    def _args(self, fragment: str) -> None: ...


class JsonValue:
    def __init__(self) -> None:
        self.first = ""  # the value's first character ("" before it starts)
        self._parts: list[str] = []  # its text so far (a list: values can be long)
        self._ws = ""  # whitespace after the value at depth 0: trailing unless more follows
        self._depth = 0
        self._str = False
        self._esc = False

    @property
    def raw(self) -> str:
        """The value's text so far, without leading or trailing whitespace."""
        return "".join(self._parts)

    @property
    def complete(self) -> bool:
        """An object, array or string that has closed."""
        return self.first in ('{', '[', '"') and self._depth == 0 and not self._str

    def push(self, c: str) -> str | None:
        """The text ``c`` adds to the value now ("" when held), or None when ``c`` ends the
        value: a delimiter of the enclosing structure (``,`` ``}`` ``]`` at depth 0), or
        anything but whitespace after a closed object, array or string."""
        if self._str:
            if self._esc:
                self._esc = False
            elif c == "\\":
                self._esc = True
            elif c == '"':
                self._str = False
            self._parts.append(c)
            return c
        if self._depth == 0 and c in ",}]":
            return None
        if c in WS:
            if not self.first:
                return ""
            if self._depth == 0:
                self._ws += c
                return ""
            self._parts.append(c)
            return c
        if self.complete:
            return None
        out, self._ws = self._ws + c, ""
        if not self.first:
            self.first = c
        if c == '"':
            self._str = True
        elif c in "{[":
            self._depth += 1
        elif c in "}]":
            self._depth -= 1
        self._parts.append(out)
        return out


def args_text(raw: str) -> str:
    """The arguments text of a value that is no object ("" for none: the call sends "{}")."""
    if raw == "null":
        return ""
    if raw.startswith('"'):
        try:
            inner = json.loads(raw)
        except ValueError:
            return raw
        return inner if isinstance(inner, str) else raw
    return raw


class ArgsValue:
    def __init__(self) -> None:
        self.value = JsonValue()
        self._stream: bool | None = None  # decided by the first character

    def push(self, c: str) -> str | None:
        out = self.value.push(c)
        if out is None:
            return None
        if self._stream is None and self.value.first:
            self._stream = self.value.first == "{"
        return out if self._stream else ""

    def end(self) -> str:
        """The value ended (a delimiter, or the output): the text still to send."""
        return "" if self._stream else args_text(self.value.raw)


class CallObject:
    def __init__(self, sink: Sink, args_keys: tuple[str, ...]) -> None:
        self._sink = sink
        self._args_keys = args_keys
        self.status = "more"  # "more" | "done" | "error"
        self.name: str | None = None
        self._state = "open"
        self._key = ""  # the raw key string being read
        self._esc = False
        self._kind = ""  # what the current value is: "name" | "args" | "skip"
        self._value: JsonValue | ArgsValue = JsonValue()
        self._args_seen = False
        self._pending = ""  # arguments text that arrived before the name

    def feed(self, buf: str) -> int:
        """Scan ``buf``; returns how many characters were consumed (stops at done or error)."""
        for i, c in enumerate(buf):
            consumed = self._char(c)
            if self.status != "more":
                return i + consumed
        return len(buf)

    def eof(self) -> None:
        """The output ended inside the object: keep what is usable (a complete name value
        commits the call; arguments held so far are sent)."""
        if self.status == "more" and self._state == "value":
            self._end_value()

    def _char(self, c: str) -> bool:
        st = self._state
        if st == "open":
            if c in WS:
                return True
            if c == "{":
                self._state = "key"
                return True
            return self._error()
        if st == "key":
            if c in WS or c == ",":  # lenient on commas: they separate nothing we need
                return True
            if c == '"':
                self._state, self._key, self._esc = "keystr", c, False
                return True
            return self._close() if c == "}" else self._error()
        if st == "keystr":
            self._key += c
            if self._esc:
                self._esc = False
            elif c == "\\":
                self._esc = True
            elif c == '"':
                self._state = "colon"
            return True
        if st == "colon":
            if c in WS:
                return True
            if c != ":":
                return self._error()
            return self._start_value()
        out = self._value.push(c)
        if out is None:
            if not self._end_value():
                return self._error()
            if c == ",":
                self._state = "key"
                return True
            return self._close() if c == "}" else self._error()
        if self._kind == "args":
            if self.name is not None:
                self._sink._args(out)
            else:
                self._pending += out
        return True

    def _start_value(self) -> bool:
        try:
            key = json.loads(self._key)
        except ValueError:
            return self._error()
        if key == "name" and self.name is None:
            self._kind = "name"
        elif key in self._args_keys and not self._args_seen:
            self._kind, self._args_seen = "args", True  # a repeated key: the first one counts
        else:
            self._kind = "skip"
        self._value = ArgsValue() if self._kind == "args" else JsonValue()
        self._state = "value"
        return True

    def _end_value(self) -> bool:
        """The current value ended; False when it is no value (or a name that is no string)."""
        v = self._value
        raw = v.value.raw if isinstance(v, ArgsValue) else v.raw
        if not raw:
            return False
        if self._kind == "name":
            try:
                name = json.loads(raw)
            except ValueError:
                return False
            if not isinstance(name, str) or not name:
                return False
            self.name = name
            self._sink._commit(name)
            self._sink._args(self._pending)
            self._pending = ""
        elif isinstance(v, ArgsValue):
            if self.name is not None:
                self._sink._args(v.end())
            else:
                self._pending += v.end()
        self._state = "key"
        return True

    def _close(self) -> bool:
        if self.name is None:
            return self._error()  # an object with no name is no call
        self.status = "done"
        return True

    def _error(self) -> bool:
        self.status = "error"
        return False
