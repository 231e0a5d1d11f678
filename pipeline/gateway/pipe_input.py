"""Pipe mode's input: reading stdin's lines and parsing each into a request.

Input is read as bytes, one line per ``\n``, each at most ``MAX_LINE_BYTES``. A line is, after
stripping white space and a UTF-8 byte order mark (BOM; a concatenated file may carry one on
any line):
- empty: skipped, no answer;
- a JSON object (it starts with ``{``): one request (``id``, ``prompt`` | ``prompt_token_ids``
  | ``messages``, sampling fields, ``stream``);
- another JSON value (a number, a quoted string, an array, true/false/null): an error, since
  a JSON line must be an object; send such text as ``{"prompt": ...}``;
- anything else: a plain prompt.
If the first non-empty line is an OpenAI batch line (``custom_id``, ``method``, ``url``,
``body``), the input is an OpenAI batch file and every answer is a batch output line
(``gateway.batch``); a plain or JSON request line there, or a batch line in plain mode, gets an error
answer saying so.
Every line that is not empty gets exactly one final answer line (a RequestResult): an error
one (finish_reason "error") for a line that is not valid UTF-8, too long, not a valid
request, or over the byte limits of README.md "Limits". A request's id is its ``id``, else its
line's 0-based index; ids are unique within a run: a line reusing one is not run and gets an
error answer with that id and ``error.code == "duplicate_id"`` naming both lines' indices,
so the first line's answer is the only one under that id without that code.
Owns no state; a run's ids are its ``RunIds``.
"""
from __future__ import annotations

from collections.abc import Iterator
from typing import BinaryIO

import msgspec

from pipeline.frontend.protocol import Generate, ProtocolError
from pipeline.frontend.request_parser import gateway_request, request_from_json, sampling_params
from pipeline.gateway.pipe_chat import ToolFields, split_tool_fields
from pipeline.messages import GatewayRequest
from pipeline.messages.requests import MAX_PROMPT_BYTES

# Room for a maximal prompt in any JSON escaping (up to 6 bytes per byte, "\u0001").
MAX_LINE_BYTES = 8 * MAX_PROMPT_BYTES
BOM = "\ufeff"
_JSON_KINDS = {list: "array", str: "string", int: "number", float: "number", bool: "boolean",
               type(None): "null"}


class RequestError(ValueError):
    def __init__(self, message: str, req_id: str | None = None) -> None:
        super().__init__(message)
        self.req_id = req_id


def _loose_id(line: str) -> str | None:
    """The id of a line that failed validation, so its error answer carries it."""
    try:
        rid = msgspec.json.decode(line).get("id")
    except (msgspec.DecodeError, AttributeError):
        return None
    return str(rid) if isinstance(rid, (str, int)) and not isinstance(rid, bool) else None


def read_lines(stream: BinaryIO) -> Iterator[bytes | int]:
    """The lines of ``stream`` (with their newline); for a line over MAX_LINE_BYTES, its size
    instead: it is read through in pieces, never held whole."""
    while line := stream.readline(MAX_LINE_BYTES + 1):
        if len(line) <= MAX_LINE_BYTES or line.endswith(b"\n"):
            yield line
            continue
        size = len(line)
        while line and not line.endswith(b"\n"):
            line = stream.readline(1 << 20)
            size += len(line)
        yield size - line.endswith(b"\n")


def line_text(raw: bytes | int) -> str:
    """A line's text, stripped of white space and a BOM; RequestError if it is unreadable."""
    if isinstance(raw, int):
        raise RequestError(f"line: {raw} bytes, the limit is {MAX_LINE_BYTES} bytes")
    try:
        line = raw.decode("utf-8").strip()
    except UnicodeDecodeError as exc:
        raise RequestError(f"line: not valid UTF-8 (byte 0x{raw[exc.start]:02x} at offset "
                           f"{exc.start})") from None
    if line.startswith(BOM):
        line = line[len(BOM):].strip()
    return line


def parse_line(line: str, default_id: str, defaults: dict) -> tuple[GatewayRequest, bool, ToolFields]:
    """The request of one non-empty input line (``line_text``), whether it named its id, and
    its tool_choice / parallel_tool_calls (``pipe_chat``). RequestError for a line that is no
    request (its message names what is wrong)."""
    tool_fields: ToolFields = {}
    try:
        if line.startswith("{"):
            data, tool_fields = split_tool_fields(line)
            gen, sp = request_from_json(data, defaults)
        else:
            try:
                value = msgspec.json.decode(line)
            except msgspec.DecodeError:  # not JSON: a plain prompt
                gen = Generate(prompt=line)
                sp = sampling_params(gen, defaults)
            else:
                raise RequestError(f"line: a JSON line must be an object, got a JSON "
                                   f"{_JSON_KINDS.get(type(value), 'value')}; to send this text "
                                   f"as a prompt, send {{\"prompt\": ...}}")
    except ProtocolError as exc:
        raise RequestError(str(exc), exc.req_id or _loose_id(line)) from None
    req = gateway_request(gen, sp, default_id if gen.id is None else str(gen.id))
    return req, gen.id is not None, tool_fields


def _index_of(rid: str) -> int | None:
    """The line index ``rid`` is the default id of, if it is one ("7", not "07" or "+7")."""
    if rid.isascii() and rid.isdigit() and (rid == "0" or rid[0] != "0"):
        return int(rid)
    return None


class RunIds:
    """The ids a run has used. A line without an id uses its index, kept as one bit, so a
    long input of such lines costs little memory."""

    def __init__(self) -> None:
        self.named: dict[str, int] = {}  # an id a line gave itself -> that line's index
        self.numbered = bytearray()  # bit i: line i used its index as its id

    def _has(self, i: int) -> bool:
        return i // 8 < len(self.numbered) and bool(self.numbered[i // 8] >> (i % 8) & 1)

    def claim(self, rid: str, index: int, named: bool) -> int | None:
        """Record line ``index``'s id; if an earlier line has it, that line's index instead."""
        if rid in self.named:
            return self.named[rid]
        k = _index_of(rid)
        if k is not None and self._has(k):
            return k
        if named:
            self.named[rid] = index
        else:
            self.numbered.extend(bytes(index // 8 + 1 - len(self.numbered)))
            self.numbered[index // 8] |= 1 << (index % 8)
        return None
