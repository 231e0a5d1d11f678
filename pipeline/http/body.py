"""A request body from bytes to its checked model (``openai_api``), off the event loop.

Owns no state. Every route decodes its body here (``decode``), in a worker thread
(``off_loop``), so no work on the event loop grows with the body: JSON decoding, the checks
below and pydantic's validation all run in the thread; the loop only awaits it.

What the JSON grammar lets through but nothing after it can carry is refused first, naming
the field by its path (``messages[0].content``), as pipe mode's decoder does: a string (or
an object key) holding a lone UTF-16 surrogate (``"\\ud800"`` is valid JSON, but no UTF-8
encodes it, so msgpack, the tokenizer and the response encoder would all fail on it), an
integer outside [-2**63, 2**64) (msgpack carries no larger), and nesting past the JSON
parser's recursion limit. Then the prompt's size (``check_sizes``): the daemon's byte limits
for a prompt and for a chat's messages, 413 naming the field, on every route (``/tokenize``
included, which never reaches the daemon).
"""
from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Callable
from typing import Any, TypeVar

import msgspec
from pydantic import BaseModel, ValidationError

from pipeline.http import openai_convert as C
from pipeline.tokenizer.validate import InvalidRequest, check_messages_bytes, check_prompt_text

M = TypeVar("M", bound=BaseModel)
T = TypeVar("T")
INT_MIN, INT_END = -(2**63), 2**64
_SURROGATE = re.compile("[\ud800-\udfff]")


def _where(path: tuple[str | int, ...]) -> str:
    return "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in path).lstrip(".") or "body"


def _lone_surrogate(s: str) -> int | None:
    """The index of a lone surrogate in ``s`` (json.loads pairs the valid ones), or None."""
    if s.isascii():
        return None
    m = _SURROGATE.search(s)
    return None if m is None else m.start()


def check_json(value: Any) -> None:
    """ApiError (400) naming the first value no later stage can carry. The test is msgpack's
    own encoder (C, 85 ms for a 32 MiB body of 11M objects): what it carries, every stage
    does. Only a body it refuses is walked, to name the field."""
    try:
        msgspec.msgpack.encode(value)
    except (UnicodeEncodeError, OverflowError):
        _name_the_bad_value(value)
        raise  # not reached: the walk finds what the encoder refused


def _name_the_bad_value(value: Any) -> None:
    """Iterative (no recursion); a path is built per non-empty container, not per value."""
    stack: list[tuple[Any, tuple[str | int, ...]]] = [(value, ())]
    while stack:
        v, path = stack.pop()
        for k, item in (v.items() if isinstance(v, dict) else enumerate(v)):
            if isinstance(k, str) and (i := _lone_surrogate(k)) is not None:
                raise C.invalid(f"field `{_where(path)}`: a key with a lone UTF-16 surrogate "
                                f"(\\u{ord(k[i]):04x}): not valid Unicode", _where(path))
            t = type(item)
            if t is str:
                if (i := _lone_surrogate(item)) is not None:
                    at = _where((*path, k))
                    raise C.invalid(f"field `{at}`: a lone UTF-16 surrogate (\\u{ord(item[i]):04x}) at "
                                    f"character {i}: not valid Unicode", at)
            elif t is int:
                if not INT_MIN <= item < INT_END:
                    at = _where((*path, k))
                    raise C.invalid(f"field `{at}`: integers must be in [-2**63, 2**64 - 1], got one of "
                                    f"{len(str(abs(item)))} digits", at)
            elif (t is dict or t is list) and item:
                stack.append((item, (*path, k)))


def check_sizes(prompt: object = None, messages: list[dict[str, Any]] | None = None) -> None:
    """The daemon's byte limits of a prompt, before any work on it: ApiError 413."""
    try:
        for p in prompt if isinstance(prompt, list) else [prompt]:
            if isinstance(p, str):
                check_prompt_text(p)
        if messages is not None:
            check_messages_bytes(messages)
    except InvalidRequest as exc:
        e = C.invalid(str(exc))
        raise C.ApiError(413, e.message, e.param, "request_too_large") from None


def decode(raw: bytes, model: type[M]) -> M:
    """The body as ``model``: ApiError 400 naming the field, else the model."""
    try:
        value = json.loads(raw)
    except RecursionError:  # past the parser's recursion limit (~1000 levels)
        raise C.invalid("body: nested too deeply") from None
    except ValueError as exc:  # JSONDecodeError, and bytes that are not UTF-8
        raise C.invalid(f"body is not valid JSON: {exc}") from None
    if not isinstance(value, dict):
        raise C.invalid(f"body: must be a JSON object, got {type(value).__name__}")
    check_json(value)
    try:
        return model.model_validate(value)
    except ValidationError as exc:
        raise C.body_error(list(exc.errors())) from None


async def off_loop(fn: Callable[[bytes], T], raw: bytes) -> T:
    """``fn(raw)`` in a worker thread: the event loop only awaits it."""
    return await asyncio.to_thread(fn, raw)
