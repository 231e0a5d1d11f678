"""``Client``: the thread-safe client of ``pipeline serve`` (see the package docstring).

Owns one DEALER socket and its monitor, kept by a background I/O thread (ZMQ sockets are not
thread-safe) and fed through a queue plus a wake-up pipe, so any number of threads may call
it; replies are routed by wire id (``base.Inflight``) to per-request queues.
"""
from __future__ import annotations

import collections
import math
import os
import queue
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from types import EllipsisType
from typing import Any, cast

import msgspec
import zmq
from zmq.utils.monitor import parse_monitor_message

from pipeline.client.base import (
    CLOSED,
    DEFAULT_CONNECT_TIMEOUT_S,
    DEFAULT_TIMEOUT_S,
    Connection,
    Inflight,
    RequestError,
    check_user_id,
    closed_answer,
    for_caller,
    generate_frame,
    new_socket,
    route,
)
from pipeline.frontend import protocol as P
from pipeline.messages import ErrorInfo, RequestDelta, RequestResult, error_result

__all__ = ["Client", "RequestError"]

_Backlog = collections.deque[tuple[str | None, bytes]]  # (wire id of a request, frame) not sent yet


def _monitor_event(mon: zmq.Socket) -> int | None:
    try:
        return parse_monitor_message(mon.recv_multipart(zmq.NOBLOCK))["event"]
    except zmq.Again:
        return None


