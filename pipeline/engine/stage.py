"""Engine stage process loop: the one Scheduler (block table, request states, prefix cache).

Inputs (wait_any on one doorbell): new requests and client aborts from the tokenizer stage,
stop-string hits from the token processor, sampled tokens from worker rank 0. Outputs: each
step's SchedulerOutput to the workers (broadcast ring), EngineOutputs to the token processor
and an EngineStats snapshot to the gateway a few times a second. Only this process allocates,
frees or caches KV blocks. When idle it audits the block table and logs violations with the
ids. State besides the scheduler: the steps sent and not answered, and the step timing
counters (engine overhead vs worker time), in ``engine.inflight.EngineSteps``.

Async scheduling (mixed role): step N+1 is sent right after step N and waits in the step
ring while the worker runs N; N's result is then processed (outputs emitted) while the worker
runs N+1, so the engine's time, and a slow token processor's (outputs ring full), hide
behind the worker's. The other roles stay synchronous: a prefill-role step's TransferPlan
is made from its requests' confirmed state and their first token ends (or parks) them, so
running one ahead is unsafe; the decode role has nothing known unsafe but is verified only so.

Disaggregation (``config.role``). Prefill: each step's TransferPlan goes to the cache messager
(ring kv_plans) before the step goes to the workers, the KVFinish messages after the step's
update; the messager's TransferReports (ring kv_reports) release the plan's blocks (and, with
--pd-fallback local, end or resume the requests parked after their first token). Decode:
KVReady messages (ring kv_ready) complete reservations, or free the quarantined blocks of an
ended one; reservations are made and expired, and quarantined blocks past their deadline
freed, every loop iteration, and an idle loop waits no later than the next such deadline.
The kv rings share the engine's doorbell, so one wait_any covers them.
"""
from __future__ import annotations

import time
import traceback

import msgspec

from pipeline.engine.inflight import MAX_STEPS_IN_FLIGHT, EngineSteps
from pipeline.engine.scheduler import Scheduler
from pipeline.engine.step_log import StepLog
from pipeline.ipc.ring import wait_any
from pipeline.messages import (
    AbortRequest,
    EngineOutput,
    EngineOutputs,
    EngineRequest,
    ModelRunnerOutput,
    SchedulerOutput,
)
from pipeline.messages.kv import TransferPlan
from pipeline.runtime import rings
from pipeline.runtime.process import ReadyFn, log
from pipeline.runtime.spec import StageSpec

STATS_INTERVAL_S = 0.25
# Requests (and client aborts, in order) taken per loop iteration. Each iteration also sends
# a step, so during a burst (256 prompts at once) the worker computes the first arrivals
# while the engine takes in the rest; taking the whole burst first left the worker idle for
# 10-15 ms on 2 cores. A step admits far fewer (its token budget) anyway.
MAX_REQUESTS_PER_ITERATION = 64


