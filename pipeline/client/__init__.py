"""Python clients of ``pipeline serve`` (ZMQ): ``Client`` (threads) and ``AsyncClient`` (asyncio).

Imports the messages and the gateway's wire protocol only, never a stage package.

Not a stage: client-side state only. Each client owns ONE DEALER socket over which all its
requests are multiplexed (``gateway.protocol``); replies are routed by request id to per-request
queues. ``Client`` keeps the socket in a background I/O thread (ZMQ sockets are not
thread-safe), fed through a queue plus a wake-up pipe, so any number of threads may call it.
``AsyncClient`` runs a reader task on the event loop, so any number of tasks may call it.
Both send a ``ping`` every HEARTBEAT_INTERVAL_S and ``bye`` on close, so the daemon aborts
the requests of a client that went away.

Time-outs: ``generate(timeout=)`` bounds the whole request; ``stream(timeout=)`` bounds the
wait for each next message. On a time-out the request is aborted on the daemon and
``TimeoutError`` raised. Results with ``finish_reason == "error"`` are returned, not raised
(``result.error`` says why), like pipe mode's JSON lines. A socket monitor watches the
connection: when the daemon goes away (or refuses the CURVE handshake) every request in
flight ends at once with ``error.code`` "connection_lost" ("handshake_failed") instead of
waiting for its time-out, and may be retried: ZMQ reconnects by itself. ``health()`` and
``stats()`` raise ``RequestError`` then, and every call does once the client is closed.
"""

from pipeline.client.async_client import AsyncClient
from pipeline.client.base import RequestError
from pipeline.client.client import Client

__all__ = ["AsyncClient", "Client", "RequestError"]
