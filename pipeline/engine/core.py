"""Engine stage: ``EngineCore``, the one schedule -> execute -> update -> emit loop.

Owns / State: the Scheduler (and through it the block table and the KV connector), the
steps sent to the executor and not answered yet (``engine.inflight.EngineSteps``, with the
step timing counters), and an optional ``StepLog``. Used by the engine stage process (its
executor: the step and result rings), the in-process ``LLM`` and the benches (a ModelRunner
or FakeWorker called in process).

One ``step()``: if fewer than ``depth`` steps are out and there is work, schedule one, hand
the connector's plan to the cache messager (before the step: the messager waits for the
step's layers as they are written) and submit the step; then, when ``depth`` steps are out
or nothing new could be sent, take the oldest step's result, update the scheduler, emit
the outputs and send what the connector owes the messager. ``depth`` 1 is the synchronous
engine; 2 (async scheduling, mixed instances only) sends step N+1 while the worker runs N,
so the engine's time, and a slow consumer's, hide behind the worker's (not behind a step with
a long prefill: ``EngineSteps.behind_long``).
"""
from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from typing import Any, Protocol

from pipeline.engine.inflight import MAX_STEPS_IN_FLIGHT, EngineSteps
from pipeline.engine.scheduler import Scheduler
from pipeline.engine.step_log import StepLog
from pipeline.messages import EngineOutput, EngineRequest, ModelRunnerOutput, SchedulerOutput
from pipeline.messages.kv import TransferPlan


class Executor(Protocol):
    """Runs steps in order: ``submit`` hands one over, ``result`` waits for the oldest's."""

    def submit(self, sched: SchedulerOutput) -> None: ...

    def result(self) -> ModelRunnerOutput: ...


class LocalExecutor:
    """A worker in this process (``execute(SchedulerOutput) -> ModelRunnerOutput``: a
    ModelRunner, a FakeWorker), run when the result is asked for."""

    def __init__(self, worker: Any) -> None:
        self.worker = worker
        self.pending: deque[SchedulerOutput] = deque()

    def submit(self, sched: SchedulerOutput) -> None:
        self.pending.append(sched)

    def result(self) -> ModelRunnerOutput:
        out: ModelRunnerOutput = self.worker.execute(self.pending.popleft())
        return out


# Where the connector's messages go (the cache messager's ring): None when sent, else why
# not (the plan is then dropped and its requests' transfers failed).
SendKV = Callable[[Any], str | None]


