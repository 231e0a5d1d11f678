"""Python clients of ``pipeline serve`` (ZMQ): ``Client`` (threads) and ``AsyncClient`` (asyncio).

Imports the messages and the gateway's wire protocol only, never a stage package.

Not a stage: client-side state only. Each client owns ONE DEALER socket over which all its
requests are multiplexed (``frontend.protocol``); replies are routed to per-request queues by
a wire id the client gives each request (``base.Inflight``): the caller's ``id`` is what the
answers carry back, and a late answer of a request given up on is never taken for a later
one's. ``Client`` keeps the socket in a background I/O thread (ZMQ sockets are not
thread-safe), fed through a queue plus a wake-up pipe, so any number of threads may call it.
``AsyncClient`` runs a reader task on the event loop, so any number of tasks may call it.
Both send ``bye`` on close, so the daemon aborts what they had in flight; the daemon watches
the connection itself, so a stalled caller (a blocking call in the event loop, a stopped
process) loses nothing.

Arguments the wire cannot carry are refused before anything is sent: an address that is not
``tcp://HOST:PORT`` or ``ipc://PATH`` (ValueError), an unknown keyword or ``stream=`` to
``generate`` (TypeError, with the nearest known name), a value of the wrong type or length or
an integer over 64 bits (ValueError naming the field), an ``id`` already in flight on this
client (ValueError). Values the daemon checks (ranges, model limits) come back as answers.

Time-outs: ``generate(timeout=)`` bounds the whole request; ``stream(timeout=)`` bounds the
wait for each next message. On a time-out the request is aborted on the daemon and
``TimeoutError`` raised. Results with ``finish_reason == "error"`` are returned, not raised
(``result.error`` says why), like pipe mode's JSON lines. A socket monitor watches the
connection: when the daemon goes away (or refuses the CURVE handshake) every request in
flight ends at once with ``error.code`` "connection_lost" ("handshake_failed") instead of
waiting for its time-out, and may be retried: ZMQ reconnects by itself. A request that waits
``connect_timeout`` seconds without any connection to the daemon (none there, or none yet)
ends with "unreachable". ``health()`` and ``stats()`` raise ``RequestError`` then. Closing the
client ends the generates still in flight with ``finish_reason == "abort"`` (``error.code``
"aborted", the daemon aborts them on the client's ``bye``); every later call raises
``RequestError`` ("client_closed").
"""

from pipeline.client.async_client import AsyncClient
from pipeline.client.base import RequestError
from pipeline.client.client import Client

__all__ = ["AsyncClient", "Client", "RequestError"]
