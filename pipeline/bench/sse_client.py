"""The load generator's HTTP client for `pipeline bench serve --http`: streamed POSTs over a
pool of keep-alive HTTP/1.1 connections, responses parsed by httptools (llhttp, the parser
uvicorn uses), server-sent events handed to a callback as they arrive.

Why not httpx: a benchmark's client must not be what it measures. httpx's async streaming
spent ~170 µs of CPU per streamed token here, three times the ZMQ client's, on the same two
cores as the server it measures; this client reads a token's event in a few microseconds of
Python (one ``data_received``, llhttp's chunked decoding in C, one split). It speaks only
what the bench needs: POST with a JSON body, a status, a (chunked or sized) body, keep-alive.
Owns its connections.
"""
from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import cast
from urllib.parse import urlsplit

import httptools
import msgspec

OnEvent = Callable[[bytes], None]  # an event's `data:` payload


class _Conn(asyncio.Protocol):
    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.on_event: OnEvent | None = None
        self.buf = b""
        self.body: list[bytes] = []
        self.done: asyncio.Future | None = None
        self.status = 0
        self.reusable = False
        self.lost = False

    # asyncio.Protocol
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast("asyncio.Transport", transport)  # a stream's

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self._finish(exc)

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = True
        self._finish(exc or ConnectionError("the server closed the connection"))

    # httptools callbacks
    def on_headers_complete(self) -> None:
        self.status = self.parser.get_status_code()

    def on_body(self, body: bytes) -> None:
        if self.status != 200 or self.on_event is None:
            self.body.append(body)
            return
        self.buf += body
        *events, self.buf = self.buf.split(b"\n\n")
        for ev in events:
            if ev.startswith(b"data: "):
                self.on_event(ev[6:])

    def on_message_complete(self) -> None:
        self.reusable = self.parser.should_keep_alive()
        self._finish(None)

    def _finish(self, exc: BaseException | None) -> None:
        if self.done is not None and not self.done.done():
            if exc is None:
                self.done.set_result(self.status)
            else:
                self.done.set_exception(exc)


class SSEClient:
    """``await post(path, body, on_event)`` -> (status, body of a non-200 answer)."""

    def __init__(self, base_url: str, headers: dict[str, str] | None = None) -> None:
        u = urlsplit(base_url)
        if u.scheme != "http" or not u.hostname:
            raise ValueError(f"expected http://HOST:PORT, got {base_url!r}")
        self.host, self.port = u.hostname, u.port or 80
        extra = "".join(f"{k}: {v}\r\n" for k, v in (headers or {}).items())
        self.head = f"Host: {u.netloc}\r\nContent-Type: application/json\r\nAccept: text/event-stream\r\n{extra}"
        self.idle: list[_Conn] = []
        self.open: set[_Conn] = set()

    async def _conn(self) -> _Conn:
        while self.idle:
            c = self.idle.pop()
            if not c.lost:
                return c
        loop = asyncio.get_running_loop()
        _, c = await loop.create_connection(_Conn, self.host, self.port)
        self.open.add(c)
        return c

    async def post(self, path: str, body: dict, on_event: OnEvent) -> tuple[int, bytes]:
        c = await self._conn()
        payload = msgspec.json.encode(body)
        c.on_event, c.buf, c.body, c.status, c.reusable = on_event, b"", [], 0, False
        c.done = asyncio.get_running_loop().create_future()
        assert c.transport is not None
        c.transport.write(f"POST {path} HTTP/1.1\r\n{self.head}Content-Length: {len(payload)}\r\n\r\n".encode()
                          + payload)
        try:
            status = await c.done
        except BaseException:
            c.transport.close()
            self.open.discard(c)
            raise
        if c.reusable:
            self.idle.append(c)
        else:
            c.transport.close()
            self.open.discard(c)
        return status, b"".join(c.body)

    async def aclose(self) -> None:
        for c in self.open:
            if c.transport is not None:
                c.transport.close()
        self.open.clear()
        self.idle.clear()
