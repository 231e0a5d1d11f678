"""Shared by ``Client`` and ``AsyncClient``: socket set-up, request building, the table of
requests in flight, reply routing and the errors a client reports by itself.

Not a stage. State: ``Inflight`` (one per client). See the package docstring for the
client-side behaviour and ``frontend.protocol`` for the wire.
"""
from __future__ import annotations

import difflib
import itertools
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import urlparse

import msgspec
import zmq

from pipeline.frontend import protocol as P
from pipeline.ipc.curve import client_socket_setup
from pipeline.messages import ErrorInfo, RequestDelta, RequestResult, error_result

DEFAULT_TIMEOUT_S = 600.0
DEFAULT_CONNECT_TIMEOUT_S = 10.0
CLOSED = ErrorInfo("client_closed", "the client was closed")
ADDRESS_FORMS = "tcp://HOST:PORT or ipc://PATH"
# What generate()/stream() take as keywords: the wire's generate fields but the ones they
# set themselves.
GENERATE_KEYWORDS = frozenset(P.Generate.__struct_fields__) - {"v", "id", "prompt", "stream"}


class RequestError(RuntimeError):
    """A non-generate operation failed on the daemon (or the client was closed)."""

    def __init__(self, error: ErrorInfo) -> None:
        super().__init__(f"{error.code}: {error.message}")
        self.error = error


def generate_frame(call: str, prompt: str | None, wire_id: str, stream: bool,
                   kw: dict[str, Any]) -> bytes:
    """The encoded generate. What the wire cannot carry is refused here, before anything is
    sent: TypeError for a keyword ``call`` (generate or stream) does not take, ValueError
    naming the field for a wrong type or length, or an integer over 64 bits."""
    for name in kw:
        if name == "stream":
            raise TypeError(f"{call}() takes no `stream` argument: generate() returns the final "
                            "answer, stream() yields the deltas and then the final answer")
        if name not in GENERATE_KEYWORDS:
            near = difflib.get_close_matches(name, GENERATE_KEYWORDS, 1)
            raise TypeError(f"{call}() got an unexpected keyword argument {name!r}"
                            + (f" (did you mean {near[0]!r}?)" if near else ""))
    fields = {"id": wire_id, "prompt": prompt, "stream": stream, **kw}
    try:
        return P.encode(msgspec.convert(fields, P.Generate))
    except msgspec.ValidationError as exc:
        raise ValueError(f"{call}(): {P.error_from_validation(exc).message}") from None
    except OverflowError:
        bad = next((n for n, v in kw.items() if _overflows(v)), "?")
        raise ValueError(f"{call}(): field `{bad}`: integers must be in [-2**63, 2**64 - 1] "
                         "(msgpack carries no larger)") from None


def _overflows(value: object) -> bool:
    try:
        msgspec.msgpack.encode(value)
    except OverflowError:
        return True
    return False


def check_user_id(call: str, rid: object) -> None:
    if rid is not None and not (isinstance(rid, str) and rid):
        raise TypeError(f"{call}(): `id` must be a non-empty str, got {rid!r}")


@dataclass(slots=True)
class Waiter:
    queue: Any  # queue.SimpleQueue (Client) or asyncio.Queue (AsyncClient)
    user_id: str  # the caller's id; the wire carries a per-client unique one
    is_generate: bool
    since: float  # time.monotonic() when submitted (connect_timeout counts from here)


class Inflight:
    """The requests a client waits for, by wire id. Each request gets a fresh wire id, so a
    late answer of a request given up on (time-out, lost connection) can never be taken for
    a later request's that reuses the caller's id; a caller's id is refused only while a
    generate with it is still waited for. Not thread-safe: ``Client`` holds its lock around
    it, ``AsyncClient`` uses it from its event loop only."""

    def __init__(self) -> None:
        self.waiting: dict[str, Waiter] = {}
        self._by_user: dict[str, str] = {}  # caller's id of a generate -> its wire id
        self._seq = itertools.count()

    def new_id(self) -> str:
        """A fresh wire id (thread-safe: one step of an itertools counter)."""
        return f"{next(self._seq):x}"

    def add(self, wire: str, user_id: str, q: Any, is_generate: bool, now: float) -> None:
        """Register a request. ValueError if a generate with ``user_id`` is still in flight
        on this client."""
        if is_generate and user_id in self._by_user:
            raise ValueError(f"id: request {user_id!r} is already in flight on this client")
        self.waiting[wire] = Waiter(q, user_id, is_generate, now)
        if is_generate:
            self._by_user[user_id] = wire

    def get(self, wire: str) -> Waiter | None:
        return self.waiting.get(wire)

    def pop(self, wire: str) -> Waiter | None:
        w = self.waiting.pop(wire, None)
        if w is not None and w.is_generate:
            del self._by_user[w.user_id]
        return w

    def wire_id(self, user_id: str) -> str | None:
        return self._by_user.get(user_id)

    def pop_all(self) -> dict[str, Waiter]:
        out, self.waiting = self.waiting, {}
        self._by_user.clear()
        return out

    def unconnected(self, now: float, timeout: float | None) -> list[str]:
        """Wire ids that have waited ``timeout`` seconds (call it while not connected)."""
        if timeout is None:
            return []
        return [wire for wire, w in self.waiting.items() if now - w.since >= timeout]

    def next_deadline(self, timeout: float | None) -> float | None:
        """When the oldest request will have waited ``timeout`` seconds (None: never)."""
        oldest = min((w.since for w in self.waiting.values()), default=None)
        return None if oldest is None or timeout is None else oldest + timeout


