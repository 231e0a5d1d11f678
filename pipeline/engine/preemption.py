"""Engine stage: which running request to preempt (by recompute) when blocks run out.

Stateless policies over the scheduler's running list (kept in admission order). The
scheduler frees the victim's blocks and puts it back at the head of the waiting queue; the
policy only chooses. Register more with ``POLICIES[name] = cls``.
"""
from __future__ import annotations

from typing import Protocol

from pipeline.engine.request import Request


class PreemptionPolicy(Protocol):
    name: str

    def select_victim(self, running: list[Request]) -> Request:
        """Pick a victim among ``running`` (never empty)."""
        ...


class NewestFirst:
    """The most recently admitted request loses least work and waited least (vLLM's FCFS)."""

    name = "newest"

    def select_victim(self, running: list[Request]) -> Request:
        return running[-1]


class LowestPriorityFirst:
    """The request with the largest ``priority`` value (lower runs first), newest on a tie."""

    name = "lowest_priority"

    def select_victim(self, running: list[Request]) -> Request:
        return max(running, key=lambda r: (r.priority, r.admit_seq))


POLICIES: dict[str, type] = {NewestFirst.name: NewestFirst,
                             LowestPriorityFirst.name: LowestPriorityFirst}


def make_policy(name: str) -> PreemptionPolicy:
    try:
        return POLICIES[name]()
    except KeyError:
        raise ValueError(f"preemption_policy must be one of {sorted(POLICIES)}, got {name!r}") from None
