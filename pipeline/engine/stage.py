"""Engine stage process loop: the one Scheduler (block table, request states, prefix cache).

Inputs (wait_any): new requests and client aborts from the tokenizer stage, stop-string hits
from the token processor, sampled tokens from worker rank 0. Outputs: each step's
SchedulerOutput to the workers (broadcast ring) and EngineOutputs to the token processor.
Only this process allocates, frees or caches KV blocks; everything else asks through a ring.
When idle it checks the block-table invariant and logs a violation with the request ids.
"""
from __future__ import annotations

import time

import msgspec

from pipeline.engine.messages import AbortRequest, EngineOutput, EngineOutputs, EngineRequest
from pipeline.engine.sched_output import ModelRunnerOutput
from pipeline.entrypoints.stages import ReadyFn, StageSpec, Unpacker, log
from pipeline.ipc.broadcast import BroadcastRing
from pipeline.ipc.ring import Ring, wait_any


class EngineLoop:
    def __init__(self, spec: StageSpec) -> None:
        from pipeline.engine.scheduler import Scheduler  # noqa: PLC0415

        m = spec.model
        assert m is not None, "the engine is started after the worker reported its KV cache"
        self.spec = spec
        self.sched = Scheduler(spec.config, m.num_blocks, m.block_size, m.max_model_len)
        self.requests = Ring.attach(spec.rings["requests"])  # tokenizer -> engine
        self.stops = Ring.attach(spec.rings["stops"])  # token processor -> engine
        self.results = Ring.attach(spec.rings["results"])  # worker rank 0 -> engine
        self.steps = BroadcastRing.attach_writer(spec.rings["steps"])  # engine -> workers
        self.outputs = Ring.attach(spec.rings["outputs"], "writer")  # engine -> token processor
        self.timeout = spec.ring_timeout_s
        self.invariants_checked = True
        self.unpack = Unpacker({b"E": EngineRequest, b"A": AbortRequest})
        self.encode = msgspec.msgpack.Encoder().encode
        self.decode_result = msgspec.msgpack.Decoder(ModelRunnerOutput).decode

    def _abort(self, msg: AbortRequest) -> list[EngineOutput]:
        res = self.sched.abort_requests(msg.req_ids, msg.reason)
        return list(res) if res else []

    def _drain_inputs(self) -> list[EngineOutput]:
        outs: list[EngineOutput] = []
        while (buf := self.requests.try_recv()) is not None:
            msg = self.unpack(buf)
            if isinstance(msg, EngineRequest):
                try:
                    self.sched.add_request(msg)
                except ValueError as exc:  # can never fit: answered, never queued forever
                    outs.append(EngineOutput(req_id=msg.req_id, new_token_ids=[],
                                             finish_reason="error", error=str(exc)))
            else:
                outs += self._abort(msg)
            self.invariants_checked = False
        while (buf := self.stops.try_recv()) is not None:
            outs += self._abort(self.unpack(buf))
            self.invariants_checked = False
        return outs

    def _emit(self, outs: list[EngineOutput]) -> None:
        if outs:
            self.outputs.send(self.encode(EngineOutputs(outputs=outs, timestamp=time.time())),
                              timeout=self.timeout * 30)

    def step(self) -> None:
        sched_out = self.sched.schedule()
        self.steps.send(self.encode(sched_out), timeout=self.timeout * 30)
        # No deadline: a long prefill may take a while, and the wait raises PeerDied if the
        # worker dies meanwhile.
        buf = self.results.recv(timeout=None)
        result = self.decode_result(buf)
        self._emit(self.sched.update_from_output(sched_out, result))

    def check_invariants(self) -> None:
        for err in self.sched.check_invariants():
            log(self.spec, f"block table invariant violated: {err}")
        self.invariants_checked = True

    def run_forever(self) -> None:
        while True:
            self._emit(self._drain_inputs())
            if self.sched.has_unfinished_requests():
                self.step()
                continue
            if not self.invariants_checked:
                self.check_invariants()
            try:
                wait_any([self.requests, self.stops], self.timeout)
            except TimeoutError:
                pass


def run(spec: StageSpec, ready: ReadyFn) -> None:
    loop = EngineLoop(spec)
    ready({})
    loop.run_forever()
