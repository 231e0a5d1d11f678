"""Engine stage: parallel sampling's families, the n child Requests of one client request.

Owns / State: client id -> its children (``parents``), for as long as one of them lives. Only
the first child is queued at first; its siblings are held (``Request.held``) and queued at its
place once its prompt's KV is computed and cached, so they take the prompt's full blocks from
the prefix cache instead of computing them again (each recomputes at most its last, partial
block, for its own first token's logits). Aborting the client id aborts every child.
"""
from __future__ import annotations

from collections.abc import Collection

from pipeline.engine.request import Request, RequestStatus
from pipeline.engine.request_queue import WaitingQueue


class Families:
    def __init__(self, waiting: WaitingQueue, caching: bool) -> None:
        self.waiting = waiting
        self.caching = caching
        self.parents: dict[str, list[Request]] = {}

    def add(self, client_id: str, children: list[Request]) -> None:
        """``children[0]`` is queued already; the others wait for its prompt's KV."""
        first = children[0]
        self.parents[client_id] = children
        first.held = children[1:]
        if not self.caching:
            self.release(first)  # nothing to share: no reason to wait

    def release(self, first: Request) -> None:
        """Queue the held siblings of ``first`` at its place in the queue."""
        held, first.held = first.held, []
        for c in held:
            if c.status == RequestStatus.WAITING:
                self.waiting.add(c, first.order)

    def children(self, client_id: str) -> list[Request] | None:
        return self.parents.get(client_id)

    def finished(self, req: Request, live: Collection[str]) -> None:
        """``req`` ended (``live``: the ids still in the engine)."""
        if req.held:  # never computed its prompt: the siblings compute it themselves
            self.release(req)
        children = self.parents.get(req.out_id)
        if children is not None and all(c.req_id not in live for c in children):
            del self.parents[req.out_id]