class EngineCore:
    def __init__(self, sched: Scheduler, executor: Executor,
                 emit: Callable[[list[EngineOutput]], None], *, send_kv: SendKV | None = None,
                 step_log: StepLog | None = None) -> None:
        self.sched = sched
        self.executor = executor
        self._emit_to = emit
        self.send_kv = send_kv
        self.step_log = step_log
        self.inflight = EngineSteps(MAX_STEPS_IN_FLIGHT if sched.async_scheduling else 1,
                                    sched.long_prefill_token_threshold)
        self.times = self.inflight.times

    def emit(self, outs: list[EngineOutput]) -> None:
        if outs:
            self._emit_to(outs)

    # -- inputs --------------------------------------------------------------------------
    def add_request(self, er: EngineRequest) -> None:
        """Queue ``er``; one that can never fit is answered with an error, never queued."""
        try:
            self.sched.add_request(er)
        except ValueError as exc:
            self.emit([EngineOutput(req_id=er.req_id, new_token_ids=[], finish_reason="error",
                                    error=str(exc))])

    def abort(self, req_ids: list[str], reason: str = "abort", message: str = "") -> None:
        self.emit(self.sched.abort_requests(req_ids, reason, message))
        self.flush_kv()

    def on_kv_message(self, msg: Any) -> None:
        """What the cache messager reports (ValueError: not for this instance's connector)."""
        conn = self.sched.connector
        if conn is None:
            raise ValueError(f"{type(msg).__name__} on a mixed instance")
        self.emit(conn.on_message(msg))
        self.flush_kv()

    def poll(self) -> bool:
        """The connector's deadlines and queued work between steps; whether anything changed."""
        conn = self.sched.connector
        if conn is None:
            return False
        free = self.sched.kv.pool.num_free_blocks
        outs = conn.poll()
        self.emit(outs)
        self.flush_kv()
        return bool(outs) or self.sched.kv.pool.num_free_blocks != free

    def next_deadline(self) -> float | None:
        """When a connector deadline falls (the scheduler's clock); None: none."""
        conn = self.sched.connector
        return None if conn is None else conn.next_deadline()

    def has_work(self) -> bool:
        return self.sched.has_unfinished_requests() or bool(self.inflight)

    # -- the step ------------------------------------------------------------------------
    def step(self) -> bool:
        """One step; False when it could run nothing and preempted nothing (only an input, or
        a deadline, can change that: blocks held by reservations or leases)."""
        sched, q = self.sched, self.inflight
        sent = progressed = False
        # Not ahead of a long prefill (EngineSteps.behind_long): this call returns after sending
        # it, so the stage takes in the requests queued meanwhile, and the next call waits.
        if not q.full and not q.behind_long and sched.has_unfinished_requests():
            t0 = time.perf_counter()
            so = sched.schedule()
            progressed = bool(so.total_num_scheduled_tokens or so.preempted_req_ids)
            outs = self._send_plan()
            # A step with nothing for the workers (every running request waits for a result,
            # none could be admitted) is not sent.
            if so.num_scheduled_tokens or so.finished_req_ids or so.preempted_req_ids:
                self.executor.submit(so)
                q.push(so, t0)
                sent = True
                if self.step_log is not None:
                    self.step_log.scheduled(so, t0)
            self.emit(outs)
        if q and (q.full or not sent):
            so, t0 = q.pop()
            t_wait = time.perf_counter()
            result = self.executor.result()
            t_result = time.perf_counter()
            outs = sched.update_from_output(so, result)
            self.times.add(so, t0, result.execute_s)
            if self.step_log is not None:  # before the outputs: a last answer may end the process
                self.step_log.finished(so, result, t_result - t_wait, time.perf_counter() - t_result,
                                       len(outs), len(sched.running), len(sched.waiting))
            self.emit(outs)
            self.flush_kv()
            return True
        return progressed or sent

    def _send_plan(self) -> list[EngineOutput]:
        """The outputs schedule() made (reservations) and, before the step, its plan."""
        conn = self.sched.connector
        if conn is None:
            return []
        outs = conn.take_outputs()
        plan: TransferPlan | None = conn.take_plan()
        if plan is not None:
            why = self.send_kv(plan) if self.send_kv is not None else "no cache messager"
            if why is not None:
                outs += conn.drop_plan(plan, why)
        self.flush_kv()  # what schedule() owes the messager now (a KV tier's loads)
        return outs

    def flush_kv(self) -> None:
        """The KVFinish messages owed to the cache messager, after everything that made them
        (a step's update, aborts, failed reports): each follows its request's last plan."""
        conn = self.sched.connector
        if conn is None or self.send_kv is None:
            return
        for f in conn.take_kv_finishes():
            self.send_kv(f)

    def run_until_done(self, recv_kv: Callable[[float], Any] | None = None) -> None:
        """Step until no request is left (in process: every input is already queued).
        ``recv_kv(timeout)``: the next message of an in-process cache messager (a KV tier's
        reports) or None; with it, requests the connector holds (loading) are waited for."""
        if recv_kv is None:
            while self.has_work():
                self.step()
            return
        while self.has_work() or self.sched.requests:
            while (msg := recv_kv(0)) is not None:
                self.on_kv_message(msg)
            if not self.step():
                msg = recv_kv(1.0)  # nothing could run: a report frees blocks or lands a load
                if msg is not None:
                    self.on_kv_message(msg)