def route(frame: bytes) -> tuple[str, object, bool] | None:
    """(wire id, item for its queue, whether this is its last message), or None for a reply
    no request waits on (a ping, an error about no request of ours)."""
    msg = P.decode_reply(frame)
    if isinstance(msg, P.Delta):
        return msg.delta.id, msg.delta, False
    if isinstance(msg, P.Final):
        return msg.result.id, msg.result, True
    if isinstance(msg, P.Error):
        return None if msg.id is None else (msg.id, RequestError(msg.error), True)
    if isinstance(msg, (P.HealthReply, P.StatsReply, P.MetricsReply)):
        return msg.id, msg, True
    return None


def closed_answer(w: Waiter) -> object:
    """What a request still waited for gets when its client is closed: a generate was aborted
    by the client (and by the daemon, on its bye), any other call fails."""
    if w.is_generate:
        return error_result(w.user_id, "aborted", "aborted by the client: it was closed with the "
                            "request in flight", finish_reason="abort")
    return RequestError(CLOSED)


def for_caller(item: object, w: Waiter) -> object:
    """An answer as the caller sees it: with the caller's request id."""
    if isinstance(item, (RequestDelta, RequestResult)):
        return msgspec.structs.replace(item, id=w.user_id)
    return item


REFUSED_EVENTS = (zmq.EVENT_HANDSHAKE_FAILED_AUTH | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
                  | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL)
MONITOR_EVENTS = zmq.EVENT_DISCONNECTED | zmq.EVENT_HANDSHAKE_SUCCEEDED | REFUSED_EVENTS


class Connection:
    """What the socket monitor says about the link to the daemon (client-side state)."""

    def __init__(self, address: str, connect_timeout: float | None) -> None:
        self.address = address
        self.connect_timeout = connect_timeout
        self.up = False  # a handshake succeeded and no disconnect followed
        self.refused: ErrorInfo | None = None  # set while the daemon refuses our handshake

    def on_event(self, event: int) -> ErrorInfo | None:
        """The error that ends the requests in flight, if this event ends them."""
        if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
            self.up = True
            self.refused = None
            return None
        self.up = False
        if event & REFUSED_EVENTS:
            # ZMQ may stop retrying after a refusal: later requests must not hang either.
            self.refused = ErrorInfo("handshake_failed", f"{self.address} refused the connection "
                                     "(CURVE keys not accepted, or not a pipeline daemon)")
            return self.refused
        # A refused handshake is followed by a disconnect: keep reporting the refusal.
        return self.refused or ErrorInfo("connection_lost", f"lost the connection to {self.address}; "
                                                            "requests in flight there are gone")

    def unreachable(self) -> ErrorInfo:
        return ErrorInfo("unreachable", f"no connection to {self.address} within "
                         f"{self.connect_timeout:.3g}s (connect_timeout): is `pipeline serve` "
                         "running there, and reachable?")


_Socket = TypeVar("_Socket", bound=zmq.Socket)  # zmq.Socket, or zmq.asyncio.Socket for AsyncClient


def new_socket(ctx: zmq.Context[_Socket], address: str, keys_dir: str | Path | None,
               server_key: bytes | str | Path | None) -> tuple[_Socket, _Socket]:
    """A DEALER connected to ``address``, and its monitor socket, attached before connecting
    so that no event is missed. ValueError naming ``address`` if it is not an endpoint."""
    if not isinstance(address, str) or urlparse(address).scheme not in ("tcp", "ipc"):
        raise ValueError(f"address {address!r}: expected {ADDRESS_FORMS}")
    sock = ctx.socket(zmq.DEALER)
    mon: _Socket | None = None
    try:
        sock.setsockopt(zmq.SNDHWM, 0)  # never block the I/O loop on send
        sock.setsockopt(zmq.RCVHWM, 0)
        sock.setsockopt(zmq.LINGER, 1000)  # let the closing bye out
        # A dead daemon host is noticed even while no answer is due (see frontend.protocol).
        sock.setsockopt(zmq.TCP_KEEPALIVE, 1)
        sock.setsockopt(zmq.TCP_KEEPALIVE_IDLE, P.KEEPALIVE_IDLE_S)
        sock.setsockopt(zmq.TCP_KEEPALIVE_INTVL, P.KEEPALIVE_INTERVAL_S)
        sock.setsockopt(zmq.TCP_KEEPALIVE_CNT, P.KEEPALIVE_PROBES)
        if keys_dir is not None or server_key is not None:
            client_socket_setup(sock, keys_dir, server_key)
        mon = sock.get_monitor_socket(MONITOR_EVENTS)
        try:
            sock.connect(address)
        except zmq.ZMQError as exc:
            raise ValueError(f"address {address!r}: {exc.strerror} (expected {ADDRESS_FORMS})") from None
    except BaseException:
        if mon is not None:
            sock.disable_monitor()
            mon.close(linger=0)
        sock.close(linger=0)
        raise
    return sock, mon