class Client:
    """Thread-safe synchronous client. Use as a context manager or call ``close()``."""

    def __init__(self, address: str, timeout: float | None = DEFAULT_TIMEOUT_S, *,
                 connect_timeout: float | None = DEFAULT_CONNECT_TIMEOUT_S,
                 curve_server_key: bytes | str | Path | None = None,
                 curve_keys_dir: str | Path | None = None) -> None:
        self.timeout = timeout
        self._ctx = zmq.Context()
        try:
            self._sock, self._mon = new_socket(self._ctx, address, curve_keys_dir, curve_server_key)
        except BaseException:
            self._ctx.term()
            raise
        self._conn = Connection(address, connect_timeout)
        self._out: queue.SimpleQueue[tuple[str | None, bytes]] = queue.SimpleQueue()
        self._reqs = Inflight()
        self._lock = threading.Lock()  # self._reqs and the closed flag
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_w, False)
        self._closed = False
        self._io = threading.Thread(target=self._io_loop, name="pipeline-client-io", daemon=True)
        self._io.start()

    # -- public API ---------------------------------------------------------------------
    def generate(self, prompt: str | None = None, *, id: str | None = None,
                 timeout: float | None | EllipsisType = ..., **fields: Any) -> RequestResult:
        """One request, its final answer. ``fields``: prompt_token_ids, messages, priority,
        cache_salt and any SamplingParams field (max_tokens, temperature, stop, ...)."""
        wire, q = self._submit_generate("generate", prompt, id, False, fields)
        deadline = self._deadline(timeout)
        while True:
            item = self._get(q, wire, deadline and deadline - time.monotonic())
            if isinstance(item, RequestResult):
                return item

    def embed(self, prompt: str | None = None, *, id: str | None = None,
              timeout: float | None | EllipsisType = ..., **fields: Any) -> RequestResult:
        """``generate`` with task "embed": the answer's ``embedding`` (prompt_token_ids,
        truncate_prompt_tokens, priority, cache_salt as for generate)."""
        return self.generate(prompt, id=id, timeout=timeout, task="embed", **fields)

    def stream(self, prompt: str | None = None, *, id: str | None = None,
               timeout: float | None | EllipsisType = ..., **fields: Any) -> Iterator[RequestDelta | RequestResult]:
        """Deltas as they come, then the final answer. The request is sent on the first
        iteration; leaving the loop early (break, exception, garbage collection) aborts it."""
        wire, q = self._submit_generate("stream", prompt, id, True, fields)
        wait = self.timeout if timeout is ... else timeout
        done = False
        try:
            while not done:
                item = self._get(q, wire, wait)
                done = isinstance(item, RequestResult)
                yield cast("RequestDelta | RequestResult", item)  # all a generate's queue gets
        finally:
            if not done:
                self._forget(wire, abort=True)

    def abort(self, id: str) -> None:
        """Ask the daemon to abort the request with this id; its waiter gets its final answer.
        Nothing to do if no request with this id is in flight."""
        with self._lock:
            wire = self._reqs.wire_id(id)
        if wire is not None:
            self._send(P.encode(P.Abort(id=wire)))

    def health(self, timeout: float | None | EllipsisType = ...) -> P.HealthReply:
        wire = self._reqs.new_id()
        return self._call(wire, P.Health(id=wire), timeout)

    def stats(self, timeout: float | None | EllipsisType = ...) -> dict[str, Any]:
        wire = self._reqs.new_id()
        return self._call(wire, P.Stats(id=wire), timeout).stats

    def metrics(self, timeout: float | None | EllipsisType = ...) -> str:
        """The daemon's Prometheus text (the same as its --metrics-port serves)."""
        wire = self._reqs.new_id()
        return self._call(wire, P.Metrics(id=wire), timeout).text

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._wake()
        self._io.join()
        os.close(self._wake_r)
        os.close(self._wake_w)
        self._ctx.term()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- internals ----------------------------------------------------------------------
    def _deadline(self, timeout: float | None | EllipsisType) -> float | None:
        t = self.timeout if timeout is ... else timeout
        return None if t is None else time.monotonic() + t

    def _submit_generate(self, call: str, prompt: str | None, user_id: str | None, stream: bool,
                         fields: dict[str, Any]) -> tuple[str, queue.SimpleQueue]:
        check_user_id(call, user_id)
        wire = self._reqs.new_id()
        frame = generate_frame(call, prompt, wire, stream, fields)
        return wire, self._submit(wire, user_id or uuid.uuid4().hex, frame, True)

    def _call(self, wire: str, msg: P.Health | P.Stats | P.Metrics, timeout: float | None | EllipsisType) -> Any:
        q = self._submit(wire, wire, P.encode(msg), False)
        return self._get(q, wire, self.timeout if timeout is ... else timeout, abort=False)

    def _submit(self, wire: str, user_id: str, frame: bytes, is_generate: bool) -> queue.SimpleQueue:
        q: queue.SimpleQueue = queue.SimpleQueue()
        with self._lock:  # registered and queued atomically: see _connection_lost
            if self._closed:
                raise RequestError(CLOSED)
            self._reqs.add(wire, user_id, q, is_generate, time.monotonic())
            self._out.put((wire, frame))
        self._wake()
        return q

    def _get(self, q: queue.SimpleQueue, wire: str, timeout: float | None, abort: bool = True) -> object:
        try:
            item = q.get(timeout=None if timeout is None else max(timeout, 0.0))
        except queue.Empty:
            user_id = self._forget(wire, abort)
            raise TimeoutError(f"request {user_id!r}: no answer within {timeout:.3g}s") from None
        if isinstance(item, RequestError):
            raise item
        return item

    def _forget(self, wire: str, abort: bool) -> str:
        """Stop waiting for a request (its late answers are dropped); returns the caller's id."""
        with self._lock:
            w = self._reqs.pop(wire)
        if abort and w is not None and not self._closed:
            self._send(P.encode(P.Abort(id=wire)))
        return wire if w is None else w.user_id

    def _send(self, frame: bytes) -> None:
        self._out.put((None, frame))
        self._wake()

    def _wake(self) -> None:
        try:
            os.write(self._wake_w, b"\0")
        except BlockingIOError:  # pipe full: the I/O thread is already due to wake
            pass

    def _poll_ms(self) -> int | None:
        """Until the next request that may time out unconnected (never while connected)."""
        if self._conn.up:
            return None
        with self._lock:
            deadline = self._reqs.next_deadline(self._conn.connect_timeout)
        return None if deadline is None else max(0, math.ceil((deadline - time.monotonic()) * 1000))

    def _io_loop(self) -> None:
        sock, mon, poller = self._sock, self._mon, zmq.Poller()
        poller.register(self._wake_r, zmq.POLLIN)
        poller.register(mon, zmq.POLLIN)
        # A DEALER blocks on send while it has no peer (daemon down, handshake refused):
        # never block here, keep unsent frames and wait for POLLOUT instead.
        backlog: _Backlog = collections.deque()
        try:
            while not self._closed:
                poller.register(sock, zmq.POLLIN | (zmq.POLLOUT if backlog else 0))
                events = dict(poller.poll(self._poll_ms()))
                if self._wake_r in events:
                    os.read(self._wake_r, 65536)
                self._drain_out(backlog)
                while backlog and self._try_send(backlog[0][1]):
                    backlog.popleft()
                # Answers first: a daemon's last answers precede the disconnect they cause,
                # and the poll may have seen the monitor's event but not yet those frames.
                while sock in events or mon in events:
                    try:
                        frame = sock.recv(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    self._deliver(frame)
                if mon in events:
                    while (ev := _monitor_event(mon)) is not None:
                        if (err := self._conn.on_event(ev)) is not None:
                            self._connection_lost(err, backlog)
                if self._conn.refused is not None and self._reqs.waiting:
                    self._connection_lost(self._conn.refused, backlog)
                if not self._conn.up:
                    with self._lock:
                        late = self._reqs.unconnected(time.monotonic(), self._conn.connect_timeout)
                    if late:
                        self._connection_lost(self._conn.unreachable(), backlog, late)
            self._try_send(P.encode(P.Bye()))
        finally:
            sock.disable_monitor()
            mon.close(linger=0)
            sock.close()
            with self._lock:
                waiting = self._reqs.pop_all()
                self._closed = True
            for w in waiting.values():
                w.queue.put(closed_answer(w))

    def _drain_out(self, backlog: _Backlog) -> None:
        while True:
            try:
                backlog.append(self._out.get_nowait())
            except queue.Empty:
                return

    def _connection_lost(self, err: ErrorInfo, backlog: _Backlog, only: list[str] | None = None) -> None:
        """The daemon went away, refused us, or was never reached (``only``: the requests
        that waited connect_timeout for it): those requests end now with an error instead of
        at their time-out (the caller may retry). Their unsent frames are dropped; for sent
        generates an abort is queued, so a frame that ZMQ still holds and delivers after
        reconnecting is cancelled there at once."""
        with self._lock:
            self._drain_out(backlog)
            if only is None:
                lost = self._reqs.pop_all()
            else:
                lost = {wire: w for wire in only if (w := self._reqs.pop(wire)) is not None}
        unsent = {wire for wire, _ in backlog if wire is not None}
        kept = [(wire, f) for wire, f in backlog if wire is None or wire not in lost]
        backlog.clear()
        backlog.extend(kept)
        for wire, w in lost.items():
            w.queue.put(error_result(w.user_id, err.code, err.message) if w.is_generate
                        else RequestError(err))
            if w.is_generate and wire not in unsent:
                backlog.append((None, P.encode(P.Abort(id=wire))))

    def _try_send(self, frame: bytes) -> bool:
        try:
            self._sock.send(frame, zmq.NOBLOCK)
            return True
        except zmq.Again:
            return False

    def _deliver(self, frame: bytes) -> None:
        try:
            routed = route(frame)
        except (msgspec.DecodeError, msgspec.ValidationError):
            return  # not our protocol (a newer daemon?): nobody to route it to
        if routed is None:
            return  # a ping, or an error about no request of ours
        wire, item, last = routed
        with self._lock:
            w = self._reqs.pop(wire) if last else self._reqs.get(wire)
        if w is not None:  # else: a request given up on (time-out, abandoned stream)
            w.queue.put(for_caller(item, w))
