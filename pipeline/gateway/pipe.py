"""`pipeline run`: pipe mode. Gateway front end reading stdin, writing JSON lines to stdout.

Input lines and what each is: ``gateway.pipe_input``; answer lines: ``gateway.pipe_output``.
Every line that is not empty gets exactly one final answer line.

Lines are submitted as they are read (bounded by ``--max-inflight`` so a huge file does not
sit in memory), so the engine stays busy while the input streams. Streaming requests
(``--stream`` for all, or ``"stream": true`` per line) also get delta lines (``id``,
``text``, ``token_ids``) as they come; ``--ordered`` writes final answers in input order.
Owns the run: its reader thread and the end of the run (drain, exit status). Exit status: 0 if every
line got a successful answer, 1 if any failed (or a stage died, or stdin could not be read),
2 for a bad flag or an engine that could not start (both before reading any input), 130
after Ctrl-C/SIGTERM (in-flight requests drain, the rest get an "abort" answer).
"""
from __future__ import annotations

import argparse
import json
import math
import signal
import sys
import threading
from collections.abc import Iterator

from pipeline.chat_parse import ChatParsers
from pipeline.engine_args import add_engine_args, config_from_args
from pipeline.gateway.batch import MIXED, BatchLines, Refused, is_batch_line, output_line
from pipeline.gateway.gateway import Gateway
from pipeline.gateway.pipe_chat import PipeChats
from pipeline.gateway.pipe_input import RequestError, RunIds, line_text, parse_line, read_lines
from pipeline.gateway.pipe_output import AnswerWriter
from pipeline.ipc.prctl import name_process
from pipeline.messages import GatewayRequest, error_result
from pipeline.runtime.lifecycle import StartupError
from pipeline.runtime.rings import message_limits
from pipeline.sampling_params import SamplingParams


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
                    batch = writer.batch = BatchLines(
                        gw.config.model_config.model, gw.model, gw.model.max_model_len,
                        message_limits(gw.config, gw.model.max_model_len)["answers"],
                        ChatParsers.of(gw.config.model_config))
            if batch is not None:
                line = batch.parse(index, text, defaults)
            elif is_batch_line(text):
                raise RequestError(f"line: an OpenAI batch line in an input of plain or JSON "
                                   f"request lines; {MIXED}")
            else:
                req, named, tool_fields = parse_line(text, str(index), defaults)
                try:
                    writer.chats.prepare(req, tool_fields, str(index))
                except ValueError as exc:
                    raise RequestError(str(exc), req.req_id) from None
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
            writer.chats.drop(str(index))
            refuse(index, req.req_id, "duplicate_id",
                   f"id: {req.req_id!r} is already the id of the line at index {first}; ids are "
                   f"unique within a run, so this line (index {index}) was not run")
            continue
        req.req_id = writer.expect(index, req.req_id)
        req.stream = req.stream or writer.stream
        if not submit(req):
            break


def read_stdin(gw: Gateway, writer: AnswerWriter, args, stop: threading.Event,
               max_inflight: int, failed: list[str], fed: threading.Event) -> None:
    """The reader thread: feed stdin's lines; a read error ends the input (said in
    ``failed``). Sets ``fed`` when it ends."""
    try:
        feed(gw, writer, args, read_lines(sys.stdin.buffer), stop, max_inflight)
    except Exception as exc:  # noqa: BLE001 - e.g. EIO on a terminal: the run still ends
        failed.append(f"cannot read stdin: {type(exc).__name__}: {exc}")
    finally:
        fed.set()


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
    name_process("gateway")  # pipe mode's main process owns the stages as `serve`'s does
    progress = sys.stderr.isatty()
    stop = threading.Event()
    writer = AnswerWriter(sys.stdout.buffer, args.ordered, args.stream, progress, stop,
                          PipeChats(ChatParsers.of(cfg.model_config)))
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
    # The reader says itself when it ended: Thread.join is not trusted for that (on Python
    # 3.11 a signal handler's exception raised inside join() can mark a live thread ended,
    # bpo-45274), and the gateway must not close under a reader still submitting.
    fed = threading.Event()
    reader = threading.Thread(target=read_stdin, name="pipe-reader", daemon=True,
                              args=(gw, writer, args, stop,
                                    args.max_inflight or 4 * cfg.scheduler_config.max_num_seqs, read_failed, fed))
    try:
        reader.start()
        while not fed.wait(0.2) and not stop.is_set():
            pass
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
