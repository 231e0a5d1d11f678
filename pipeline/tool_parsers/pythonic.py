"""The ``pythonic`` format (Llama 3.2/4, ToolACE): the output is a Python list of calls.

    [get_weather(city="Paris", days=3), now()]

Arguments are keyword arguments whose values are literals (str, int, float, True/False,
None, lists, dicts with string keys; JSON's true/false/null too), sent as
``json.dumps(arguments, ensure_ascii=False)``: the text the model wrote is Python, not JSON,
so a call is sent whole (id, name and arguments in one delta) once its closing parenthesis
arrives and it parses. An output that is not a list of calls is content; so is what follows
the first part that is no call (the calls before it stay calls).

Owns / State: the mode (``start``; ``item``: a call; ``sep``: after one; ``plain``) and the
scan of the call being read (``CallScan``: where it ends).
"""
from __future__ import annotations

import ast
import json
import math
import re
from typing import Any

from pipeline.tool_parsers.base import ToolParser

_HEAD = re.compile(r"[A-Za-z_]\w*\s*")
_JSON_NAMES = {"true": True, "false": False, "null": None}


class CallScan:
    """Where a call ``name(...)`` ends: brackets and Python strings (triple-quoted included)
    tracked incrementally. ``scan`` returns the end index, None (needs more text) or -1."""

    def __init__(self) -> None:
        self._pos = 0  # 0: the head (name and parenthesis) is not read yet
        self._depth = 0
        self._quote = ""
        self._esc = False

    def scan(self, buf: str, final: bool) -> int | None:
        if not self._pos:
            m = _HEAD.match(buf)
            if not m:
                return -1
            if m.end() == len(buf):
                return -1 if final else None
            if buf[m.end()] != "(":
                return -1
            self._pos = m.end()
        i = self._pos
        while i < len(buf):
            c = buf[i]
            if self._quote:
                if self._esc:
                    self._esc = False
                elif c == "\\":
                    self._esc = True
                elif c == self._quote:
                    self._quote = ""
                elif c == self._quote[0]:  # a triple quote closes only with all three
                    tail = buf[i:i + 3]
                    if tail == self._quote:
                        self._quote = ""
                        i += 3
                        continue
                    if len(tail) < 3 and self._quote.startswith(tail) and not final:
                        break
            elif c in "'\"":
                tail = buf[i:i + 3]
                if tail == c * 3:
                    self._quote = tail
                    i += 3
                    continue
                if len(tail) < 3 and tail == c * len(tail) and not final:
                    break  # '' or ' at the end: an empty string or a triple quote's start
                self._quote = c
            elif c in "([{":
                self._depth += 1
            elif c in ")]}":
                self._depth -= 1
                if self._depth == 0:
                    return i + 1 if c == ")" else -1
            i += 1
        self._pos = i
        return -1 if final else None


class _NotLiteral(Exception):
    pass


def _literal(node: ast.expr) -> Any:
    if isinstance(node, ast.Constant):
        c = node.value
        if c is None or isinstance(c, (str, bool, int)) or (isinstance(c, float) and math.isfinite(c)):
            return c
    elif isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        n = _literal(node.operand)
        if isinstance(n, (int, float)) and not isinstance(n, bool):
            return -n if isinstance(node.op, ast.USub) else n
    elif isinstance(node, ast.List):
        return [_literal(e) for e in node.elts]
    elif isinstance(node, ast.Dict):
        out = {}
        for k, v in zip(node.keys, node.values):
            key = _literal(k) if k is not None else None
            if not isinstance(key, str):
                raise _NotLiteral
            out[key] = _literal(v)
        return out
    elif isinstance(node, ast.Name) and node.id in _JSON_NAMES:
        return _JSON_NAMES[node.id]
    raise _NotLiteral


def parse_call(text: str) -> tuple[str, str] | None:
    """(name, JSON arguments) of one call ``name(k=literal, ...)``; None when it is no such call."""
    try:
        node = ast.parse(text, mode="eval").body
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return None
    if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name) or node.args:
        return None
    args = {}
    try:
        for kw in node.keywords:
            if kw.arg is None:  # **kwargs
                return None
            args[kw.arg] = _literal(kw.value)
    except (_NotLiteral, RecursionError):
        return None
    return node.func.id, json.dumps(args, ensure_ascii=False)


class PythonicToolParser(ToolParser):
    name = "pythonic"

    def __init__(self, tools: list[dict] | None = None) -> None:
        super().__init__(tools)
        self._mode = "start"
        self._scan_call = CallScan()

    def _step(self, final: bool) -> bool:
        mode = self._mode
        if mode == "plain":
            self._content_upto(len(self._buf))
            return True
        if not self._take_ws():
            return False
        c = self._buf[0]
        if mode == "item" and c == "]" and self.called:  # a trailing comma: [f(), ]
            self._take(1)
            self._clean()
            self._mode = "plain"
        elif mode == "item":
            end = self._scan_call.scan(self._buf, final)
            if end is None:
                return False
            parsed = parse_call(self._buf[:end]) if end > 0 else None
            if parsed is None:
                self._break()
                self._mode = "plain"
                return True
            self._take(end)
            self._commit(parsed[0])
            self._args(parsed[1])
            self._close_call()
            self._mode = "sep"
        elif mode == "start" and c == "[":
            self._take(1)
            self._scan_call = CallScan()
            self._mode = "item"
        elif mode == "sep" and c == ",":
            self._take(1)
            self._scan_call = CallScan()
            self._mode = "item"
        elif mode == "sep" and c == "]":
            self._take(1)
            self._clean()
            self._mode = "plain"
        else:
            self._break()
            self._mode = "plain"
        return True
