"""asyncio client of ``pipeline serve``: ``AsyncClient`` (also importable from pipeline.client).

Not a stage: client-side state only. One DEALER socket multiplexes all requests; its FD is
an event-loop reader (``_pump``) that routes replies by wire id (``base.Inflight``) to
per-request asyncio queues with plain non-blocking reads (no future or epoll_ctl per message:
that machinery was most of a streamed token's cost in a busy client), and an I/O task watches
the socket monitor (ending the requests of a lost connection), so any number of tasks of one
event loop may share it. It belongs to the event loop that uses it first; once that loop has
ended (``asyncio.run`` returned) the next loop that uses it takes it over, while a loop still
running elsewhere keeps it (RuntimeError). Same protocol, time-out, error and connection-loss
rules as ``Client`` (see the package docstring).
"""
from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator
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

# While unconnected, how often the I/O task looks for requests past connect_timeout.
UNCONNECTED_CHECK_MS = 100


class AsyncClient:
    """asyncio client, safe to share between tasks of one event loop. ``await close()``."""

    def __init__(self, address: str, timeout: float | None = DEFAULT_TIMEOUT_S, *,
                 connect_timeout: float | None = DEFAULT_CONNECT_TIMEOUT_S,
                 curve_server_key: bytes | str | Path | None = None,
                 curve_keys_dir: str | Path | None = None) -> None:
        self.timeout = timeout
        self._conn = Connection(address, connect_timeout)
        self._ctx = zmq.Context()
        try:
            self._sock, self._mon = new_socket(self._ctx, address, curve_keys_dir, curve_server_key)
        except BaseException:
            self._ctx.term()
            raise
        self._fds = (self._sock.FD, self._mon.FD)  # readers of the loop it belongs to
        self._reqs = Inflight()
        # Frames by wire id, oldest first, that wait for a daemon to connect (a DEALER cannot
        # send before); _pump sends them. Forgetting one that is here needs no abort.
        self._sending: dict[str, bytes] = {}
        self._loop: asyncio.AbstractEventLoop | None = None  # the loop it belongs to
        self._io_task: asyncio.Task | None = None
        self._closed = False

    async def generate(self, prompt: str | None = None, *, id: str | None = None,
                       timeout: float | None | EllipsisType = ..., **fields: Any) -> RequestResult:
        """One request, its final answer (fields as in ``Client.generate``)."""
        wire, q = self._submit_generate("generate", prompt, id, False, fields)
        t = self.timeout if timeout is ... else timeout
        try:
            async with asyncio.timeout(t):
                while not isinstance(item := await self._get(q), RequestResult):
                    pass
                return item
        except TimeoutError:
            user_id = self._forget(wire, abort=True)
            raise TimeoutError(f"request {user_id!r}: no answer within {t:.3g}s") from None
        except asyncio.CancelledError:
            self._forget(wire, abort=True)
            raise

    async def embed(self, prompt: str | None = None, **fields: Any) -> RequestResult:
        """``generate`` with task "embed" (as ``Client.embed``; ``id``, ``timeout`` as there)."""
        return await self.generate(prompt, task="embed", **fields)

    async def stream(self, prompt: str | None = None, *, id: str | None = None,
                     timeout: float | None | EllipsisType = ...,
                     **fields: Any) -> AsyncIterator[RequestDelta | RequestResult]:
        """Deltas, then the final answer; leaving the loop early aborts the request."""
        wire, q = self._submit_generate("stream", prompt, id, True, fields)
        t = self.timeout if timeout is ... else timeout
        done = False
        try:
            while not done:
                try:
                    # Not wait_for: on 3.11 it drops a cancellation landing as an item arrives.
                    async with asyncio.timeout(t):
                        item = await self._get(q)
                except TimeoutError:
                    user_id = self._forget(wire, abort=True)
                    raise TimeoutError(f"request {user_id!r}: no answer within {t:.3g}s") from None
                done = isinstance(item, RequestResult)
                yield cast("RequestDelta | RequestResult", item)  # all a generate's queue gets
        finally:
            if not done:
                self._forget(wire, abort=True)

    async def abort(self, id: str) -> None:
        """Ask the daemon to abort the request with this id (see ``Client.abort``)."""
        wire = self._reqs.wire_id(id)
        if wire is not None:
            self._take_loop()  # _send_nowait may schedule a _pump
            self._send_nowait(P.encode(P.Abort(id=wire)))

    async def health(self, timeout: float | None | EllipsisType = ...) -> P.HealthReply:
        return await self._call(P.Health, timeout)

    async def stats(self, timeout: float | None | EllipsisType = ...) -> dict[str, Any]:
        return (await self._call(P.Stats, timeout)).stats

    async def metrics(self, timeout: float | None | EllipsisType = ...) -> str:
        """The daemon's Prometheus text (the same as its --metrics-port serves)."""
        return (await self._call(P.Metrics, timeout)).text

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        mine = self._loop is asyncio.get_running_loop()  # else its loop ended with its tasks
        if mine and self._io_task is not None:
            self._io_task.cancel()
            await asyncio.gather(self._io_task, return_exceptions=True)
        self._unwatch()
        self._sending.clear()  # never sent: the daemon knows nothing of them
        try:
            self._send_nowait(P.encode(P.Bye()))
        finally:
            self._sock.disable_monitor()
            self._mon.close(linger=0)
            self._sock.close()
            self._ctx.term()
        for w in self._reqs.pop_all().values():
            if mine:
                w.queue.put_nowait(closed_answer(w))

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def _call(self, kind: type[P.Health | P.Stats | P.Metrics], timeout: float | None | EllipsisType) -> Any:
        wire = self._reqs.new_id()
        t = self.timeout if timeout is ... else timeout
        try:
            async with asyncio.timeout(t):
                return await self._get(self._submit(wire, wire, P.encode(kind(id=wire)), False))
        finally:
            self._reqs.pop(wire)

    def _submit_generate(self, call: str, prompt: str | None, user_id: str | None, stream: bool,
                         fields: dict[str, Any]) -> tuple[str, asyncio.Queue]:
        check_user_id(call, user_id)
        wire = self._reqs.new_id()
        frame = generate_frame(call, prompt, wire, stream, fields)
        return wire, self._submit(wire, user_id or uuid.uuid4().hex, frame, True)

    def _take_loop(self) -> None:
        """Bind to the running loop (see the module docstring)."""
        loop = asyncio.get_running_loop()
        if self._loop is loop:
            return
        if self._loop is not None and self._loop.is_running():
            raise RuntimeError("AsyncClient: in use by an event loop still running (in another "
                               "thread); use one client per event loop")
        # The previous loop ended, and with it every task that waited there: their late
        # answers are dropped (their queues belong to the dead loop).
        self._reqs.pop_all()
        self._sending.clear()
        self._unwatch()
        self._loop = loop
        # Registered once per loop: the reader costs nothing per message but its callback.
        monitor_ready = asyncio.Event()
        loop.add_reader(self._fds[0], self._pump)
        loop.add_reader(self._fds[1], monitor_ready.set)
        # A first look: what waits here signalled no FD on this loop (an unread reply mutes the next).
        monitor_ready.set()
        self._io_task = loop.create_task(self._io(monitor_ready))

    def _unwatch(self) -> None:
        """Take the FDs off the loop the client belonged to (a closed loop's selector is gone)."""
        if self._loop is not None and not self._loop.is_closed():
            for fd in self._fds:
                self._loop.remove_reader(fd)

    def _submit(self, wire: str, user_id: str, frame: bytes, is_generate: bool) -> asyncio.Queue:
        if self._closed:
            raise RequestError(CLOSED)
        self._take_loop()
        q: asyncio.Queue = asyncio.Queue()
        if self._conn.refused is not None:  # see Connection.on_event
            refused = self._conn.refused
            q.put_nowait(error_result(user_id, refused.code, refused.message) if is_generate
                         else RequestError(refused))
            return q
        self._reqs.add(wire, user_id, q, is_generate, time.monotonic())
        # A DEALER cannot send while no daemon is connected: the frame waits its turn in
        # _sending, the caller on its queue (answer, time-out or lost connection).
        if self._sending or not self._send_nowait(frame):
            self._sending[wire] = frame
        return q

    @staticmethod
    async def _get(q: asyncio.Queue) -> object:
        item = await q.get()
        if isinstance(item, RequestError):
            raise item
        return item

    def _forget(self, wire: str, abort: bool) -> str:
        """Stop waiting for a request (its late answers are dropped); returns the caller's id."""
        w = self._reqs.pop(wire)
        unsent = self._sending.pop(wire, None)
        if unsent is None and abort and w is not None and not self._closed:
            self._send_nowait(P.encode(P.Abort(id=wire)))
        return wire if w is None else w.user_id

    def _send_nowait(self, frame: bytes) -> bool:
        """Send now, or False while no daemon is connected (abort and bye are then dropped)."""
        try:
            self._sock.send(frame, zmq.NOBLOCK)
            return True
        except zmq.Again:
            return False
        finally:
            # A send may take the FD's signal for replies that came meanwhile (see _pump).
            if not self._closed and cast(int, self._sock.get(zmq.EVENTS)) & zmq.POLLIN:
                cast("asyncio.AbstractEventLoop", self._loop).call_soon(self._pump)

    def _pump(self) -> None:
        """The DEALER's reader: deliver every reply that came, send what waited for a daemon.
        libzmq's FD is edge-triggered: it signals when the socket gets work to do, and any
        recv, send or EVENTS read may consume that signal, after which replies left unread
        never signal again. A recv that says zmq.Again has looked at everything; after a
        send, EVENTS says whether there is more to do."""
        if self._closed:
            return
        sock = self._sock
        while True:
            while True:
                try:
                    frame = sock.recv(zmq.NOBLOCK)
                except zmq.Again:
                    break
                self._deliver(frame)
            if not self._sending:
                return
            for wire, frame in list(self._sending.items()):
                try:
                    sock.send(frame, zmq.NOBLOCK)
                except zmq.Again:
                    break
                del self._sending[wire]
            events = cast(int, sock.get(zmq.EVENTS))
            if not (events & zmq.POLLIN or (self._sending and events & zmq.POLLOUT)):
                return

    async def _io(self, monitor_ready: asyncio.Event) -> None:
        """Watches the monitor (set by its FD's reader) and, while no daemon is connected,
        the requests past connect_timeout."""
        while True:
            try:
                async with asyncio.timeout(None if self._conn.up else UNCONNECTED_CHECK_MS / 1000):
                    await monitor_ready.wait()
            except TimeoutError:
                pass
            monitor_ready.clear()
            # Answers first: a daemon's last answers precede the disconnect they cause.
            self._pump()
            while True:
                try:
                    event = parse_monitor_message(self._mon.recv_multipart(zmq.NOBLOCK))["event"]
                except zmq.Again:
                    break
                if (err := self._conn.on_event(event)) is not None:
                    self._connection_lost(err, list(self._reqs.waiting))
            if not self._conn.up:
                late = self._reqs.unconnected(time.monotonic(), self._conn.connect_timeout)
                if late:
                    self._connection_lost(self._conn.unreachable(), late)

    def _deliver(self, frame: bytes) -> None:
        try:
            routed = route(frame)
        except (msgspec.DecodeError, msgspec.ValidationError):
            return
        if routed is None:
            return  # a ping, or an error about no request of ours
        wire, item, last = routed
        w = self._reqs.pop(wire) if last else self._reqs.get(wire)
        if w is not None:
            w.queue.put_nowait(for_caller(item, w))

    def _connection_lost(self, err: ErrorInfo, wires: list[str]) -> None:
        """See Client._connection_lost."""
        for wire in wires:
            w = self._reqs.pop(wire)
            if w is None:
                continue
            w.queue.put_nowait(error_result(w.user_id, err.code, err.message) if w.is_generate
                               else RequestError(err))
            if self._sending.pop(wire, None) is None and w.is_generate:
                self._send_nowait(P.encode(P.Abort(id=wire)))
