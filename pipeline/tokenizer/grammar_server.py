"""Tokenizer stage: structured-outputs specs compiled once each, under a time budget, in
child processes.

An xgrammar compile cannot be interrupted in its thread and some 60-byte specs compile for
minutes, so each compile runs in a child process (``python -m
pipeline.tokenizer.grammar_server``: it loads xgrammar and the model's tokenizer, then
answers one spec at a time over its stdin/stdout) that is killed once the compile has run
``COMPILE_BUDGET_S``; the next compile starts a fresh one. The outcome (the compiled grammar
as ``structured_outputs.to_bytes`` made it, or the refusal naming ``structured_outputs.<kind>``)
is kept per spec, so a spec compiles once: a repeat, even of one refused for the budget, is
answered from the cache, and requests for a spec being compiled wait for that compile.

At most ``COMPILE_PROCESSES`` compiles run at once (a request waits for a free process:
bounded by the budget times the grammars ahead of it); the stage runs grammar requests on
their own threads, so none of this delays a request without a grammar.

Owns: the compile processes (each started on first use and after a kill; a child dies with
the thread that started it, PR_SET_PDEATHSIG, and on its stdin's end), the outcomes
(spec key -> bytes or refusal, least recently used dropped past ``CACHE_BYTES``) and the
compiles in flight. Thread-safe.
"""
from __future__ import annotations

import json
import os
import queue
import select
import signal
import struct
import subprocess
import sys
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future
from pathlib import Path

import msgspec

from pipeline.sampling_params.structured import StructuredOutputsParams
from pipeline.structured_outputs import CACHE_BYTES, COMPILE_BUDGET_S, GrammarError, spec_key

COMPILE_PROCESSES = 2
START_TIMEOUT_S = 300.0  # loading xgrammar and the tokenizer (2.3 s for the default model)
_LEN = struct.Struct("<I")


class _Timeout(Exception):
    pass


def _read_exact(fd: int, n: int, deadline: float | None) -> bytes:
    """``n`` bytes from ``fd``; _Timeout past ``deadline`` (monotonic), EOFError at its end."""
    out = bytearray()
    while len(out) < n:
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                raise _Timeout
        chunk = os.read(fd, n - len(out))
        if not chunk:
            raise EOFError
        out += chunk
    return bytes(out)


def _read_frame(fd: int, deadline: float | None) -> bytes:
    (n,) = _LEN.unpack(_read_exact(fd, _LEN.size, deadline))
    return _read_exact(fd, n, deadline)


def _write_frame(f, data: bytes) -> None:
    f.write(_LEN.pack(len(data)) + data)
    f.flush()


class _Child:
    """One compile process, started when first needed."""

    def __init__(self, argv: list[str]) -> None:
        self.argv = argv
        self.proc: subprocess.Popen | None = None

    def _start(self) -> subprocess.Popen:
        env = dict(os.environ)  # the child imports this tree's pipeline, as the stage did
        root = str(Path(__file__).resolve().parents[2])
        env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
        proc = subprocess.Popen(self.argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env)
        assert proc.stdout is not None
        try:
            if _read_frame(proc.stdout.fileno(), time.monotonic() + START_TIMEOUT_S) != b"ready":
                raise EOFError
        except (EOFError, _Timeout):
            self.kill(proc)
            raise RuntimeError(f"the grammar compile process did not start (exit code {proc.poll()})") from None
        return proc

    def compile(self, spec: bytes, budget_s: float) -> list:
        """[True, grammar bytes] or [False, refusal]; _Timeout (the process killed) past
        ``budget_s``; RuntimeError if the process died twice. Once is not the spec's doing
        for sure: a process dies with the thread that started it (PR_SET_PDEATHSIG), and a
        thread may end between two compiles, so a death is tried again on a fresh process."""
        for attempt in (1, 2):
            if self.proc is None or self.proc.poll() is not None:
                self.proc = self._start()
            proc = self.proc
            assert proc.stdin is not None and proc.stdout is not None
            try:
                _write_frame(proc.stdin, spec)
                return msgspec.msgpack.decode(_read_frame(proc.stdout.fileno(), time.monotonic() + budget_s))
            except _Timeout:
                self.kill(proc)
                raise
            except (EOFError, BrokenPipeError):
                self.kill(proc)
                if attempt == 2:
                    raise RuntimeError(f"the grammar compile process died (exit code "
                                       f"{proc.returncode})") from None
        raise AssertionError("unreachable")

    def kill(self, proc: subprocess.Popen | None = None) -> None:
        proc = proc or self.proc
        if proc is not None:
            proc.kill()
            proc.wait()
            for f in (proc.stdin, proc.stdout):
                if f is not None:
                    f.close()
        if proc is self.proc:
            self.proc = None


