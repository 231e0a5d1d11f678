"""Token processor stage: turns the engine's sampled tokens into streaming deltas and answers.

State: one ``_ReqState`` per unfinished request (its incremental detokenizer, stop checker,
the output so far, its timings). It never touches blocks: when a stop string ends a request
it finishes the request here and returns its id so the stage can send
``AbortRequest(ids, reason="stop")`` to the engine, which frees the blocks.

Guarantees:
- exactly one ``RequestResult`` per request: once finished (stop string, abort, error), the
  state is gone and engine outputs still in flight for it are dropped (``num_dropped``);
- a request's deltas concatenated equal its final ``text`` / ``token_ids``;
- the first token of a request is emitted before anything else in the batch is processed
  (seed 000: the first token must not wait behind other requests' bookkeeping);
- per token O(token bytes + longest stop string) work: linear in output length.
"""
from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from pipeline.messages import (
    FINISH_REASONS,
    EngineOutput,
    EngineOutputs,
    ErrorInfo,
    RequestDelta,
    RequestResult,
    Timings,
    TokenLogprobs,
    Usage,
)
from pipeline.output.detokenizer import DetokenizerTable, IncrementalDetokenizer
from pipeline.output.stop_checker import StopChecker
from pipeline.sampling_params import SamplingParams

Emit = Callable[[RequestDelta | RequestResult], None]


@dataclass(slots=True)
class _ReqState:
    req_id: str
    params: SamplingParams
    stream: bool
    detok: IncrementalDetokenizer
    stop: StopChecker
    arrival_time: float
    num_prompt_tokens: int
    num_cached_tokens: int = 0
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_output_time: float = 0.0
    itl: list[float] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    text: list[str] = field(default_factory=list)
    logprobs: list[TokenLogprobs] | None = None


