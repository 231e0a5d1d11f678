"""Engine stage: the waiting queue of the scheduler (FCFS, or by ``priority`` when given).

A binary heap keyed by (priority, order): lower priority values run first, and within a
priority, arrival order. A preempted request re-enters with a negative order so it goes back
to the head of its priority class, the most recently preempted first. Aborted requests are
dropped lazily when they reach the head, so abort is O(1).
"""
from __future__ import annotations

import heapq
import itertools

from pipeline.engine.request import Request, RequestStatus


class WaitingQueue:
    __slots__ = ("_heap", "_arrivals", "_requeues", "_live")

    def __init__(self) -> None:
        self._heap: list[tuple[int, int, Request]] = []
        self._arrivals = itertools.count()
        self._requeues = itertools.count(1)
        self._live = 0

    def __len__(self) -> int:
        return self._live

    def add(self, req: Request) -> None:
        heapq.heappush(self._heap, (req.priority, next(self._arrivals), req))
        self._live += 1

    def add_front(self, req: Request) -> None:
        heapq.heappush(self._heap, (req.priority, -next(self._requeues), req))
        self._live += 1

    def discard(self, req: Request) -> None:
        """Account for ``req`` leaving while queued (it must already carry a FINISHED status)."""
        self._live -= 1

    def peek(self) -> Request | None:
        heap = self._heap
        while heap and heap[0][2].status >= RequestStatus.FINISHED_STOPPED:
            heapq.heappop(heap)
        return heap[0][2] if heap else None

    def pop(self) -> Request:
        req = self.peek()
        if req is None:
            raise IndexError("waiting queue is empty")
        heapq.heappop(self._heap)
        self._live -= 1
        return req