class GrammarService:
    def __init__(self, model_dir: str | Path, vocab_size: int, stop_token_ids: list[int],
                 processes: int = COMPILE_PROCESSES, budget_s: float = COMPILE_BUDGET_S) -> None:
        argv = [sys.executable, "-m", "pipeline.tokenizer.grammar_server", str(model_dir),
                str(vocab_size), json.dumps(list(stop_token_ids))]
        self.budget_s = budget_s
        self._children = [_Child(argv) for _ in range(processes)]
        self._idle: queue.SimpleQueue[_Child] = queue.SimpleQueue()
        for c in self._children:
            self._idle.put(c)
        self._lock = threading.Lock()
        self._done: OrderedDict[bytes, bytes | str] = OrderedDict()
        self._done_bytes = 0
        self._inflight: dict[bytes, Future] = {}
        self.compiles = 0  # compiles run in a child (cache hits and joined ones not counted)

    def compile(self, so: StructuredOutputsParams) -> bytes:
        """``so`` compiled (``structured_outputs.to_bytes``); GrammarError naming the field
        when xgrammar refuses it or it did not compile within the budget."""
        key = spec_key(so)
        with self._lock:
            out = self._done.get(key)
            if out is not None:
                self._done.move_to_end(key)
                return _outcome(out)
            fut = self._inflight.get(key)
            owner = fut is None
            if fut is None:
                fut = self._inflight[key] = Future()
        if not owner:
            return _outcome(fut.result())
        try:
            out = self._run(so)
        except BaseException as exc:
            with self._lock:
                del self._inflight[key]
            fut.set_exception(exc)
            raise
        with self._lock:
            del self._inflight[key]
            self._keep(key, out)
        fut.set_result(out)
        return _outcome(out)

    def _run(self, so: StructuredOutputsParams) -> bytes | str:
        child = self._idle.get()
        try:
            with self._lock:
                self.compiles += 1
            ok, payload = child.compile(msgspec.msgpack.encode(so), self.budget_s)
            return payload if ok else str(payload)
        except _Timeout:
            return (f"structured_outputs.{so.kind}: did not compile within {self.budget_s:g} s, the "
                    f"limit for compiling a grammar (nested repetitions such as (x{{1,12}}){{1,12}} "
                    f"compile in exponential time)")
        except RuntimeError as exc:  # not the spec's fault, as far as we know: not kept
            raise GrammarError(f"structured_outputs.{so.kind}: {exc}") from None
        finally:
            self._idle.put(child)

    def _keep(self, key: bytes, out: bytes | str) -> None:
        self._done[key] = out
        self._done_bytes += len(out)
        while self._done_bytes > CACHE_BYTES and len(self._done) > 1:
            self._done_bytes -= len(self._done.popitem(last=False)[1])

    def close(self) -> None:
        for c in self._children:
            c.kill()


def _outcome(out: bytes | str) -> bytes:
    if isinstance(out, str):
        raise GrammarError(out)
    return out


def _die_with_parent() -> None:
    from pipeline.ipc.prctl import PR_SET_PDEATHSIG, prctl
    prctl(PR_SET_PDEATHSIG, signal.SIGKILL)  # not Linux: stdin's end still stops it


def main(argv: list[str]) -> None:
    """The child: compile each spec read from stdin, answer on stdout, until stdin ends."""
    _die_with_parent()
    # Frames go out on a copy of stdout; fd 1 is stderr from here on, so nothing another
    # library prints can break a frame.
    fout = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)
    from pipeline.structured_outputs import Grammars, to_bytes
    model_dir, vocab_size, stops = argv
    # One core at a low priority: a compile takes what the serving stages leave (xgrammar's
    # second thread gained nothing on the schema: 8.2-8.7 s alone, 9.2-10.3 s with it).
    os.nice(10)
    grammars = Grammars(model_dir, int(vocab_size), json.loads(stops), max_threads=1)
    fin = sys.stdin.buffer.fileno()
    _write_frame(fout, b"ready")
    while True:
        try:
            so = msgspec.msgpack.decode(_read_frame(fin, None), type=StructuredOutputsParams)
        except EOFError:
            return
        try:
            out = [True, to_bytes(grammars.compile(so))]
        except GrammarError as exc:
            out = [False, str(exc)]
        _write_frame(fout, msgspec.msgpack.encode(out))


if __name__ == "__main__":
    main(sys.argv[1:])
