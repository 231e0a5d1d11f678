"""`pipeline run`: pipe mode. Gateway front end reading stdin, writing JSON lines to stdout.

Each stdin line is a plain prompt or a JSON object (``id``, ``prompt`` | ``prompt_token_ids``
| ``messages``, sampling fields). Lines are submitted as they are read (bounded by
``--max-inflight`` so a huge file does not sit in memory), so the engine stays busy while the
input streams. Each answer is one JSON line (RequestResult); streaming requests (``--stream``
for all, or ``"stream": true`` per line) also get delta lines (``id``, ``text``,
``token_ids``) as they come; ``--ordered`` writes final answers in input order. Owns the output ordering buffer and the
progress bar. Exit status 1 if any request failed or a stage died, 2 if the engine could not
start, 130 after Ctrl-C/SIGTERM (in-flight requests drain, the rest get an "abort" answer).
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
import time

import msgspec

from pipeline.config import add_engine_args, config_from_args
from pipeline.gateway.gateway import Answer, Gateway
from pipeline.gateway.protocol import Generate, ProtocolError, gateway_request, request_from_json, sampling_params
from pipeline.gateway.supervisor import StartupError
from pipeline.messages import GatewayRequest, RequestDelta, error_result

MAX_LINE_BYTES = 8 << 20


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


def parse_line(line: str, default_id: str, defaults: dict) -> GatewayRequest:
    """A plain prompt, or a JSON object parsed by the protocol's shared request parser."""
    if len(line) > MAX_LINE_BYTES:
        raise RequestError(f"line: at most {MAX_LINE_BYTES} bytes, got {len(line)}")
    try:
        if line.startswith("{"):
            gen, sp = request_from_json(line, defaults)
        else:
            gen = Generate(prompt=line)
            sp = sampling_params(gen, defaults)
    except ProtocolError as exc:
        raise RequestError(str(exc), exc.req_id or _loose_id(line)) from None
    return gateway_request(gen, sp, default_id if gen.id is None else str(gen.id))


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

    def expect(self, index: int, user_id: str) -> str:
        with self.lock:
            self.user_ids[str(index)] = user_id
            self.submitted += 1
        return str(index)

    def __call__(self, out: Answer) -> None:
        with self.lock:
            user_id = self.user_ids.get(out.id, out.id)
            if isinstance(out, RequestDelta):  # only requests that asked to stream get them
                self._write(self.enc.encode(msgspec.structs.replace(out, id=user_id)))
                return
            index = int(out.id)
            del self.user_ids[out.id]
            self.done += 1
            self.tokens += len(out.token_ids)
            self.failed += out.finish_reason == "error"
            line = self.enc.encode(msgspec.structs.replace(out, id=user_id))
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


def feed(gw: Gateway, writer: AnswerWriter, args, lines, stop: threading.Event,
         max_inflight: int) -> None:
    defaults = {k: v for k, v in (("max_tokens", args.max_tokens),
                                  ("temperature", args.temperature)) if v is not None}
    for index, raw in enumerate(lines):
        if stop.is_set():
            break
        line = raw.strip()
        if not line:
            writer.skip(index)
            continue
        try:
            req = parse_line(line, str(index), defaults)
        except RequestError as exc:
            rid = writer.expect(index, exc.req_id or str(index))
            writer(error_result(rid, "invalid_request", str(exc)))
            continue
        user_id = req.req_id
        req.req_id = writer.expect(index, user_id)
        req.stream = req.stream or writer.stream
        with writer.lock:
            while writer.submitted - writer.done > max_inflight and not stop.is_set():
                writer.all_done.wait(0.2)
        if not gw.submit(req):
            stop.set()  # the gateway answered it with the reason; nothing more can run
            break


def main(args: argparse.Namespace) -> int:
    cfg = config_from_args(args)
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
    reader = threading.Thread(target=feed, name="pipe-reader", daemon=True,
                              args=(gw, writer, args, sys.stdin, stop,
                                    args.max_inflight or 4 * cfg.max_num_seqs))
    try:
        reader.start()
        while reader.is_alive() and not stop.is_set():
            reader.join(0.2)
        writer.wait_all(stop, gw.failed)  # stop: Ctrl-C, SIGTERM or stdout closed
        if writer.broken:
            print("pipeline run: stdout was closed; aborting the remaining requests",
                  file=sys.stderr)
            gw.drain(0.0)
        elif interrupted.is_set():
            print(f"\npipeline run: interrupted, draining (up to {args.drain_timeout:.0f}s)",
                  file=sys.stderr)
            gw.drain(args.drain_timeout)
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
    if gw.failure is not None:
        print(f"pipeline run: {gw.failure}", file=sys.stderr)
        return 1
    if interrupted.is_set():
        return 130  # as a shell reports a run stopped by Ctrl-C
    if writer.broken:
        return 1
    return 1 if writer.failed else 0
