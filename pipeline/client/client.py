"""``Client``: the thread-safe client of ``pipeline serve`` (see the package docstring).

Owns one DEALER socket, kept by a background I/O thread (ZMQ sockets are not thread-safe)
and fed through a queue plus a wake-up pipe, so any number of threads may call it; replies
are routed by request id to per-request queues.
"""
from __future__ import annotations

import collections
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
    DEFAULT_TIMEOUT_S,
    MONITOR_EVENTS,
    Connection,
    RequestError,
    generate_msg,
    new_socket,
    route,
)
from pipeline.gateway import protocol as P
from pipeline.messages import ErrorInfo, RequestDelta, RequestResult, error_result

__all__ = ["Client", "RequestError"]


def _monitor_event(mon: zmq.Socket) -> int | None:
    try:
        return parse_monitor_message(mon.recv_multipart(zmq.NOBLOCK))["event"]
    except zmq.Again:
        return None


class Client:
    """Thread-safe synchronous client. Use as a context manager or call ``close()``."""

    def __init__(self, address: str, timeout: float | None = DEFAULT_TIMEOUT_S, *,
                 curve_server_key: bytes | str | Path | None = None,
                 curve_keys_dir: str | Path | None = None,
                 heartbeat_interval: float = P.HEARTBEAT_INTERVAL_S) -> None:
        self.timeout = timeout
        self._ctx = zmq.Context()
        self._sock = new_socket(self._ctx, address, curve_keys_dir, curve_server_key)
        self._conn = Connection(address)
        self._hb = heartbeat_interval
        self._out: queue.SimpleQueue[tuple[str | None, bytes]] = queue.SimpleQueue()
        # request id -> (its reply queue, whether it is a generate)
        self._waiting: dict[str, tuple[queue.SimpleQueue, bool]] = {}
        self._lock = threading.Lock()
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
        rid, msg = generate_msg(prompt, id, False, fields)
        q = self._submit(rid, P.encode(msg), True)
        deadline = self._deadline(timeout)
        while True:
            item = self._get(q, rid, deadline and deadline - time.monotonic())
            if isinstance(item, RequestResult):
                return item

    def stream(self, prompt: str | None = None, *, id: str | None = None,
               timeout: float | None | EllipsisType = ..., **fields: Any) -> Iterator[RequestDelta | RequestResult]:
        """Deltas as they come, then the final answer. The request is sent on the first
        iteration; leaving the loop early (break, exception, garbage collection) aborts it."""
        rid, msg = generate_msg(prompt, id, True, fields)
        q = self._submit(rid, P.encode(msg), True)
        wait = self.timeout if timeout is ... else timeout
        done = False
        try:
            while not done:
                item = self._get(q, rid, wait)
                done = isinstance(item, RequestResult)
                yield cast("RequestDelta | RequestResult", item)  # all a generate's queue gets
        finally:
            if not done:
                self._forget(rid, abort=True)

    def abort(self, id: str) -> None:
        """Ask the daemon to abort; the request's waiter gets a final with "abort"."""
        self._send(P.encode(P.Abort(id=id)))

    def health(self, timeout: float | None | EllipsisType = ...) -> P.HealthReply:
        return self._call(P.Health(id=uuid.uuid4().hex), timeout)

    def stats(self, timeout: float | None | EllipsisType = ...) -> dict[str, Any]:
        return self._call(P.Stats(id=uuid.uuid4().hex), timeout).stats

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

    def _call(self, msg: P.Health | P.Stats, timeout: float | None | EllipsisType) -> Any:
        q = self._submit(msg.id, P.encode(msg), False)
        return self._get(q, msg.id, self.timeout if timeout is ... else timeout, abort=False)

    def _submit(self, rid: str, frame: bytes, is_generate: bool) -> queue.SimpleQueue:
        q: queue.SimpleQueue = queue.SimpleQueue()
        with self._lock:  # registered and queued atomically: see _connection_lost
            if self._closed:
                raise RequestError(CLOSED)
            if rid in self._waiting:
                raise ValueError(f"id: request {rid!r} is already in flight on this client")
            self._waiting[rid] = (q, is_generate)
            self._out.put((rid, frame))
        self._wake()
        return q

    def _get(self, q: queue.SimpleQueue, rid: str, timeout: float | None, abort: bool = True) -> object:
        try:
            item = q.get(timeout=None if timeout is None else max(timeout, 0.0))
        except queue.Empty:
            self._forget(rid, abort)
            raise TimeoutError(f"request {rid!r}: no answer within {timeout:.3g}s") from None
        if isinstance(item, RequestError):
            raise item
        return item

    def _forget(self, rid: str, abort: bool) -> None:
        with self._lock:
            self._waiting.pop(rid, None)
        if abort and not self._closed:
            self.abort(rid)

    def _send(self, frame: bytes) -> None:
        self._out.put((None, frame))
        self._wake()

    def _wake(self) -> None:
        try:
            os.write(self._wake_w, b"\0")
        except BlockingIOError:  # pipe full: the I/O thread is already due to wake
            pass

    def _io_loop(self) -> None:
        sock, poller = self._sock, zmq.Poller()
        poller.register(self._wake_r, zmq.POLLIN)
        mon = sock.get_monitor_socket(MONITOR_EVENTS)
        poller.register(mon, zmq.POLLIN)
        # A DEALER blocks on send while it has no peer (daemon down, handshake refused):
        # never block here, keep unsent frames and wait for POLLOUT instead.
        backlog: collections.deque[tuple[str | None, bytes]] = collections.deque()
        ping = P.encode(P.Ping())
        next_ping = 0.0
        try:
            while not self._closed:
                now = time.monotonic()
                if now >= next_ping:
                    if not backlog:  # a ping behind a backlog says nothing new
                        self._try_send(ping)
                    next_ping = now + self._hb
                poller.register(sock, zmq.POLLIN | (zmq.POLLOUT if backlog else 0))
                events = dict(poller.poll(int(max(next_ping - now, 0.0) * 1000)))
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
                if self._conn.refused is not None and self._waiting:
                    self._connection_lost(self._conn.refused, backlog)
            self._try_send(P.encode(P.Bye()))
        finally:
            sock.disable_monitor()
            mon.close(linger=0)
            sock.close()
            with self._lock:
                waiting, self._waiting = self._waiting, {}
                self._closed = True
            for q, _ in waiting.values():
                q.put(RequestError(CLOSED))

    def _drain_out(self, backlog: collections.deque[tuple[str | None, bytes]]) -> None:
        while True:
            try:
                backlog.append(self._out.get_nowait())
            except queue.Empty:
                return

    def _connection_lost(self, err: ErrorInfo, backlog: collections.deque[tuple[str | None, bytes]]) -> None:
        """The daemon went away or refused us: every request in flight ends now with an
        error instead of at its time-out (the caller may retry). Unsent frames are dropped;
        for sent generates an abort is queued, so a frame that ZMQ still holds and delivers
        after reconnecting is cancelled there at once."""
        with self._lock:
            self._drain_out(backlog)
            lost, self._waiting = self._waiting, {}
        unsent = {rid for rid, _ in backlog if rid is not None}
        kept = [(rid, f) for rid, f in backlog if rid is None or rid not in lost]
        backlog.clear()
        backlog.extend(kept)
        for rid, (q, is_generate) in lost.items():
            q.put(error_result(rid, err.code, err.message) if is_generate else RequestError(err))
            if is_generate and rid not in unsent:
                backlog.append((None, P.encode(P.Abort(id=rid))))

    def _try_send(self, frame: bytes) -> bool:
        try:
            self._sock.send(frame, zmq.NOBLOCK)
            return True
        except zmq.Again:
            return False

    def _deliver(self, frame: bytes) -> None:
        try:
            rid, item, last = route(frame)
        except (msgspec.DecodeError, msgspec.ValidationError):
            return  # not our protocol (a newer daemon?): nobody to route it to
        if rid is None:
            return  # an error about a frame with no usable id: no request of ours waits on it
        with self._lock:
            w = self._waiting.pop(rid, None) if last else self._waiting.get(rid)
        if w is not None:  # else: a request given up on (time-out, abandoned stream)
            w[0].put(item)
