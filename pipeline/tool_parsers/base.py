"""The interface of the tool-call parsers and the streaming machinery they share.

A parser turns a model's output text into OpenAI tool calls plus the text outside them, both
whole (``extract``) and streamed (``feed`` each new piece of text, then ``finish``). The two
must agree for ANY split of the output into deltas, so there is one implementation: each
parser is an incremental state machine over its buffered text whose decisions depend only on
the text (a marker split across deltas is held until it is decided; at ``finish`` every
decision is taken with the end of the output in view), and ``extract`` is that machine fed the
whole text at once.

Commit rule: a call is committed (its id and name are sent) once its name is complete; from
then on it is a call whatever follows (a truncated call keeps the arguments text it got, as
OpenAI's own ``finish_reason: length`` answers do). Text that never reached a committed call
(a tag followed by no JSON, a JSON object without a name, a list that is no list of calls) is
content: nothing the model wrote is dropped but the calls' own syntax (tags, separators) and
the whitespace between the calls and the ends of the content (``stream.ContentFilter``).

Owns / State: a parser instance holds one answer's streaming state: ``_buf`` (text received
but not yet decided), ``_raw`` (call syntax consumed but not committed: content if the call
breaks), the mode its subclass is in, the open call, the content filter.
"""
from __future__ import annotations

import secrets
import string
from dataclasses import dataclass, field
from typing import ClassVar

from pipeline.tool_parsers.json_scan import CallObject
from pipeline.tool_parsers.stream import ContentFilter

_ALNUM = string.ascii_letters + string.digits


def random_id(n: int) -> str:
    return "".join(secrets.choice(_ALNUM) for _ in range(n))


@dataclass
class ToolCall:
    """One whole call."""
    id: str
    name: str
    arguments: str  # JSON text of the arguments object


@dataclass
class ExtractedToolCalls:
    calls: list[ToolCall]
    content: str | None  # the text outside the calls; None when empty or whitespace only


@dataclass
class ToolCallDelta:
    """One OpenAI ``delta.tool_calls[i]`` item."""
    index: int
    id: str | None = None  # set (with name) on the call's first delta only
    name: str | None = None
    arguments: str = ""  # the next fragment of the arguments text


@dataclass
class StreamDelta:
    content: str = ""
    tool_calls: list[ToolCallDelta] = field(default_factory=list)


