"""A ZMQ front end (the daemon, the router): which client owns which in-flight request.

State: per client identity (the ROUTER routing id) that has requests in flight, its
requests; per request the internal id (the stages' id in the daemon, the router's own id
there). A client is known only while it has requests in flight, so the table is bounded by
the requests in flight whatever clients come and go. See ``protocol``'s docstring for how a
client is declared gone (``bye``, its connection gone); ``drop_client`` returns the internal
ids the front end must abort (in the engine, on the instances). Not thread-safe: the
server's ZMQ loop (``zmq_server``) owns it.
"""
from __future__ import annotations


class DuplicateRequestId(ValueError):
    pass


class ClientSessions:
    """Maps (client identity, client request id) <-> internal request id."""

    def __init__(self, prefix: str | None = None) -> None:
        """Internal ids are ``<prefix><n>`` (the router's "r12"), else ``<identity hex>.<n>``."""
        self._prefix = prefix
        self._clients: dict[bytes, dict[str, str]] = {}  # identity -> {client id: internal id}
        self._owner: dict[str, tuple[bytes, str]] = {}  # internal id -> (identity, client id)
        self._seq = 0

    def __len__(self) -> int:
        return len(self._owner)

    def start(self, identity: bytes, client_req_id: str) -> str:
        """Register a generate; returns the internal id. Raises DuplicateRequestId."""
        requests = self._clients.setdefault(identity, {})
        if client_req_id in requests:
            raise DuplicateRequestId(f"field `id`: request {client_req_id!r} is already in flight "
                                     "from this client; this generate was not run (the running "
                                     "request's answer still comes)")
        # A counter keeps internal ids unique even if a client reuses an id later.
        self._seq += 1
        internal = (f"{self._prefix}{self._seq}" if self._prefix is not None
                    else f"{identity.hex()}.{self._seq}")
        requests[client_req_id] = internal
        self._owner[internal] = (identity, client_req_id)
        return internal

    def internal_id(self, identity: bytes, client_req_id: str) -> str | None:
        return self._clients.get(identity, {}).get(client_req_id)

    def owner(self, internal_id: str) -> tuple[bytes, str] | None:
        """(identity, client request id) to route an answer to, None if nobody waits."""
        return self._owner.get(internal_id)

    def clients(self) -> list[bytes]:
        """The identities with requests in flight (the ones whose connection matters)."""
        return list(self._clients)

    def finish(self, internal_id: str) -> tuple[bytes, str] | None:
        """The final answer went out (or was given up on): forget the request."""
        own = self._owner.pop(internal_id, None)
        if own is not None:
            requests = self._clients[own[0]]
            del requests[own[1]]
            if not requests:
                del self._clients[own[0]]
        return own

    def drop_client(self, identity: bytes) -> list[str]:
        """Client said bye or its connection is gone: its in-flight internal ids, now forgotten."""
        requests = self._clients.pop(identity, {})
        for internal in requests.values():
            del self._owner[internal]
        return list(requests.values())
