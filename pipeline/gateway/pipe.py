"""`pipeline run`: pipe mode. Gateway front end reading stdin, writing JSON lines to stdout.

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
(``batch``); a plain or JSON request line there, or a batch line in plain mode, gets an error
answer saying so.
Every line that is not empty gets exactly one final answer line (a RequestResult): an error
one (finish_reason "error") for a line that is not valid UTF-8, too long, not a valid
request, or over the byte limits of README.md "Limits". A request's id is its ``id``, else its
line's 0-based index; ids are unique within a run: a line reusing one is not run and gets an
error answer with that id and ``error.code == "duplicate_id"`` naming both lines' indices,
so the first line's answer is the only one under that id without that code.

Lines are submitted as they are read (bounded by ``--max-inflight`` so a huge file does not
sit in memory), so the engine stays busy while the input streams. Streaming requests
(``--stream`` for all, or ``"stream": true`` per line) also get delta lines (``id``,
``text``, ``token_ids``) as they come; ``--ordered`` writes final answers in input order.
Owns the output ordering buffer, the run's ids and the progress bar. Exit status: 0 if every
line got a successful answer, 1 if any failed (or a stage died, or stdin could not be read),
2 for a bad flag or an engine that could not start (both before reading any input), 130
after Ctrl-C/SIGTERM (in-flight requests drain, the rest get an "abort" answer).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import signal
import sys
import threading
import time
from collections.abc import Iterator
from typing import BinaryIO

import msgspec

from pipeline.config import add_engine_args, config_from_args
from pipeline.gateway.batch import MIXED, BatchLine, BatchLines, Refused, is_batch_line, output_line
from pipeline.gateway.gateway import Answer, Gateway
from pipeline.gateway.protocol import Generate, ProtocolError, gateway_request, request_from_json, sampling_params
from pipeline.messages import GatewayRequest, RequestDelta, RequestResult, error_result
from pipeline.messages.requests import MAX_PROMPT_BYTES
from pipeline.runtime.lifecycle import StartupError
from pipeline.sampling_params import SamplingParams

# Room for a maximal prompt in any JSON escaping (up to 6 bytes per byte, "\u0001").
MAX_LINE_BYTES = 8 * MAX_PROMPT_BYTES
BOM = "\ufeff"
_JSON_KINDS = {list: "array", str: "string", int: "number", float: "number", bool: "boolean",
               type(None): "null"}


def add_args(p: argparse.ArgumentParser) -> None:
    add_engine_args(p)
    p.add_argument("--ordered", action="store_true", help="write answers in input order")
    p.add_argument("--stream", action="store_true", help="stream every request: delta lines as they come")
    p.add_argument("--max-tokens", type=int, default=None,
                   help="default max_tokens for lines that do not set it")
    p.add_argument("--temperature", type=float, default=None,
                   help="default temperature for lines that do not set it")
    p.add_argument("--max-inflight", type=int, default=0,
                   help="requests submitted but not answered (0: 4 x --max-num-seqs)")
    p.add_argument("--drain-timeout", type=float, default=30.0,
                   help="on Ctrl-C/SIGTERM, seconds to let in-flight requests finish")
    p.add_argument("--stats-json", default=None, metavar="PATH",
                   help="write the engine's final stats (blocks, steps, overhead) to PATH")


def sampling_defaults(args: argparse.Namespace) -> dict:
    return {k: v for k, v in (("max_tokens", args.max_tokens),
                              ("temperature", args.temperature)) if v is not None}


def bad_flag(args: argparse.Namespace) -> str | None:
    """Why a pipe-mode flag value cannot work (checked before the model loads), if one can't."""
    if args.max_inflight < 0:
        return f"--max-inflight: must be >= 0 (0: 4 x --max-num-seqs), got {args.max_inflight}"
    if not 0 <= args.drain_timeout < math.inf:
        return f"--drain-timeout: must be a number of seconds >= 0, got {args.drain_timeout}"
    try:
        SamplingParams(**sampling_defaults(args)).validate()
    except ValueError as exc:  # "<field> must be <limit>, got <value>"
        name, _, rest = str(exc).partition(" ")
        return f"--{name.replace('_', '-')}: {rest}"
    return None


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


def parse_line(line: str, default_id: str, defaults: dict) -> tuple[GatewayRequest, bool]:
    """The request of one non-empty input line (``line_text``) and whether it named its id.
    RequestError for a line that is no request (its message names what is wrong)."""
    try:
        if line.startswith("{"):
            gen, sp = request_from_json(line, defaults)
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
    return req, gen.id is not None


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


