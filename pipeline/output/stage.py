"""Token processor stage process loop: EngineOutputs -> deltas and final answers.

Owns the OutputProcessor (per-request detokenizer, stop-string matcher, timings). Requests
are registered by the tokenizer stage (OutputRegistration) before the engine can see them,
so draining the registration ring before each batch of engine outputs always finds them.
Answers go to the gateway; a stop-string hit also goes back to the engine as an
AbortRequest(reason="stop") so the engine, the only owner of blocks, frees them. It never
frees blocks itself. The first token of a request is forwarded before any bookkeeping.
"""
from __future__ import annotations

import time
from pathlib import Path

import msgspec

from pipeline.engine.messages import AbortRequest, EngineOutputs
from pipeline.engine.sched_output import bytes_to_ids
from pipeline.entrypoints.stages import ReadyFn, StageSpec, Unpacker, log, pack
from pipeline.ipc.ring import Ring, wait_any
from pipeline.output.detokenizer import DetokenizerTable
from pipeline.output.processor import OutputProcessor
from pipeline.output.types import ErrorInfo, RequestDelta, RequestResult, Timings, Usage
from pipeline.sampling_params import SamplingParams


class OutputRegistration(msgspec.Struct, array_like=True, kw_only=True):
    """tokenizer -> token processor: what it must know about a request before its tokens."""
    req_id: str
    prompt_token_ids: bytes  # little-endian int32
    sampling_params: SamplingParams
    stream: bool
    arrival_time: float


def error_result(req_id: str, code: str, message: str, *, finish_reason: str = "error",
                 arrival_time: float = 0.0) -> RequestResult:
    """A final answer that carries no tokens: invalid request, dead stage, drain abort."""
    now = time.time()
    arrival = arrival_time or now
    return RequestResult(id=req_id, text="", token_ids=[], finish_reason=finish_reason,
                         usage=Usage(), error=ErrorInfo(code=code, message=message),
                         timings=Timings(arrival_time=arrival, finish_time=now,
                                         e2e=now - arrival))


ANSWER_TYPES = {b"D": RequestDelta, b"R": RequestResult}


def pack_answer(out: RequestDelta | RequestResult) -> bytes:
    return pack(b"R" if isinstance(out, RequestResult) else b"D", out)


class OutputLoop:
    def __init__(self, spec: StageSpec) -> None:
        self.spec = spec
        self.proc = OutputProcessor(DetokenizerTable(Path(spec.config.model) / "tokenizer.json"))
        self.register = Ring.attach(spec.rings["register"])
        self.outputs = Ring.attach(spec.rings["outputs"])
        self.answers = Ring.attach(spec.rings["answers"], "writer")
        self.stops = Ring.attach(spec.rings["stops"], "writer")
        self.unpack_reg = Unpacker({b"G": OutputRegistration})
        self.decode_outputs = msgspec.msgpack.Decoder(EngineOutputs)
        self.timeout = spec.ring_timeout_s

    def _drain_registrations(self) -> None:
        while (buf := self.register.try_recv()) is not None:
            reg = self.unpack_reg(buf)
            prompt = bytes_to_ids(reg.prompt_token_ids)
            # The prompt's tail is enough for the detokenizer to continue the text correctly.
            self.proc.add_request(reg.req_id, reg.sampling_params, reg.arrival_time,
                                  stream=reg.stream, prompt_token_ids=prompt[-8:].tolist(),
                                  num_prompt_tokens=len(prompt))

    def handle(self, batch: EngineOutputs) -> None:
        self._drain_registrations()
        # Each answer goes out as it is made: a first token never waits for the batch.
        stop_ids = self.proc.process(batch, self._send)
        if stop_ids:
            self.stops.send(pack(b"A", AbortRequest(req_ids=list(stop_ids), reason="stop")))

    def _send(self, out: RequestDelta | RequestResult) -> None:
        self.answers.send(pack_answer(out))

    def run_forever(self) -> None:
        while True:
            buf = self.outputs.try_recv()
            if buf is None:
                self._drain_registrations()
                try:
                    wait_any([self.outputs, self.register], self.timeout)
                except TimeoutError:
                    pass
                continue
            self.handle(self.decode_outputs.decode(buf))


def run(spec: StageSpec, ready: ReadyFn) -> None:
    loop = OutputLoop(spec)
    log(spec, "detokenizer ready")
    ready({})
    loop.run_forever()
