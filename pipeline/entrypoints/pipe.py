"""`pipeline run`: pipe mode. Gateway front end reading stdin, writing JSON lines to stdout.

Each stdin line is a plain prompt or a JSON object (``id``, ``prompt`` | ``prompt_token_ids``
| ``messages``, sampling fields). Lines are submitted as they are read (bounded by
``--max-inflight`` so a huge file does not sit in memory), so the engine stays busy while the
input streams. Each answer is one JSON line (RequestResult); ``--stream`` also writes the
deltas; ``--ordered`` writes answers in input order. Owns the output ordering buffer and the
progress bar. Exit status 1 if any request failed, 2 if the engine could not start.
"""
from __future__ import annotations

import argparse
import signal
import sys
import threading
import time

import msgspec

from pipeline.config import add_engine_args, config_from_args
from pipeline.entrypoints.gateway import Answer, Gateway, StartupError
from pipeline.entrypoints.tokenizer_stage import GatewayRequest
from pipeline.output.stage import error_result
from pipeline.output.types import RequestDelta
from pipeline.sampling_params import SamplingParams

_REQUEST_FIELDS = {"id", "prompt", "prompt_token_ids", "messages", "stream", "priority",
                   "cache_salt"}
_SAMPLING_FIELDS = set(SamplingParams.__struct_fields__)
MAX_LINE_BYTES = 8 << 20


def add_args(p: argparse.ArgumentParser) -> None:
    add_engine_args(p)
    p.add_argument("--ordered", action="store_true", help="write answers in input order")
    p.add_argument("--stream", action="store_true", help="also write deltas as they come")
    p.add_argument("--max-tokens", type=int, default=None,
                   help="default max_tokens for lines that do not set it")
    p.add_argument("--temperature", type=float, default=None,
                   help="default temperature for lines that do not set it")
    p.add_argument("--max-inflight", type=int, default=0,
                   help="requests submitted but not answered (0: 4 x --max-num-seqs)")
    p.add_argument("--drain-timeout", type=float, default=30.0,
                   help="on Ctrl-C/SIGTERM, seconds to let in-flight requests finish")


class RequestError(ValueError):
    def __init__(self, message: str, req_id: str | None = None) -> None:
        super().__init__(message)
        self.req_id = req_id


def parse_line(line: str, default_id: str, defaults: dict) -> GatewayRequest:
    """A plain prompt, or a JSON object with the request and sampling fields."""
    now = time.time()
    if len(line) > MAX_LINE_BYTES:
        raise RequestError(f"line: at most {MAX_LINE_BYTES} bytes, got {len(line)}")
    if not line.startswith("{"):
        return GatewayRequest(req_id=default_id, prompt=line, arrival_time=now,
                              sampling_params=SamplingParams(**defaults))
    try:
        obj = msgspec.json.decode(line)
    except msgspec.DecodeError as exc:
        raise RequestError(f"line: not valid JSON ({exc})") from None
    if not isinstance(obj, dict):
        raise RequestError("line: a JSON line must be an object")
    rid = obj.get("id", default_id)
    if not isinstance(rid, (str, int)) or isinstance(rid, bool) or str(rid) == "":
        raise RequestError(f"id: must be a non-empty string or an integer, got {rid!r}")
    rid = str(rid)
    unknown = sorted(set(obj) - _REQUEST_FIELDS - _SAMPLING_FIELDS)
    if unknown:
        raise RequestError(f"{unknown[0]}: unknown field", rid)
    try:
        sp = msgspec.convert(defaults | {k: v for k, v in obj.items() if k in _SAMPLING_FIELDS},
                             SamplingParams)
        fields = {k: v for k, v in obj.items() if k in _REQUEST_FIELDS and k != "id"}
        return msgspec.convert(fields | {"req_id": rid, "sampling_params": sp,
                                         "arrival_time": now}, GatewayRequest)
    except msgspec.ValidationError as exc:
        raise RequestError(str(exc), rid) from None


class AnswerWriter:
    """Writes answers as JSON lines; maps internal ids (line numbers) back to the user's."""

    def __init__(self, out, ordered: bool, stream: bool, progress: bool) -> None:
        self.out = out
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
            if isinstance(out, RequestDelta):
                if self.stream:
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
                while self.next_index in self.pending:
                    self._write(self.pending.pop(self.next_index))
                    self.next_index += 1
            if self.progress:
                rate = self.tokens / max(time.monotonic() - self.t0, 1e-9)
                sys.stderr.write(f"\r{self.done}/{self.submitted} done, {self.failed} failed, "
                                 f"{rate:.0f} tok/s ")
                sys.stderr.flush()
            self.all_done.notify_all()

    def _write(self, line: bytes) -> None:
        self.out.write(line + b"\n")
        self.out.flush()

    def skip(self, index: int) -> None:
        """Input index that produced no request (blank line): keep --ordered moving."""
        with self.lock:
            self.pending[index] = b""
            while self.next_index in self.pending:
                line = self.pending.pop(self.next_index)
                if line:
                    self._write(line)
                self.next_index += 1

    def wait_all(self, stop: threading.Event) -> None:
        with self.lock:
            while self.done < self.submitted and not stop.is_set():
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
        with writer.lock:
            while writer.submitted - writer.done > max_inflight and not stop.is_set():
                writer.all_done.wait(0.2)
        if not gw.submit(req):
            stop.set()  # the gateway answered it with the reason; nothing more can run
            break


def main(args: argparse.Namespace) -> int:
    cfg = config_from_args(args)
    progress = sys.stderr.isatty()
    writer = AnswerWriter(sys.stdout.buffer, args.ordered, args.stream, progress)
    gw = Gateway(cfg, writer)
    try:
        gw.start()
    except (StartupError, ValueError, OSError) as exc:
        print(f"pipeline run: cannot start: {exc}", file=sys.stderr)
        gw.close()
        return 2
    stop = threading.Event()
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
        if interrupted.is_set():
            print(f"\npipeline run: interrupted, draining (up to {args.drain_timeout:.0f}s)",
                  file=sys.stderr)
            gw.drain(args.drain_timeout)
        else:
            reader.join()
        writer.wait_all(gw.failed)
    finally:
        for s, h in old.items():
            signal.signal(s, h)
        gw.close()
        if progress:
            sys.stderr.write("\n")
    if gw.failure is not None:
        print(f"pipeline run: {gw.failure}", file=sys.stderr)
        return 1
    return 1 if writer.failed else 0
