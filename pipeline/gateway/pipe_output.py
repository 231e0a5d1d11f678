"""Pipe mode's output: every answer as a JSON line on stdout, in input order with
``--ordered``; the progress line on a terminal's stderr.

An answer's id is the user's (its line's ``id``, else its index: internal ids are line
indices); streaming requests also get delta lines. An OpenAI batch input's answers are batch
output lines (``gateway.batch``). When stdout is gone (``pipeline run ... | head -1``) the
writer drops what is left and sets the run's stop event.
Owns: the output ordering buffer, the map of internal ids to the user's, the run's counts.
"""
from __future__ import annotations

import os
import sys
import threading
import time

import msgspec

from pipeline.chat_parse import ChatParsers
from pipeline.gateway.batch import BatchLine, BatchLines
from pipeline.gateway.gateway import Answer
from pipeline.gateway.pipe_chat import PipeChats
from pipeline.messages import RequestDelta, RequestResult


class AnswerWriter:
    """Writes answers as JSON lines; maps internal ids (line numbers) back to the user's."""

    def __init__(self, out, ordered: bool, stream: bool, progress: bool,
                 stop: threading.Event, chats: PipeChats | None = None) -> None:
        self.out = out
        self.chats = chats or PipeChats(ChatParsers())  # chat lines' tool calls and reasoning
        self.stop = stop  # set when stdout is gone: nobody reads the answers any more
        self.broken = False
        self.ordered = ordered
        self.stream = stream
        self.progress = progress
        self.user_ids: dict[str, str] = {}
        self.pending: dict[int, bytes] = {}
        self.next_index = 0
        self.submitted = 0
        self.done = 0
        self.failed = 0
        self.tokens = 0
        self.t0 = time.monotonic()
        self.lock = threading.Lock()
        self.all_done = threading.Condition(self.lock)
        self.enc = msgspec.json.Encoder()
        self.batch: BatchLines | None = None  # an OpenAI batch input's lines in flight

    def expect(self, index: int, user_id: str) -> str:
        with self.lock:
            self.user_ids[str(index)] = user_id
            self.submitted += 1
        return str(index)

    def expect_batch(self, index: int, line: BatchLine) -> None:
        with self.lock:
            assert self.batch is not None
            self.batch.start(index, line)
            self.submitted += len(line.requests)

    def answer_line(self, index: int, line: bytes, failed: bool) -> None:
        """An answer line of input line ``index`` that ran no request."""
        with self.lock:
            self.submitted += 1
            self.done += 1
            self.emit(index, line, failed)

    def __call__(self, out: Answer) -> None:
        with self.lock:
            if self.batch is not None and isinstance(out, RequestResult) and self.batch.owns(out.id):
                self.done += 1
                self.tokens += len(out.token_ids)
                if (done := self.batch.finish(out)) is not None:
                    self.emit(*done[:2], not done[2])
                return
            user_id = self.user_ids.get(out.id, out.id)
            if isinstance(out, RequestDelta):  # only requests that asked to stream get them
                self._write(self.enc.encode(msgspec.structs.replace(out, id=user_id)))
                return
            index = int(out.id)
            del self.user_ids[out.id]
            self.done += 1
            self.tokens += len(out.token_ids)
            answer = msgspec.structs.replace(out, id=user_id)
            parsed = self.chats.result(out)
            self.emit(index, self.enc.encode(answer if parsed is None else msgspec.to_builtins(answer) | parsed),
                      out.finish_reason == "error")

    def emit(self, index: int, line: bytes, failed: bool) -> None:
        """Input line ``index``'s one answer line (the lock held)."""
        self.failed += failed
        if not self.ordered:
            self._write(line)
        else:
            self.pending[index] = line
            self._flush_ordered()
        if self.progress:
            rate = self.tokens / max(time.monotonic() - self.t0, 1e-9)
            sys.stderr.write(f"\r{self.done}/{self.submitted} done, {self.failed} failed, "
                             f"{rate:.0f} tok/s ")
            sys.stderr.flush()
        self.all_done.notify_all()

    def _write(self, line: bytes) -> None:
        if self.broken:
            return
        try:
            self.out.write(line + b"\n")
            self.out.flush()
        except (BrokenPipeError, ValueError):  # e.g. `pipeline run ... | head -1`
            self.broken = True
            # Later flushes (also Python's at exit) must not raise again.
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, self.out.fileno())
            os.close(devnull)
            self.stop.set()

    def _flush_ordered(self) -> None:
        while self.next_index in self.pending:
            line = self.pending.pop(self.next_index)
            if line:  # b"": a blank input line, which has no answer
                self._write(line)
            self.next_index += 1

    def skip(self, index: int) -> None:
        """Input index that produced no request (blank line): keep --ordered moving."""
        with self.lock:
            self.pending[index] = b""
            self._flush_ordered()

    def wait_all(self, *events: threading.Event) -> None:
        """Until every submitted request is answered or one of ``events`` is set."""
        with self.lock:
            while self.done < self.submitted and not any(e.is_set() for e in events):
                self.all_done.wait(0.2)