class OutputProcessor:
    """Per-request output state of the token processor stage (one instance per stage)."""

    def __init__(self, table: DetokenizerTable, clock: Callable[[], float] = time.time) -> None:
        self.table = table
        self.clock = clock
        self._reqs: dict[str, _ReqState] = {}
        self.num_dropped = 0  # outputs of requests already finished (or never added)

    @property
    def num_unfinished(self) -> int:
        return len(self._reqs)

    def add_request(self, req_id: str, params: SamplingParams, arrival_time: float, *,
                    stream: bool = False, prompt_token_ids: Sequence[int] | None = None,
                    num_prompt_tokens: int = 0) -> None:
        """Register a request before its first output. ``prompt_token_ids`` (its tail is
        enough) makes the text a continuation of the prompt; see IncrementalDetokenizer."""
        if req_id in self._reqs:
            raise ValueError(f"request id {req_id!r} is already in flight")
        self._reqs[req_id] = _ReqState(
            req_id=req_id, params=params, stream=stream,
            detok=self.table.detokenizer(params.skip_special_tokens, prompt_token_ids),
            stop=StopChecker(params.stop, params.include_stop_str_in_output),
            arrival_time=arrival_time,
            num_prompt_tokens=num_prompt_tokens or (0 if prompt_token_ids is None else len(prompt_token_ids)),
            logprobs=[] if params.logprobs is not None else None)

    def process(self, batch: EngineOutputs, emit: Emit) -> list[str]:
        """Emit deltas and final answers for one engine batch, in order per request.

        Returns the ids of requests that a stop string finished here while the engine still
        runs them: the stage must send ``AbortRequest(ids, reason="stop")`` to the engine.
        """
        now = self.clock()
        outs = batch.outputs
        stopped: list[str] = []
        # First tokens go out before anything else in the batch. A request seen earlier in
        # this batch keeps its order, so only its earliest output may jump the queue.
        seen: set[str] = set()
        later: list[EngineOutput] = []
        for o in outs:
            st = self._reqs.get(o.req_id)
            if st is not None and o.req_id not in seen and not st.token_ids and o.new_token_ids:
                self._process_one(st, o, now, emit, stopped)
            else:
                later.append(o)
            seen.add(o.req_id)
        for o in later:
            st = self._reqs.get(o.req_id)
            if st is None:
                self.num_dropped += 1
                continue
            self._process_one(st, o, now, emit, stopped)
        return stopped

    def abort(self, req_id: str, finish_reason: str = "abort",
              error: ErrorInfo | None = None) -> RequestResult | None:
        """Finish a request here (client gone, stage died, time-out). None if already over;
        later engine outputs for it are dropped. Its text is what was already released:
        a held-back possible stop-string prefix or incomplete character is dropped, so the
        final text still equals the concatenated deltas."""
        st = self._reqs.get(req_id)
        if st is None:
            return None
        return self._finish(st, finish_reason, None, error, self.clock())

    def _process_one(self, st: _ReqState, o: EngineOutput, now: float, emit: Emit,
                     stopped: list[str]) -> None:
        if o.first_scheduled_time and st.first_scheduled_time is None:
            st.first_scheduled_time = o.first_scheduled_time
        st.num_prompt_tokens = max(st.num_prompt_tokens, o.num_prompt_tokens)
        st.num_cached_tokens = max(st.num_cached_tokens, o.num_cached_tokens)
        if o.new_token_ids:
            if st.first_token_time is None:
                st.first_token_time = now
            else:
                st.itl.append(now - st.last_output_time)
            st.last_output_time = now
        p = st.params
        # A stop token / EOS that ended the request is kept in token_ids but, like vLLM,
        # not in the text unless include_stop_str_in_output.
        hide_last = (o.finish_reason == "stop" and isinstance(o.stop_reason, int)
                     and not p.include_stop_str_in_output)
        parts: list[str] = []
        start = len(st.token_ids)
        hit: str | None = None
        last = len(o.new_token_ids) - 1
        for i, tok in enumerate(o.new_token_ids):
            st.token_ids.append(tok)
            if hide_last and i == last and tok == o.stop_reason:
                continue
            text, hit = st.stop.feed(st.detok.add_token(tok), check=len(st.token_ids) >= p.min_tokens)
            parts.append(text)
            if hit is not None:
                break
        kept = len(st.token_ids) - start
        if st.logprobs is not None and o.logprobs:
            st.logprobs.extend(o.logprobs[:kept])
        finish = "stop" if hit is not None else o.finish_reason
        if finish is not None and hit is None:
            text, hit = st.stop.feed(st.detok.flush(), check=len(st.token_ids) >= p.min_tokens)
            parts.append(text)
            if hit is None:
                parts.append(st.stop.flush())
            else:
                finish = "stop"
        delta = "".join(parts)
        st.text.append(delta)
        if st.stream and (delta or kept):
            emit(RequestDelta(st.req_id, delta, st.token_ids[start:],
                              o.logprobs[:kept] if st.logprobs is not None and o.logprobs else None))
        if finish is None:
            return
        if hit is not None and o.finish_reason is None:
            stopped.append(st.req_id)  # the engine still runs it: it must be told
        error = ErrorInfo("engine_error", o.error) if o.error else None
        stop_reason = hit if hit is not None else o.stop_reason
        emit(self._finish(st, finish, stop_reason, error, now))

    def _finish(self, st: _ReqState, reason: str, stop_reason: int | str | None,
                error: ErrorInfo | None, now: float) -> RequestResult:
        del self._reqs[st.req_id]
        if reason not in FINISH_REASONS:
            error = error or ErrorInfo("engine_error", f"unknown finish_reason {reason!r}")
            reason = "error"
        if reason == "error" and error is None:
            error = ErrorInfo("engine_error", "the engine failed this request")
        arrival = st.arrival_time
        timings = Timings(
            arrival_time=arrival, first_scheduled_time=st.first_scheduled_time,
            first_token_time=st.first_token_time, finish_time=now,
            queue_time=None if st.first_scheduled_time is None else st.first_scheduled_time - arrival,
            ttft=None if st.first_token_time is None else st.first_token_time - arrival,
            e2e=now - arrival, itl=st.itl)
        usage = Usage(st.num_prompt_tokens, len(st.token_ids), st.num_cached_tokens)
        return RequestResult(id=st.req_id, text="".join(st.text), token_ids=st.token_ids,
                             finish_reason=reason, usage=usage, timings=timings, error=error,
                             stop_reason=stop_reason, logprobs=st.logprobs)