class EngineLoop:
    def __init__(self, spec: StageSpec) -> None:
        m = spec.model
        assert m is not None, "the engine is built once the worker reported its KV cache"
        self.spec = spec
        self.sched = Scheduler(spec.config, m.kv.num_blocks, m.kv.block_size, m.max_model_len)
        self.requests = rings.attach(spec, "requests")  # tokenizer -> engine
        self.stops = rings.attach(spec, "stops")  # token processor -> engine
        self.results = rings.attach(spec, "results")  # worker rank 0 -> engine
        self.steps = rings.attach(spec, "steps", "writer")  # engine -> workers
        self.outputs = rings.attach(spec, "outputs", "writer")  # engine -> token processor
        self.stats_ring = rings.attach(spec, "stats", "writer")  # engine -> gateway
        role = spec.config.role
        # Disaggregation: engine <-> this instance's cache messager.
        self.kv_plans = rings.attach(spec, "kv_plans", "writer") if role == "prefill" else None
        self.kv_reports = rings.attach(spec, "kv_reports") if role == "prefill" else None
        self.kv_ready = rings.attach(spec, "kv_ready") if role == "decode" else None
        self.wait_rings = [c.ring for c in (self.requests, self.stops, self.kv_reports,
                                            self.kv_ready) if c is not None]
        self.invariants_checked = True
        # Async scheduling in the mixed role only (the module docstring says why).
        self.async_scheduling = role == "mixed"
        self.sched.async_scheduling = self.async_scheduling
        self.inflight = EngineSteps(MAX_STEPS_IN_FLIGHT if self.async_scheduling else 1)
        self.times = self.inflight.times
        self.next_stats = 0.0
        self.step_log = StepLog(spec.config.step_log) if spec.config.step_log else None

    def _abort(self, msg: AbortRequest) -> list[EngineOutput]:
        return self.sched.abort_requests(msg.req_ids, msg.reason, msg.message)

    def _drain_inputs(self) -> list[EngineOutput]:
        outs: list[EngineOutput] = []
        for _ in range(MAX_REQUESTS_PER_ITERATION):
            if (msg := self.requests.try_recv()) is None:
                break
            if isinstance(msg, EngineRequest):
                try:
                    self.sched.add_request(msg)
                except ValueError as exc:  # can never fit: answered, never queued forever
                    outs.append(EngineOutput(req_id=msg.req_id, new_token_ids=[],
                                             finish_reason="error", error=str(exc)))
            else:
                outs += self._abort(msg)
            self.invariants_checked = False
        while (stop := self.stops.try_recv()) is not None:
            outs += self._abort(stop)
            self.invariants_checked = False
        outs += self._drain_kv()
        return outs

    def _drain_kv(self) -> list[EngineOutput]:
        """The cache messager's reports (prefill) or KVReady messages (decode). A message the
        scheduler cannot take is logged and dropped: it must not kill the engine."""
        outs: list[EngineOutput] = []
        for ch, take in ((self.kv_reports, self.sched.on_transfer_report),
                         (self.kv_ready, self.sched.on_kv_ready)):
            if ch is None:
                continue
            while True:
                try:
                    msg = ch.try_recv()
                except (ValueError, msgspec.ValidationError) as exc:
                    log(self.spec, f"bad message on ring {ch.role} dropped: {exc}")
                    continue
                if msg is None:
                    break
                try:
                    outs += take(msg)
                except Exception as exc:  # noqa: BLE001 - a bad message must not end the engine
                    log(self.spec, f"engine could not apply {type(msg).__name__} from ring "
                                   f"{ch.role}: {exc!r}\n{traceback.format_exc()}")
                self.invariants_checked = False
        return outs

    def _send_kv_finishes(self) -> None:
        """KVFinish messages after everything that made them (the step's update, aborts,
        failed reports): on the plans ring, so each follows its request's last plan."""
        if self.kv_plans is None:
            return
        for f in self.sched.take_kv_finishes():
            self.kv_plans.send(f)

    def _send_plan(self, plan: TransferPlan) -> list[EngineOutput]:
        """Send the step's plan, or fail its requests when it exceeds the ring's messages."""
        assert self.kv_plans is not None
        buf = self.kv_plans.encode(plan)
        limit = self.kv_plans.max_message_bytes
        if len(buf) <= limit:
            self.kv_plans.send_encoded(buf)
            return []
        why = (f"the KV transfer plan of step {plan.step_id} is {len(buf)} bytes, over the "
               f"kv_plans ring's limit of {limit} bytes (max_num_seqs / max_num_batched_tokens "
               f"/ block size too large for it)")
        log(self.spec, why)
        return self.sched.drop_plan(plan, why)

    def _emit(self, outs: list[EngineOutput]) -> None:
        if outs:
            self.outputs.send(EngineOutputs(outputs=outs, timestamp=time.time()))

    def step(self) -> bool:
        """One step; False when it could run nothing and preempted nothing (only an event
        from a ring, or a deadline, can change that: blocks held by reservations or leases)."""
        return self._step_async() if self.async_scheduling else self._step_sync()

    def _step_async(self) -> bool:
        """Schedule and send a step if fewer than MAX_STEPS_IN_FLIGHT are out; then, when
        that many are out or nothing new could be sent, take the oldest one's result."""
        sched, q = self.sched, self.inflight
        sent = progressed = False
        if not q.full and sched.has_unfinished_requests():
            t0 = time.perf_counter()
            sched_out = sched.schedule()
            progressed = bool(sched_out.total_num_scheduled_tokens or sched_out.preempted_req_ids)
            # A step with nothing for the workers (every running request waits for a result,
            # none could be admitted) is not sent.
            if sched_out.num_scheduled_tokens or sched_out.finished_req_ids or sched_out.preempted_req_ids:
                self.steps.send(sched_out)
                q.push(sched_out, t0)
                sent = True
                if self.step_log is not None:
                    self.step_log.scheduled(sched_out, t0)
            self._emit(sched.take_outputs())
        if q and (q.full or not sent):
            sched_out, t0 = q.pop()
            t_wait = time.perf_counter()
            # No deadline: a long prefill may take a while; PeerDied if the worker dies.
            result = self.results.recv(timeout=None)
            t_result = time.perf_counter()
            outs = sched.update_from_output(sched_out, result)
            self._emit(outs)
            self.times.add(sched_out, t0, result.execute_s)
            self._log_step(sched_out, result, t_wait, t_result, len(outs))
            return True
        return progressed or sent

    def _step_sync(self) -> bool:
        t0 = time.perf_counter()
        sched_out = self.sched.schedule()
        outs = self.sched.take_outputs()  # decode role: reservations made by this schedule
        plan = self.sched.take_plan()
        if plan is not None:
            # Before the step: the messager waits for the step's layers as they are written.
            outs += self._send_plan(plan)
        self.steps.send(sched_out)
        if self.step_log is not None:
            self.step_log.scheduled(sched_out, t0)
        self._emit(outs)
        t_wait = time.perf_counter()
        # No deadline: a long prefill may take a while; the wait raises PeerDied if the
        # worker dies meanwhile.
        result = self.results.recv(timeout=None)
        t_result = time.perf_counter()
        outs = self.sched.update_from_output(sched_out, result)
        self._emit(outs)
        self._send_kv_finishes()
        self.times.add(sched_out, t0, result.execute_s)
        self._log_step(sched_out, result, t_wait, t_result, len(outs))
        return bool(sched_out.total_num_scheduled_tokens or sched_out.preempted_req_ids)

    def _log_step(self, sched_out: SchedulerOutput, result: ModelRunnerOutput, t_wait: float,
                  t_result: float, outputs: int) -> None:
        if self.step_log is not None:
            self.step_log.finished(sched_out, result, t_result - t_wait, time.perf_counter() - t_result,
                                   outputs, len(self.sched.running), len(self.sched.waiting))

    def publish_stats(self, now: float) -> None:
        self.next_stats = now + STATS_INTERVAL_S
        t = self.times
        snap = msgspec.structs.replace(
            self.sched.stats(), engine_steps=t.steps, engine_step_seconds=t.step_s,
            engine_worker_seconds=t.worker_s, engine_overhead_share=t.overhead_share,
            timestamp=time.time())
        try:
            self.stats_ring.send(snap, timeout=0)
        except TimeoutError:
            pass  # the gateway has not read the previous snapshot; this one is not needed

    def check_invariants(self) -> None:
        for err in self.sched.check_invariants():
            log(self.spec, f"block table invariant violated: {err}")
        self.invariants_checked = True

    def run_once(self) -> None:
        """One loop iteration: take every input, then one step, or a wait for input."""
        sched = self.sched
        outs = self._drain_inputs()
        free = sched.kv.pool.num_free_blocks
        # Decode role: free expired quarantines, expire reservations, make new ones.
        polled = sched.poll_kv()
        if polled or sched.kv.pool.num_free_blocks != free:
            self.invariants_checked = False  # audit (and publish) the change once idle
        outs += polled
        self._emit(outs)
        self._send_kv_finishes()
        now = time.monotonic()
        if now >= self.next_stats:
            self.publish_stats(now)
        if sched.has_unfinished_requests() or self.inflight:
            if self.step():
                return
            # Nothing could run: wait for what frees blocks (a transfer report, a KVReady, an
            # abort, a reservation or quarantine deadline) instead of spinning on empty steps.
        elif not self.invariants_checked:
            self.check_invariants()
            self.publish_stats(now)  # so "all blocks free" is visible at once
        timeout = STATS_INTERVAL_S
        deadline = sched.next_kv_deadline()  # on the scheduler's clock: time.monotonic
        if deadline is not None:
            timeout = max(0.0, min(timeout, deadline - time.monotonic()))
        try:
            wait_any(self.wait_rings, timeout)
        except TimeoutError:
            pass

    def run_forever(self) -> None:
        while True:
            self.run_once()

    def close(self) -> None:
        if self.step_log is not None:
            self.step_log.close()
        for ch in (self.requests, self.stops, self.results, self.steps, self.outputs,
                   self.stats_ring, self.kv_plans, self.kv_reports, self.kv_ready):
            if ch is not None:
                ch.close()


def run(spec: StageSpec, ready: ReadyFn) -> None:
    loop = EngineLoop(spec)
    m = loop.sched
    log(spec, f"scheduler ready: {m.kv.pool.num_blocks} KV blocks of {m.block_size} tokens, "
              f"max_num_seqs {spec.config.max_num_seqs}, max_num_batched_tokens "
              f"{spec.config.max_num_batched_tokens}, role {spec.config.role}")
    ready({})
    loop.run_forever()
