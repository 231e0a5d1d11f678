"""The HTTP front end's connections: a cap, and a time-out until each request's head.

Owns (state): per process, the refusals not yet logged and when the last log line went out;
per connection, its head timer. uvicorn's own protocol (httptools) does the HTTP; this
subclass adds what it lacks:

- A cap on open connections, from the descriptor limit (``RLIMIT_NOFILE`` less
  ``RESERVED_FDS`` for the process's own: the ZMQ client, the listening socket, the
  tokenizer's files). Beyond it a new connection gets a canned 503 and is closed at once, so
  it holds its descriptor for microseconds; the refusals are logged, once per
  ``LOG_INTERVAL_S``, with their count (19,990 idle connections used to take every
  descriptor, and new clients were reset with nothing logged).
- A time-out before a request's head is in (``HEAD_TIMEOUT_S``), armed when the connection
  opens and after each response: uvicorn's keep-alive timer is disarmed by any byte, so a
  connection that never sends its first request, or trickles its headers, was kept for ever.
  The body's own time-out is ``limit.BODY_TIMEOUT_S``.
"""
from __future__ import annotations

import asyncio
import logging
import resource
import time
from typing import Any

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

HEAD_TIMEOUT_S = 5  # vLLM's (uvicorn's) keep-alive default, and the time to send a head
RESERVED_FDS = 128
LOG_INTERVAL_S = 10.0
_BUSY_BODY = (b'{"error":{"message":"too many open connections; retry later","type":"service_unavailable",'
              b'"param":null,"code":"too_many_connections"}}')
_BUSY = (b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\nconnection: close\r\n"
         b"content-length: %d\r\n\r\n%s" % (len(_BUSY_BODY), _BUSY_BODY))
log = logging.getLogger("pipeline.http")


def connection_cap() -> int:
    """The most connections this process keeps open (its descriptor limit, now, less what it
    needs for itself): read per connection, so a limit changed at run time applies."""
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    return max(1, (1 << 20 if soft == resource.RLIM_INFINITY else soft) - RESERVED_FDS)


def raise_fd_limit() -> None:
    """The soft descriptor limit up to the hard one (the cap follows it)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        except (ValueError, OSError):
            pass


class _Refusals:
    count = 0
    last_log = -LOG_INTERVAL_S

    @classmethod
    def note(cls, open_now: int, cap: int) -> None:
        cls.count += 1
        now = time.monotonic()
        if now - cls.last_log >= LOG_INTERVAL_S:
            log.warning("HTTP front end: %d connection(s) open, the cap (the descriptor limit less %d); "
                        "refused %d new connection(s) with 503 since the last such message",
                        open_now, RESERVED_FDS, cls.count)
            cls.count, cls.last_log = 0, now


class GuardedProtocol(HttpToolsProtocol):
    _head_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: Any) -> None:
        cap = connection_cap()
        if len(self.connections) >= cap:
            _Refusals.note(len(self.connections), cap)
            transport.write(_BUSY)
            transport.close()
            return
        super().connection_made(transport)
        self._arm()

    def _arm(self) -> None:
        self._disarm()
        self._head_timer = self.loop.call_later(HEAD_TIMEOUT_S, self._head_timeout)

    def _disarm(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_timeout(self) -> None:
        self._head_timer = None
        idle = self.cycle is None or self.cycle.response_complete
        if idle and not self.pipeline and not self.transport.is_closing():
            self.transport.close()

    def on_headers_complete(self) -> None:
        self._disarm()
        super().on_headers_complete()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing():
            self._arm()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        if self.transport is not None:  # None: refused at connection_made
            super().connection_lost(exc)