class ToolParser:
    """One instance per answer (choice). Subclasses implement ``_step`` (and ``_eof``)."""

    name: ClassVar[str] = ""
    id_chars: ClassVar[int] = 24  # the id is "call_" + this many alphanumerics

    def __init__(self, tools: list[dict] | None = None) -> None:
        self.tools = list(tools or [])
        self._buf = ""
        self._raw = ""
        self._content = ContentFilter()
        self._out = StreamDelta()
        self._frags: list[str] = []  # the arguments of _out's last item, joined when taken out
        self._n_calls = 0
        self._open: int | None = None  # index of the committed call whose arguments may grow
        self._open_args = False  # an arguments fragment was sent for the open call
        self._done = False
        self._mode = ""  # the subclass's state

    # -- the public interface ------------------------------------------------------------

    @property
    def called(self) -> bool:
        return self._n_calls > 0

    def feed(self, delta: str) -> StreamDelta:
        if self._done:
            raise RuntimeError("feed after finish")
        self._buf += delta
        self._run(final=False)
        return self._take_out()

    def finish(self) -> StreamDelta:
        if not self._done:
            self._run(final=True)
            self._content_upto(len(self._buf))  # every step decides when final: a guard, never text lost
            self._eof()
            self._emit_content(self._raw)
            self._raw = ""
            self._close_call()
            self._out.content += self._content.finish()
            self._done = True
        return self._take_out()

    def extract(self, text: str) -> ExtractedToolCalls:
        """The whole output, non-streamed: a fresh machine fed it at once (this one is untouched)."""
        p = self._fresh()
        deltas = [p.feed(text), p.finish()]
        calls: list[ToolCall] = []
        content = ""
        for d in deltas:
            content += d.content
            for t in d.tool_calls:
                if t.id is not None:
                    calls.append(ToolCall(t.id, t.name or "", t.arguments))
                else:
                    calls[t.index].arguments += t.arguments
        return ExtractedToolCalls(calls, content if content.strip() else None)

    # -- for subclasses ------------------------------------------------------------------

    def _fresh(self) -> ToolParser:
        return type(self)(self.tools)

    def _step(self, final: bool) -> bool:
        """Decide what the head of ``_buf`` is; False when that needs more text (never when final)."""
        raise NotImplementedError

    def _eof(self) -> None:
        """The output ended mid-structure (``_buf`` is empty): close what the mode has open."""

    def _run(self, final: bool) -> None:
        while self._buf and self._step(final):
            pass

    def _new_id(self) -> str:
        return "call_" + random_id(self.id_chars)

    def _take(self, n: int) -> str:
        """Consume the next n characters as call syntax (content again if the call breaks)."""
        text, self._buf = self._buf[:n], self._buf[n:]
        if self._open is None:
            self._raw += text
        return text

    def _take_ws(self) -> bool:
        """Consume leading whitespace; True when a non-space character follows in ``_buf``."""
        n = len(self._buf) - len(self._buf.lstrip())
        if n:
            self._take(n)
        return bool(self._buf)

    def _scan(self, obj: CallObject) -> str:
        """Feed ``_buf`` to a call object's scanner; returns its status."""
        before, was_open = self._n_calls, self._open is not None
        n = obj.feed(self._buf)
        text, self._buf = self._buf[:n], self._buf[n:]
        if self._n_calls == before and not was_open:
            self._raw += text  # not committed yet: content if the object breaks
        return obj.status

    def _call_step(self, obj: CallObject, after: str, broken: str) -> bool:
        """One step of a mode scanning a call object: the mode becomes ``after`` when it closed,
        ``broken`` when it broke (its text content, from the offending character on)."""
        status = self._scan(obj)
        if status == "done":
            self._close_call()
            self._mode = after
        elif status == "error":
            self._break()
            self._mode = broken
        return True

    def _emit_content(self, text: str) -> None:
        if text:
            self._out.content += self._content.text(text)

    def _content_upto(self, n: int) -> None:
        """The next n characters of ``_buf`` are content."""
        text, self._buf = self._buf[:n], self._buf[n:]
        self._emit_content(text)

    def _clean(self) -> None:
        """The call syntax consumed so far was well formed: it is not content."""
        self._raw = ""

    def _break(self) -> None:
        """What was consumed since the last commit is no call: it is content after all."""
        raw, self._raw = self._raw, ""
        self._close_call()
        self._emit_content(raw)

    def _commit(self, name: str) -> None:
        self._close_call()
        self._raw = ""
        self._content.call()
        self._open = self._n_calls
        self._open_args = False
        self._n_calls += 1
        self._join_frags()
        self._out.tool_calls.append(ToolCallDelta(self._open, id=self._new_id(), name=name))

    def _args(self, fragment: str) -> None:
        if not fragment or self._open is None:
            return
        self._open_args = True
        last = self._out.tool_calls[-1] if self._out.tool_calls else None
        if last is None or last.index != self._open:
            self._join_frags()
            self._out.tool_calls.append(ToolCallDelta(self._open))
        self._frags.append(fragment)  # one item per call per delta: fewer, larger items

    def _close_call(self) -> None:
        if self._open is None:
            return
        if not self._open_args:
            self._args("{}")  # a call without arguments still has an arguments object
        self._open = None

    def _join_frags(self) -> None:
        if self._frags:
            self._out.tool_calls[-1].arguments += "".join(self._frags)
            self._frags = []

    def _take_out(self) -> StreamDelta:
        self._join_frags()
        out, self._out = self._out, StreamDelta()
        return out


ARGS_KEYS = ("parameters", "arguments")  # where a JSON call object keeps its arguments


class ObjectCallsParser(ToolParser):
    """Calls as JSON objects one after another (``llama3_json``, ``required``'s array): mode
    ``plain`` once the rest is content, ``call`` while an object is scanned (``sep`` after
    it); a subclass reads what lies between the objects (``_between``)."""

    def __init__(self, tools: list[dict] | None = None) -> None:
        super().__init__(tools)
        self._mode = "start"
        self._obj = CallObject(self, ARGS_KEYS)

    def _step(self, final: bool) -> bool:
        if self._mode == "plain":
            self._content_upto(len(self._buf))
            return True
        if self._mode == "call":
            return self._call_step(self._obj, after="sep", broken="plain")
        return self._take_ws() and self._between(final)

    def _between(self, final: bool) -> bool:
        """The mode's step at the next non-blank character (``_buf[0]``)."""
        raise NotImplementedError

    def _open_call(self) -> None:
        self._obj = CallObject(self, ARGS_KEYS)
        self._mode = "call"

    def _to_content(self) -> None:
        self._break()
        self._mode = "plain"

    def _eof(self) -> None:
        if self._mode == "call":
            self._obj.eof()
