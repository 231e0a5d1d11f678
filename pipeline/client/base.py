"""Shared by ``Client`` and ``AsyncClient``: socket set-up, request building, reply routing
and the errors a client reports by itself.

Not a stage; no state. See the package docstring for the client-side behaviour and
``gateway.protocol`` for the wire.
"""
from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any, TypeVar

import zmq

from pipeline.gateway import protocol as P
from pipeline.gateway.curve import client_socket_setup
from pipeline.messages import ErrorInfo

DEFAULT_TIMEOUT_S = 600.0
CLOSED = ErrorInfo("client_closed", "the client was closed")


class RequestError(RuntimeError):
    """A non-generate operation failed on the daemon (or the client was closed)."""

    def __init__(self, error: ErrorInfo) -> None:
        super().__init__(f"{error.code}: {error.message}")
        self.error = error


def generate_msg(prompt: str | None, rid: str | None, stream: bool, kw: dict[str, Any]) -> tuple[str, P.Generate]:
    """The request's id (``rid``, or a new one) and its generate message."""
    rid = rid or uuid.uuid4().hex
    return rid, P.Generate(id=rid, prompt=prompt, stream=stream, **kw)


def route(frame: bytes) -> tuple[str | None, object, bool]:
    """(request id, item for its queue, whether this is its last message)."""
    msg = P.decode_reply(frame)
    if isinstance(msg, P.Delta):
        return msg.delta.id, msg.delta, False
    if isinstance(msg, P.Final):
        return msg.result.id, msg.result, True
    if isinstance(msg, P.Error):
        return msg.id, RequestError(msg.error), True
    return msg.id, msg, True


REFUSED_EVENTS = (zmq.EVENT_HANDSHAKE_FAILED_AUTH | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
                  | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL)
MONITOR_EVENTS = zmq.EVENT_DISCONNECTED | zmq.EVENT_HANDSHAKE_SUCCEEDED | REFUSED_EVENTS


class Connection:
    """What the socket monitor says about the link to the daemon (client-side state)."""

    def __init__(self, address: str) -> None:
        self.address = address
        self.refused: ErrorInfo | None = None  # set while the daemon refuses our handshake

    def on_event(self, event: int) -> ErrorInfo | None:
        """The error that ends the requests in flight, if this event ends them."""
        if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
            self.refused = None
            return None
        if event & REFUSED_EVENTS:
            # ZMQ may stop retrying after a refusal: later requests must not hang either.
            self.refused = ErrorInfo("handshake_failed", f"{self.address} refused the connection "
                                     "(CURVE keys not accepted, or not a pipeline daemon)")
            return self.refused
        # A refused handshake is followed by a disconnect: keep reporting the refusal.
        return self.refused or ErrorInfo("connection_lost", f"lost the connection to {self.address}; "
                                                            "requests in flight there are gone")


_Socket = TypeVar("_Socket", bound=zmq.Socket)  # zmq.Socket, or zmq.asyncio.Socket for AsyncClient


def new_socket(ctx: zmq.Context[_Socket], address: str, keys_dir: str | Path | None,
               server_key: bytes | str | Path | None) -> _Socket:
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.SNDHWM, 0)  # never block the I/O loop on send
    sock.setsockopt(zmq.RCVHWM, 0)
    sock.setsockopt(zmq.LINGER, 1000)  # let the closing bye out
    if keys_dir is not None or server_key is not None:
        client_socket_setup(sock, keys_dir, server_key)
    sock.connect(address)
    return sock
