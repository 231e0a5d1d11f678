"""Engine stage process loop: the rings around one ``EngineCore`` (``engine.core``).

Inputs (wait_any on one doorbell): new requests and client aborts from the tokenizer stage,
stop-string hits from the token processor, sampled tokens from worker rank 0, and the cache
messager's reports (prefill role: TransferReports on ring kv_reports; decode role: KVReady on
ring kv_ready; a KV tier, beside either: TierReports on kv_reports). Outputs: each step's
SchedulerOutput to the workers (broadcast ring; the core's executor), EngineOutputs to the
token processor, the KV connector's TransferPlans, KVFinish and TierPlan messages to the
cache messager (ring kv_plans) and an EngineStats snapshot to the gateway a few times a
second. Only this process allocates, frees or caches KV blocks. When idle it audits the
block table and logs violations with the ids; an idle loop waits no later than the
connector's next deadline (reservations, quarantine, sends).

Async scheduling in the mixed role only (``EngineCore``: depth 2). The other roles stay
synchronous: a prefill-role step's TransferPlan is made from its requests' confirmed state
and their first token ends (or parks) them, so running one ahead is unsafe; the decode role
has nothing known unsafe but is verified only so.
"""
from __future__ import annotations

import time
import traceback

import msgspec

from pipeline.engine.core import EngineCore
from pipeline.engine.kv_connector.composite import with_tier
from pipeline.engine.kv_connector.tier_index import tier_hash_key
from pipeline.engine.scheduler import Scheduler
from pipeline.engine.step_log import StepLog
from pipeline.ipc.ring import wait_any
from pipeline.messages import (
    EngineOutput,
    EngineOutputs,
    EngineRequest,
    ModelRunnerOutput,
    SchedulerOutput,
)
from pipeline.messages.kv import KVFinish, TransferPlan
from pipeline.runtime import rings
from pipeline.runtime.process import ReadyFn, log
from pipeline.runtime.spec import StageSpec

STATS_INTERVAL_S = 0.25
# Requests (and client aborts, in order) taken per loop iteration. Each iteration also sends
# a step, so during a burst (256 prompts at once) the worker computes the first arrivals
# while the engine takes in the rest; taking the whole burst first left the worker idle for
# 10-15 ms on 2 cores. A step admits far fewer (its token budget) anyway.
MAX_REQUESTS_PER_ITERATION = 64


class _RingExecutor:
    """Steps to the workers on the broadcast ring, results from worker rank 0."""

    def __init__(self, steps: rings.Channel, results: rings.Channel) -> None:
        self.steps = steps
        self.results = results

    def submit(self, sched: SchedulerOutput) -> None:
        self.steps.send(sched)

    def result(self) -> ModelRunnerOutput:
        # No deadline: a long prefill may take a while; PeerDied if the worker dies.
        out: ModelRunnerOutput = self.results.recv(timeout=None)
        return out


