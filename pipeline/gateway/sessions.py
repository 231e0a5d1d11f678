"""Gateway (daemon): which ZMQ client owns which in-flight request, and which clients are gone.

State: per client identity (the ROUTER routing id) its last-seen time and its requests; per
request the internal id the stages use. See ``protocol``'s docstring for the three ways a
client is declared gone (``bye``, EHOSTUNREACH on send, idle time-out); each returns the
internal ids the gateway must abort in the engine. Not thread-safe: the gateway's ZMQ loop
owns it.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from pipeline.gateway.protocol import CLIENT_IDLE_TIMEOUT_S


@dataclass(slots=True)
class _Client:
    last_seen: float
    requests: dict[str, str] = field(default_factory=dict)  # client id -> internal id


class DuplicateRequestId(ValueError):
    pass


class ClientSessions:
    """Maps (client identity, client request id) <-> internal request id."""

    def __init__(self, idle_timeout_s: float = CLIENT_IDLE_TIMEOUT_S) -> None:
        self.idle_timeout_s = idle_timeout_s
        self._clients: dict[bytes, _Client] = {}
        self._owner: dict[str, tuple[bytes, str]] = {}  # internal id -> (identity, client id)
        self._seq = 0

    def __len__(self) -> int:
        return len(self._owner)

    def seen(self, identity: bytes, now: float) -> None:
        """Any frame from a client (ping included) proves it alive."""
        c = self._clients.get(identity)
        if c is None:
            self._clients[identity] = _Client(now)
        else:
            c.last_seen = now

    def start(self, identity: bytes, client_req_id: str, now: float) -> str:
        """Register a generate; returns the internal id. Raises DuplicateRequestId."""
        self.seen(identity, now)
        c = self._clients[identity]
        if client_req_id in c.requests:
            raise DuplicateRequestId(f"field `id`: request {client_req_id!r} is already in flight "
                                     "from this client")
        # A counter keeps internal ids unique even if a client reuses an id later.
        self._seq += 1
        internal = f"{identity.hex()}.{self._seq}"
        c.requests[client_req_id] = internal
        self._owner[internal] = (identity, client_req_id)
        return internal

    def internal_id(self, identity: bytes, client_req_id: str) -> str | None:
        c = self._clients.get(identity)
        return None if c is None else c.requests.get(client_req_id)

    def owner(self, internal_id: str) -> tuple[bytes, str] | None:
        """(identity, client request id) to route an answer to, None if nobody waits."""
        return self._owner.get(internal_id)

    def finish(self, internal_id: str) -> tuple[bytes, str] | None:
        """The final answer went out (or was given up on): forget the request."""
        own = self._owner.pop(internal_id, None)
        if own is not None:
            c = self._clients.get(own[0])
            if c is not None:
                c.requests.pop(own[1], None)
        return own

    def drop_client(self, identity: bytes) -> list[str]:
        """Client said bye or became unreachable: its in-flight internal ids, now forgotten."""
        c = self._clients.pop(identity, None)
        if c is None:
            return []
        for internal in c.requests.values():
            self._owner.pop(internal, None)
        return list(c.requests.values())

    def expired(self, now: float) -> list[str]:
        """Drop clients silent for longer than the idle time-out; their in-flight ids."""
        dead = [i for i, c in self._clients.items() if now - c.last_seen > self.idle_timeout_s]
        out: list[str] = []
        for identity in dead:
            out += self.drop_client(identity)
        return out
