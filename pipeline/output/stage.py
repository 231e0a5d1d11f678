"""Token processor stage process loop: EngineOutputs -> deltas and final answers.

Owns the OutputProcessor (per-request detokenizer, stop-string matcher, timings). Requests
are registered by the tokenizer stage (OutputRegistration) before the engine can see them,
so draining the registration ring before each batch of engine outputs always finds them.
Answers go to the gateway; a stop-string hit also goes back to the engine as an
AbortRequest(reason="stop") so the engine, the only owner of blocks, frees them. It never
frees blocks itself. The first token of a request is forwarded before any bookkeeping.
An answer too large for the answers ring is replaced by an error answer saying so, so the
request still gets its one final answer and the stage keeps serving.
"""
from __future__ import annotations

from pathlib import Path

import msgspec

from pipeline.ipc.ring import wait_any
from pipeline.messages import AbortRequest, EngineOutputs, ErrorInfo, RequestDelta, RequestResult, bytes_to_ids
from pipeline.output.detokenizer import DetokenizerTable
from pipeline.output.processor import OutputProcessor
from pipeline.runtime import rings
from pipeline.runtime.process import ReadyFn, log
from pipeline.runtime.spec import StageSpec


class OutputLoop:
    def __init__(self, spec: StageSpec) -> None:
        self.spec = spec
        self.proc = OutputProcessor(DetokenizerTable(Path(spec.config.model_config.model) / "tokenizer.json"))
        self.register = rings.attach(spec, "register")
        self.outputs = rings.attach(spec, "outputs")
        self.answers = rings.attach(spec, "answers", "writer")
        self.stops = rings.attach(spec, "stops", "writer")
        self.timeout = spec.ring_timeout_s

    def _drain_registrations(self) -> None:
        while (reg := self.register.try_recv()) is not None:
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
            self.stops.send(AbortRequest(req_ids=list(stop_ids), reason="stop"))

    def _send(self, out: RequestDelta | RequestResult) -> None:
        try:
            self.answers.send(out)
        except ValueError as exc:  # larger than the ring's largest message
            if not isinstance(out, RequestResult):
                raise
            log(self.spec, f"answer of {out.id!r} not sent: {exc}")
            self.answers.send(too_large(out, str(exc)))

    def run_forever(self) -> None:
        while True:
            batch = self.outputs.try_recv()
            if batch is None:
                self._drain_registrations()
                try:
                    wait_any([self.outputs.ring, self.register.ring], self.timeout)
                except TimeoutError:
                    pass
                continue
            self.handle(batch)


def too_large(res: RequestResult, why: str) -> RequestResult:
    """``res`` without its outputs, failed with a message naming its size and the limit."""
    return msgspec.structs.replace(
        res, text="", token_ids=[], finish_reason="error", stop_reason=None, logprobs=None,
        outputs=[], cumulative_logprob=None, prompt_logprobs=None,
        error=ErrorInfo("answer_too_large", f"the answer cannot be sent: {why}"))


def run(spec: StageSpec, ready: ReadyFn) -> None:
    loop = OutputLoop(spec)
    log(spec, "detokenizer ready")
    ready({})
    loop.run_forever()