class AnswerWriter:
    """Writes answers as JSON lines; maps internal ids (line numbers) back to the user's."""

    def __init__(self, out, ordered: bool, stream: bool, progress: bool,
                 stop: threading.Event) -> None:
        self.out = out
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
            self.emit(index, self.enc.encode(msgspec.structs.replace(out, id=user_id)),
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


def feed(gw: Gateway, writer: AnswerWriter, args, lines: Iterator[bytes | int],
         stop: threading.Event, max_inflight: int) -> None:
    defaults = sampling_defaults(args)
    ids = RunIds()
    decided = False  # the first non-empty line decides whether this is an OpenAI batch input
    batch: BatchLines | None = None

    def refuse(index: int, rid: str, code: str, message: str) -> None:
        if batch is not None:
            writer.answer_line(index, output_line(None, error={"code": code, "message": message}), True)
        else:
            writer(error_result(writer.expect(index, rid), code, message))

    def submit(req: GatewayRequest) -> bool:
        """False once the gateway refuses every request (a refused one got its answer)."""
        with writer.lock:
            while writer.submitted - writer.done > max_inflight and not stop.is_set():
                writer.all_done.wait(0.2)
        if not gw.submit(req) and (gw.failure is not None or not gw.accepting):
            stop.set()
            return False
        return True

    for index, raw in enumerate(lines):
        if stop.is_set():
            break
        try:
            text = line_text(raw)
            if not text:
                writer.skip(index)
                continue
            if not decided:
                decided = True
                if is_batch_line(text):
                    assert gw.model is not None  # started
                    batch = writer.batch = BatchLines(gw.config.model, gw.model, gw.model.max_model_len)
            if batch is not None:
                line = batch.parse(index, text, defaults)
            elif is_batch_line(text):
                raise RequestError(f"line: an OpenAI batch line in an input of plain or JSON "
                                   f"request lines; {MIXED}")
            else:
                req, named = parse_line(text, str(index), defaults)
        except Refused as exc:
            writer.answer_line(index, exc.line, True)
            continue
        except RequestError as exc:
            refuse(index, exc.req_id or str(index), "invalid_request", str(exc))
            continue
        except Exception as exc:  # noqa: BLE001 - one line must not stop the reader
            refuse(index, str(index), "invalid_request", f"line: cannot be read as a request: "
                                                         f"{type(exc).__name__}: {exc}")
            continue
        if batch is not None:
            writer.expect_batch(index, line)
            for k, req in enumerate(line.requests):
                if not submit(req):
                    for rest in line.requests[k + 1:]:  # so the line still gets its answer
                        writer(error_result(rest.req_id, "unavailable", "not submitted: the server "
                                                                        "stopped accepting requests"))
                    return
            continue
        first = ids.claim(req.req_id, index, named)
        if first is not None:
            refuse(index, req.req_id, "duplicate_id",
                   f"id: {req.req_id!r} is already the id of the line at index {first}; ids are "
                   f"unique within a run, so this line (index {index}) was not run")
            continue
        req.req_id = writer.expect(index, req.req_id)
        req.stream = req.stream or writer.stream
        if not submit(req):
            break


def read_stdin(gw: Gateway, writer: AnswerWriter, args, stop: threading.Event,
               max_inflight: int, failed: list[str]) -> None:
    """The reader thread: feed stdin's lines; a read error ends the input (said in ``failed``)."""
    try:
        feed(gw, writer, args, read_lines(sys.stdin.buffer), stop, max_inflight)
    except Exception as exc:  # noqa: BLE001 - e.g. EIO on a terminal: the run still ends
        failed.append(f"cannot read stdin: {type(exc).__name__}: {exc}")


def main(args: argparse.Namespace) -> int:
    problem = bad_flag(args)
    if problem is not None:
        print(f"pipeline run: {problem}", file=sys.stderr)
        return 2
    try:
        cfg = config_from_args(args)  # engine flags, checked before anything starts
    except ValueError as exc:
        print(f"pipeline run: cannot start: {exc}", file=sys.stderr)
        return 2
    progress = sys.stderr.isatty()
    stop = threading.Event()
    writer = AnswerWriter(sys.stdout.buffer, args.ordered, args.stream, progress, stop)
    gw = Gateway(cfg, writer)
    try:
        gw.start()
    except (StartupError, ValueError, OSError) as exc:
        print(f"pipeline run: cannot start: {exc}", file=sys.stderr)
        gw.close()
        return 2
    interrupted = threading.Event()

    def on_signal(signum, frame) -> None:
        interrupted.set()
        stop.set()

    old = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    read_failed: list[str] = []
    reader = threading.Thread(target=read_stdin, name="pipe-reader", daemon=True,
                              args=(gw, writer, args, stop,
                                    args.max_inflight or 4 * cfg.max_num_seqs, read_failed))
    try:
        reader.start()
        while reader.is_alive() and not stop.is_set():
            reader.join(0.2)
        writer.wait_all(stop, gw.failed)  # stop: Ctrl-C, SIGTERM or stdout closed
        if writer.broken:
            print("pipeline run: stdout was closed; aborting the remaining requests",
                  file=sys.stderr)
            gw.drain(0.0, "aborted by pipeline run: its stdout was closed")
        elif interrupted.is_set():
            print(f"\npipeline run: interrupted, draining (up to {args.drain_timeout:.0f}s)",
                  file=sys.stderr)
            gw.drain(args.drain_timeout, "aborted by pipeline run: interrupted (SIGINT/SIGTERM) "
                                         "and the drain timed out")
        writer.wait_all(gw.failed)
        if args.stats_json and gw.failure is None:
            with open(args.stats_json, "w") as f:
                json.dump(gw.fresh_engine_stats(2.0).as_dict(), f)
    finally:
        for s, h in old.items():
            signal.signal(s, h)
        gw.close()
        if progress:
            sys.stderr.write("\n")
    for why in read_failed:
        print(f"pipeline run: {why}", file=sys.stderr)
    if gw.failure is not None:
        print(f"pipeline run: {gw.failure}", file=sys.stderr)
        return 1
    if interrupted.is_set():
        return 130  # as a shell reports a run stopped by Ctrl-C
    if writer.broken or read_failed:
        return 1
    return 1 if writer.failed else 0