class EngineLoop:
    def __init__(self, spec: StageSpec) -> None:
        m = spec.model
        assert m is not None, "the engine is built once the worker reported its KV cache"
        self.spec = spec
        role = spec.config.kv_transfer_config.role
        # Async scheduling in the mixed role only (the module docstring says why).
        self.async_scheduling = role == "mixed"
        tier_dir = spec.config.cache_config.kv_offload_dir
        hash_key, connector = None, None
        self.tier_group = ""  # EngineStats.kv_tier_group: the router's tier siblings
        if tier_dir:  # a KV tier: its files are named by block hashes every instance shares
            layout = msgspec.structs.replace(m.kv, model_hash=m.kv_tier_id)
            hash_key = tier_hash_key(tier_dir)
            self.tier_group = layout.tier_group(hash_key)
            connector = with_tier(tier_dir, layout)  # with the role's (prefill, decode)
        self.sched = Scheduler(spec.config, m.kv.num_blocks, m.kv.block_size, m.max_model_len,
                               hash_key, async_scheduling=self.async_scheduling, connector=connector)
        self.requests = rings.attach(spec, "requests")  # tokenizer -> engine
        self.stops = rings.attach(spec, "stops")  # token processor -> engine
        self.results = rings.attach(spec, "results")  # worker rank 0 -> engine
        self.steps = rings.attach(spec, "steps", "writer")  # engine -> workers
        self.outputs = rings.attach(spec, "outputs", "writer")  # engine -> token processor
        self.stats_ring = rings.attach(spec, "stats", "writer")  # engine -> gateway
        # Disaggregation, a KV tier: engine <-> this instance's cache messager.
        plans = role == "prefill" or bool(tier_dir)
        self.kv_plans = rings.attach(spec, "kv_plans", "writer") if plans else None
        self.kv_reports = rings.attach(spec, "kv_reports") if plans else None
        self.kv_ready = rings.attach(spec, "kv_ready") if role == "decode" else None
        self.wait_rings = [c.ring for c in (self.requests, self.stops, self.kv_reports,
                                            self.kv_ready) if c is not None]
        self.invariants_checked = True
        self.core = EngineCore(self.sched, _RingExecutor(self.steps, self.results), self._emit,
                               send_kv=self._send_kv if self.kv_plans is not None else None,
                               step_log=StepLog(spec.config.step_log) if spec.config.step_log else None)
        self.inflight = self.core.inflight
        self.times = self.core.times
        self.next_stats = 0.0

    def _drain_inputs(self) -> None:
        core = self.core
        for _ in range(MAX_REQUESTS_PER_ITERATION):
            if (msg := self.requests.try_recv()) is None:
                break
            if isinstance(msg, EngineRequest):
                core.add_request(msg)
            else:
                core.abort(msg.req_ids, msg.reason, msg.message)
            self.invariants_checked = False
        while (stop := self.stops.try_recv()) is not None:
            core.abort(stop.req_ids, stop.reason, stop.message)
            self.invariants_checked = False
        self._drain_kv()

    def _drain_kv(self) -> None:
        """The cache messager's reports (prefill) or KVReady messages (decode). A message the
        scheduler cannot take is logged and dropped: it must not kill the engine."""
        for ch in (self.kv_reports, self.kv_ready):
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
                    self.core.on_kv_message(msg)
                except Exception as exc:  # noqa: BLE001 - a bad message must not end the engine
                    log(self.spec, f"engine could not apply {type(msg).__name__} from ring "
                                   f"{ch.role}: {exc!r}\n{traceback.format_exc()}")
                self.invariants_checked = False

    def _send_kv(self, msg: TransferPlan | KVFinish) -> str | None:
        """A plan or a KVFinish to the cache messager; a plan over the ring's messages is
        not sent (why, so the core fails its requests' transfers)."""
        assert self.kv_plans is not None
        buf = self.kv_plans.encode(msg)
        limit = self.kv_plans.max_message_bytes
        if len(buf) <= limit or not isinstance(msg, TransferPlan):
            self.kv_plans.send_encoded(buf)
            return None
        why = (f"the KV transfer plan of step {msg.step_id} is {len(buf)} bytes, over the "
               f"kv_plans ring's limit of {limit} bytes (max_num_seqs / max_num_batched_tokens "
               f"/ block size too large for it)")
        log(self.spec, why)
        return why

    def _emit(self, outs: list[EngineOutput]) -> None:  # never empty (EngineCore.emit)
        self.outputs.send(EngineOutputs(outputs=outs, timestamp=time.time()))

    def step(self) -> bool:
        return self.core.step()

    def publish_stats(self, now: float) -> None:
        self.next_stats = now + STATS_INTERVAL_S
        t = self.times
        snap = msgspec.structs.replace(
            self.sched.stats(), engine_steps=t.steps, engine_step_seconds=t.step_s,
            engine_worker_seconds=t.worker_s, engine_overhead_share=t.overhead_share,
            kv_tier_group=self.tier_group, timestamp=time.time())
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
        core = self.core
        self._drain_inputs()
        # Decode role: free expired quarantines, expire reservations, make new ones.
        if core.poll():
            self.invariants_checked = False  # audit (and publish) the change once idle
        now = time.monotonic()
        if now >= self.next_stats:
            self.publish_stats(now)
        if core.has_work():
            if core.step():
                return
            # Nothing could run: wait for what frees blocks (a transfer report, a KVReady, an
            # abort, a reservation or quarantine deadline) instead of spinning on empty steps.
        elif not self.invariants_checked:
            self.check_invariants()
            self.publish_stats(now)  # so "all blocks free" is visible at once
        timeout = STATS_INTERVAL_S
        deadline = core.next_deadline()  # on the scheduler's clock: time.monotonic
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
        if self.core.step_log is not None:
            self.core.step_log.close()
        for ch in (self.requests, self.stops, self.results, self.steps, self.outputs,
                   self.stats_ring, self.kv_plans, self.kv_reports, self.kv_ready):
            if ch is not None:
                ch.close()


def run(spec: StageSpec, ready: ReadyFn) -> None:
    loop = EngineLoop(spec)
    m = loop.sched
    log(spec, f"scheduler ready: {m.kv.pool.num_blocks} KV blocks of {m.block_size} tokens, "
              f"max_num_seqs {spec.config.scheduler_config.max_num_seqs}, max_num_batched_tokens "
              f"{spec.config.scheduler_config.max_num_batched_tokens}, role {spec.config.kv_transfer_config.role}")
    ready({})
    loop.run_forever()
