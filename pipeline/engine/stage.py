"""Engine stage process loop: the one Scheduler (block table, request states, prefix cache).

Inputs (wait_any on one doorbell): new requests and client aborts from the tokenizer stage,
stop-string hits from the token processor, sampled tokens from worker rank 0. Outputs: each
step's SchedulerOutput to the workers (broadcast ring), EngineOutputs to the token processor
and an EngineStats snapshot to the gateway a few times a second. Only this process allocates,
frees or caches KV blocks. When idle it audits the block table and logs violations with the
ids. State besides the scheduler: the step timing counters (engine overhead vs worker time).
"""
from __future__ import annotations

import time

import msgspec

from pipeline.engine.scheduler import Scheduler
from pipeline.ipc.ring import wait_any
from pipeline.messages import AbortRequest, EngineOutput, EngineOutputs, EngineRequest
from pipeline.runtime import rings
from pipeline.runtime.process import ReadyFn, log
from pipeline.runtime.spec import StageSpec

STATS_INTERVAL_S = 0.25


class StepTimes(msgspec.Struct):
    steps: int = 0
    step_s: float = 0.0  # schedule -> broadcast -> result -> update, wall time
    worker_s: float = 0.0  # the worker's execute() (forward + sampling) within those steps

    @property
    def overhead_share(self) -> float:
        return (self.step_s - self.worker_s) / self.step_s if self.step_s > 0 else 0.0


class EngineLoop:
    def __init__(self, spec: StageSpec) -> None:
        m = spec.model
        assert m is not None, "the engine is started after the worker reported its KV cache"
        self.spec = spec
        self.sched = Scheduler(spec.config, m.num_blocks, m.block_size, m.max_model_len)
        self.requests = rings.attach(spec, "requests")  # tokenizer -> engine
        self.stops = rings.attach(spec, "stops")  # token processor -> engine
        self.results = rings.attach(spec, "results")  # worker rank 0 -> engine
        self.steps = rings.attach(spec, "steps", "writer")  # engine -> workers
        self.outputs = rings.attach(spec, "outputs", "writer")  # engine -> token processor
        self.stats_ring = rings.attach(spec, "stats", "writer")  # engine -> gateway
        self.invariants_checked = True
        self.times = StepTimes()
        self.next_stats = 0.0

    def _abort(self, msg: AbortRequest) -> list[EngineOutput]:
        return self.sched.abort_requests(msg.req_ids, msg.reason, msg.message)

    def _drain_inputs(self) -> list[EngineOutput]:
        outs: list[EngineOutput] = []
        while (msg := self.requests.try_recv()) is not None:
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
        return outs

    def _emit(self, outs: list[EngineOutput]) -> None:
        if outs:
            self.outputs.send(EngineOutputs(outputs=outs, timestamp=time.time()))

    def step(self) -> None:
        t0 = time.perf_counter()
        sched_out = self.sched.schedule()
        self.steps.send(sched_out)
        # No deadline: a long prefill may take a while; the wait raises PeerDied if the
        # worker dies meanwhile.
        result = self.results.recv(timeout=None)
        outs = self.sched.update_from_output(sched_out, result)
        self._emit(outs)
        if sched_out.total_num_scheduled_tokens:
            self.times.steps += 1
            self.times.step_s += time.perf_counter() - t0
            self.times.worker_s += result.execute_s

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

    def run_forever(self) -> None:
        while True:
            self._emit(self._drain_inputs())
            now = time.monotonic()
            if now >= self.next_stats:
                self.publish_stats(now)
            if self.sched.has_unfinished_requests():
                self.step()
                continue
            if not self.invariants_checked:
                self.check_invariants()
                self.publish_stats(now)  # so "all blocks free" is visible at once
            try:
                wait_any([self.requests.ring, self.stops.ring], STATS_INTERVAL_S)
            except TimeoutError:
                pass


def run(spec: StageSpec, ready: ReadyFn) -> None:
    loop = EngineLoop(spec)
    m = loop.sched
    log(spec, f"scheduler ready: {m.kv.pool.num_blocks} KV blocks of {m.block_size} tokens, "
              f"max_num_seqs {spec.config.max_num_seqs}, max_num_batched_tokens "
              f"{spec.config.max_num_batched_tokens}")
    ready({})
    loop.run_forever()
