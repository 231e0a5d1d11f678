"""Engine stage: room for a running request's next tokens, and preemption by recompute when
the pool has none (the mechanism; ``engine.preemption`` chooses the victim).

Owns / State: nothing; changes the Scheduler's requests, running list, waiting queue and
counters through it, and the step's ``StepBudget`` (a victim scheduled earlier in the step
gives its tokens back).
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from pipeline.engine import inflight
from pipeline.engine.admission import StepBudget
from pipeline.engine.request import Request, RequestStatus

if TYPE_CHECKING:
    from pipeline.engine.scheduler import Scheduler


def grow(sched: Scheduler, req: Request, n: int, st: StepBudget) -> bool:
    """Room for ``n`` more tokens of running ``req``, preempting victims until it fits.

    False when ``req`` itself had to go. A victim already scheduled in this step gives
    its tokens back to the budget.
    """
    running = sched.running
    while (blocks := sched.kv.allocate_slots(req, req.num_inflight_tokens + n)) is None:
        victim = sched.policy.select_victim(running)
        if running[-1] is victim:
            running.pop()
        else:
            running.remove(victim)
        if victim.req_id in st.num_sched:  # its bookkeeping goes with preempt's reset
            st.budget += st.num_sched.pop(victim.req_id)
            st.new_blocks.pop(victim.req_id, None)
            st.spec.pop(victim.req_id, None)
        preempt(sched, victim)
        st.preempted.append(victim)
        if victim is req:
            return False
    if blocks:
        st.new_blocks[req.req_id] = [b.block_id for b in blocks]
    return True


def preempt(sched: Scheduler, req: Request) -> None:
    """``req`` (out of the running list) loses its blocks and goes back to the head of the
    waiting queue, to be computed again from the start."""
    sched.kv.free(req)
    req.status = RequestStatus.PREEMPTED
    req.num_computed_tokens = 0
    inflight.reset(req)
    req.sent_to_worker = False
    req.spec_token_ids = []
    req.num_preemptions += 1
    if sched.connector is not None:
        sched.connector.on_preempt(req)
    sched.num_preemptions += 1
    sched.admission.preempted()
    sched.waiting.add_front(req)
