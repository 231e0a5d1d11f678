"""asyncio client of ``pipeline serve``: ``AsyncClient`` (also importable from pipeline.client).

Not a stage: client-side state only. One DEALER socket (zmq.asyncio) multiplexes all
requests; an I/O task routes replies by request id to per-request asyncio queues and watches
the socket monitor (ending the requests of a lost connection), a pinger task sends the
heartbeat, so any number of tasks of one event loop may share it. Same protocol, time-out, error and
connection-loss rules as ``Client`` (see the package docstring).
"""
from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from types import EllipsisType
from typing import Any, cast

import msgspec
import zmq
import zmq.asyncio
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


class AsyncClient:
    """asyncio client, safe to share between tasks of one event loop. ``await close()``."""

    def __init__(self, address: str, timeout: float | None = DEFAULT_TIMEOUT_S, *,
                 curve_server_key: bytes | str | Path | None = None,
                 curve_keys_dir: str | Path | None = None,
                 heartbeat_interval: float = P.HEARTBEAT_INTERVAL_S) -> None:
        self.timeout = timeout
        self._conn = Connection(address)
        self._ctx = zmq.asyncio.Context()
        self._sock = new_socket(self._ctx, address, curve_keys_dir, curve_server_key)
        self._mon = self._sock.get_monitor_socket(MONITOR_EVENTS)
        self._hb = heartbeat_interval
        self._waiting: dict[str, tuple[asyncio.Queue, bool]] = {}  # id -> (queue, is generate)
        self._sending: dict[str, asyncio.Future] = {}  # sends still waiting for a peer
        self._tasks: list[asyncio.Task] = []
        self._closed = False

    async def generate(self, prompt: str | None = None, *, id: str | None = None,
                       timeout: float | None | EllipsisType = ..., **fields: Any) -> RequestResult:
        """One request, its final answer (fields as in ``Client.generate``)."""
        rid, msg = generate_msg(prompt, id, False, fields)
        t = self.timeout if timeout is ... else timeout
        try:
            async with asyncio.timeout(t):
                q = await self._submit(rid, msg, True)
                while not isinstance(item := await self._get(q), RequestResult):
                    pass
                return item
        except TimeoutError:
            await self._forget(rid, abort=True)
            raise TimeoutError(f"request {rid!r}: no answer within {t:.3g}s") from None
        except asyncio.CancelledError:
            await self._forget(rid, abort=True)
            raise

    async def stream(self, prompt: str | None = None, *, id: str | None = None,
                     timeout: float | None | EllipsisType = ...,
                     **fields: Any) -> AsyncIterator[RequestDelta | RequestResult]:
        """Deltas, then the final answer; leaving the loop early aborts the request."""
        rid, msg = generate_msg(prompt, id, True, fields)
        t = self.timeout if timeout is ... else timeout
        done = False
        try:
            q = await self._submit(rid, msg, True)
            while not done:
                try:
                    item = await asyncio.wait_for(self._get(q), t)
                except TimeoutError:
                    raise TimeoutError(f"request {rid!r}: no answer within {t:.3g}s") from None
                done = isinstance(item, RequestResult)
                yield cast("RequestDelta | RequestResult", item)  # all a generate's queue gets
        finally:
            if not done:
                await self._forget(rid, abort=True)

    async def abort(self, id: str) -> None:
        await self._send_nowait(P.encode(P.Abort(id=id)))

    async def health(self, timeout: float | None | EllipsisType = ...) -> P.HealthReply:
        return await self._call(P.Health(id=uuid.uuid4().hex), timeout)

    async def stats(self, timeout: float | None | EllipsisType = ...) -> dict[str, Any]:
        return (await self._call(P.Stats(id=uuid.uuid4().hex), timeout)).stats

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for task in [*self._tasks, *self._sending.values()]:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        try:
            await self._send_nowait(P.encode(P.Bye()))
        finally:
            self._sock.disable_monitor()
            self._mon.close(linger=0)
            self._sock.close()
            self._ctx.term()
        for q, _ in self._waiting.values():
            q.put_nowait(RequestError(CLOSED))
        self._waiting.clear()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def _call(self, msg: P.Health | P.Stats, timeout: float | None | EllipsisType) -> Any:
        t = self.timeout if timeout is ... else timeout
        try:
            async with asyncio.timeout(t):
                return await self._get(await self._submit(msg.id, msg, False))
        finally:
            self._waiting.pop(msg.id, None)

    async def _submit(self, rid: str, msg: P.ClientMsg, is_generate: bool) -> asyncio.Queue:
        if self._closed:
            raise RequestError(CLOSED)
        if not self._tasks:  # started lazily: the loop must be running
            self._tasks = [asyncio.create_task(c) for c in (self._io(), self._pinger())]
        if rid in self._waiting:
            raise ValueError(f"id: request {rid!r} is already in flight on this client")
        q: asyncio.Queue = asyncio.Queue()
        if self._conn.refused is not None:  # see Connection.on_event
            refused = self._conn.refused
            q.put_nowait(error_result(rid, refused.code, refused.message) if is_generate
                         else RequestError(refused))
            return q
        self._waiting[rid] = (q, is_generate)
        # Not awaited: a DEALER send waits while no daemon is connected, and the caller
        # must keep waiting on its queue (answer, time-out or lost connection) meanwhile.
        # zmq.asyncio's send returns an asyncio.Future (its stub says only Awaitable).
        fut = cast("asyncio.Future[zmq.MessageTracker | None]", self._sock.send(P.encode(msg)))
        if not fut.done():
            self._sending[rid] = fut
            fut.add_done_callback(lambda f: (self._sending.pop(rid, None),
                                             f.cancelled() or f.exception()))
        return q

    @staticmethod
    async def _get(q: asyncio.Queue) -> object:
        item = await q.get()
        if isinstance(item, RequestError):
            raise item
        return item

    async def _forget(self, rid: str, abort: bool) -> None:
        self._waiting.pop(rid, None)
        unsent = self._sending.pop(rid, None)
        if unsent is not None:
            unsent.cancel()
            return
        if abort and not self._closed:
            await self.abort(rid)

    async def _send_nowait(self, frame: bytes) -> bool:
        """Fire-and-forget frames (abort, ping, bye) never wait for a peer to appear."""
        try:
            await self._sock.send(frame, zmq.NOBLOCK)
            return True
        except zmq.Again:
            return False

    async def _io(self) -> None:
        poller = zmq.asyncio.Poller()
        poller.register(self._sock, zmq.POLLIN)
        poller.register(self._mon, zmq.POLLIN)
        while True:
            events = dict(await poller.poll())
            # Answers first: a daemon's last answers precede the disconnect they cause.
            while True:
                try:
                    frame = await self._sock.recv(zmq.NOBLOCK)
                except zmq.Again:
                    break
                self._deliver(frame)
            if self._mon in events:
                while True:
                    try:
                        event = parse_monitor_message(await self._mon.recv_multipart(zmq.NOBLOCK))["event"]
                    except zmq.Again:
                        break
                    if (err := self._conn.on_event(event)) is not None:
                        await self._connection_lost(err)

    def _deliver(self, frame: bytes) -> None:
        try:
            rid, item, last = route(frame)
        except (msgspec.DecodeError, msgspec.ValidationError):
            return
        if rid is None:
            return  # an error about a frame with no usable id: no request of ours waits on it
        w = self._waiting.pop(rid, None) if last else self._waiting.get(rid)
        if w is not None:
            w[0].put_nowait(item)

    async def _pinger(self) -> None:
        ping = P.encode(P.Ping())
        while True:
            await self._send_nowait(ping)
            await asyncio.sleep(self._hb)  # the heartbeat period, not a synchronisation

    async def _connection_lost(self, err: ErrorInfo) -> None:
        """See Client._connection_lost."""
        lost, self._waiting = self._waiting, {}
        for rid, (q, is_generate) in lost.items():
            q.put_nowait(error_result(rid, err.code, err.message) if is_generate else RequestError(err))
            unsent = self._sending.pop(rid, None)
            if unsent is not None:
                unsent.cancel()
            elif is_generate:
                await self._send_nowait(P.encode(P.Abort(id=rid)))
