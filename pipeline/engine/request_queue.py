"""Engine stage: the waiting queue of the scheduler (FCFS, or by ``priority`` when given).

A binary heap keyed by (priority, order): lower priority values run first, and within a
priority, arrival order. A preempted request re-enters with a negative order so it goes back
to the head of its priority class, the most recently preempted first. The sibling
completions of a request (n > 1) queue at their first child's place. Aborted requests are
dropped lazily when they reach the head, so abort is O(1).
"""
from __future__ import annotations

import heapq
import itertools

from pipeline.engine.request import Request, RequestStatus


class WaitingQueue:
    __slots__ = ("_heap", "_arrivals", "_requeues", "_live")

    def __init__(self) -> None:
        # (priority, order, index, request): index tells siblings of one order apart.
        self._heap: list[tuple[int, int, int, Request]] = []
        self._arrivals = itertools.count()
        self._requeues = itertools.count(1)
        self._live = 0

    def __len__(self) -> int:
        return self._live

    def add(self, req: Request, order: int | None = None) -> int:
        """Queue in arrival order, or at ``order`` (what an earlier ``add`` returned: a
        sibling queues at its first child's place). Returns the order used."""
        if order is None:
            order = next(self._arrivals)
        self._push((req.priority, order, req.index, req))
        return order

    def add_front(self, req: Request) -> None:
        self._push((req.priority, -next(self._requeues), 0, req))

    def _push(self, item: tuple[int, int, int, Request]) -> None:
        heapq.heappush(self._heap, item)
        item[3].in_queue = True
        self._live += 1

    def discard(self, req: Request) -> None:
        """Account for ``req`` leaving (it must already carry a FINISHED status); a no-op
        if it is not queued."""
        if req.in_queue:
            req.in_queue = False
            self._live -= 1

    def peek(self) -> Request | None:
        heap = self._heap
        while heap and heap[0][3].status >= RequestStatus.FINISHED_STOPPED:
            heapq.heappop(heap)
        return heap[0][3] if heap else None

    def pop(self) -> Request:
        req = self.peek()
        if req is None:
            raise IndexError("waiting queue is empty")
        heapq.heappop(self._heap)
        req.in_queue = False
        self._live -= 1
        return req
