"""Engine stage: steps in flight, the bookkeeping behind async scheduling (vLLM v1's design).

With async scheduling the engine schedules step N+1 right after sending step N, before N's
result is back, so the worker need not wait for the engine. Per request this module keeps what
its steps in flight hold: their ids (oldest first: results come back in step order, so a
result for any other step is stale), the tokens they compute (``num_inflight_tokens``: their
KV is being written) and the tokens they sample (``num_placeholders``: the worker appends
each to its own copy of the request, the engine learns it only from the result). Scheduling
counts on both ("optimistic"): a request whose step N samples decodes that token in step
N+1, into a slot allocated for it now. The confirmed state (``num_computed_tokens``, the
token ids, hence every block hash and the prefix cache) advances only with results, so a
token computed ahead for a request that ended (EOS, stop token, stop string, abort) or was
preempted meanwhile is dropped with its stale result: never streamed, never counted, never
hashed. ``EngineSteps`` is the stage's side: the steps sent but not answered, and the step
timing counters.

Owns no state of its own beyond ``EngineSteps``; the per-request fields live on Request.
"""
from __future__ import annotations

import time
from collections import deque

import msgspec

from pipeline.engine.request import Request
from pipeline.messages import SchedulerOutput

# Steps sent and not answered: the one the worker runs plus one queued behind it. A deeper
# queue would only add latency (each step's inputs are older) for no more overlap.
MAX_STEPS_IN_FLIGHT = 2


def may_run_ahead(req: Request, max_model_len: int) -> bool:
    """Whether ``req``, in flight, may be scheduled again before its results are back.

    Not when its next input depends on a result in a way the worker cannot know itself: a
    token in flight that certainly ends it by length (the slot after it must not be computed:
    it may lie past max_model_len and past the blocks its admission counted on). Any other
    token may end it too (EOS, stop token, stop string, abort): then the step run ahead is
    dropped as stale.
    """
    if req.num_placeholders:
        n = len(req.all_token_ids) + req.num_placeholders
        return n < req.max_num_tokens and n < max_model_len
    return True


def mark_scheduled(req: Request, step: int, n: int, drafts: int = 0) -> None:
    """``req`` runs ``n`` tokens in ``step`` (the last ``drafts`` of them speculative drafts,
    beyond its known tokens); it samples a token when they reach the last known one
    (counting the tokens its earlier steps in flight sample)."""
    req.inflight_steps.append(step)
    req.num_inflight_tokens += n
    if (req.num_computed_tokens + req.num_inflight_tokens - drafts
            == len(req.all_token_ids) + req.num_placeholders):
        req.num_placeholders += 1


def take_result(req: Request, step: int, n: int) -> bool:
    """Account ``step``'s ``n`` tokens of ``req`` as computed; False (and nothing changes)
    when the result is stale: ``req`` is not in flight in ``step`` any more."""
    steps = req.inflight_steps
    if not steps or steps[0] != step:
        return False
    steps.pop(0)
    req.num_inflight_tokens -= n
    req.num_computed_tokens += n
    return True


def reset(req: Request) -> None:
    """Forget every step in flight (finished, aborted, preempted): their results are stale."""
    req.inflight_steps.clear()
    req.num_inflight_tokens = 0
    req.num_placeholders = 0


def check(req: Request, block_size: int) -> list[str]:
    """Violations of the in-flight bookkeeping of a live request (for the idle audit)."""
    errs = []
    n_steps = len(req.inflight_steps)
    if (req.num_inflight_tokens > 0) != (n_steps > 0) or req.num_placeholders > n_steps:
        errs.append(f"request {req.req_id}: {n_steps} steps in flight with "
                    f"{req.num_inflight_tokens} tokens and {req.num_placeholders} placeholders")
    need = req.num_computed_tokens + req.num_inflight_tokens
    if n_steps and need > len(req.blocks) * block_size:
        errs.append(f"request {req.req_id}: {need} tokens computed or in flight but "
                    f"{len(req.blocks)} blocks of {block_size}")
    return errs


class StepTimes(msgspec.Struct):
    """Steps that ran tokens; their wall time: from the start of the step's schedule, or the
    end of the previous step's update if later (steps overlap when scheduled ahead: then it
    is the interval between results), to the end of its update; the worker's execute()
    (forward + sampling) within them. Idle gaps are in neither."""
    steps: int = 0
    step_s: float = 0.0
    worker_s: float = 0.0
    last_end: float = 0.0

    @property
    def overhead_share(self) -> float:
        return (self.step_s - self.worker_s) / self.step_s if self.step_s > 0 else 0.0

    def add(self, sched: SchedulerOutput, t_begin: float, execute_s: float) -> None:
        now = time.perf_counter()
        start = max(t_begin, self.last_end)
        self.last_end = now
        if sched.total_num_scheduled_tokens:
            self.steps += 1
            self.step_s += now - start
            self.worker_s += execute_s


class EngineSteps:
    """The steps sent to the workers and not answered yet, oldest first, with when each
    started (``StepTimes.add``).

    ``behind_long``: the newest step out computes more than ``long_prefill`` prompt tokens (the
    scheduler's long-prefill threshold). Such a step lasts many decode steps, so scheduling
    ahead of it hides the engine's milliseconds behind seconds (CPU) for nothing, while the
    step scheduled ahead is fixed before the requests that arrive during the long one: a burst
    of 32 prompts went 16 | 6 | 10 into three steps instead of 16 | 16 into two, and each step
    beyond the first held every running stream for seconds (docs/benchmarks.md, 12-04)."""

    def __init__(self, depth: int, long_prefill: int) -> None:
        self.depth = depth
        self.long_prefill = long_prefill
        self.sent: deque[tuple[SchedulerOutput, float]] = deque()
        self.times = StepTimes()

    def __len__(self) -> int:
        return len(self.sent)

    @property
    def full(self) -> bool:
        return len(self.sent) >= self.depth

    @property
    def behind_long(self) -> bool:
        return bool(self.sent) and self.sent[-1][0].num_prefill_tokens > self.long_prefill

    def push(self, sched: SchedulerOutput, t_begin: float) -> None:
        self.sent.append((sched, t_begin))

    def pop(self) -> tuple[SchedulerOutput, float]:
        return self.sent.popleft()
