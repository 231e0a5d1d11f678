"""Token processor stage: turns the engine's sampled tokens into streaming deltas and answers.

State: one ``_ReqState`` per unfinished request (its timings, prompt logprobs and one
``_Completion`` per completion: incremental detokenizer, stop checker, the output so far).
It never touches blocks: when a stop string ends a completion it finishes it here and
returns its engine id (``child_id``) so the stage can send ``AbortRequest(ids,
reason="stop")`` to the engine, which frees the blocks.

Guarantees:
- exactly one ``RequestResult`` per request, once all its n completions are over: once
  finished (stop string, abort, error), a completion's state is frozen and engine outputs
  still in flight for it are dropped (``num_dropped``);
- a completion's deltas concatenated equal its final ``text`` / ``token_ids``;
- the first token of a completion is emitted before anything else in the batch is
  processed (seed 000: the first token must not wait behind other requests' bookkeeping);
- per token O(token bytes + longest stop string) work: linear in output length;
- an aborted request answers ``finish_reason="abort"`` with ``ErrorInfo("aborted", who)``.
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
from pipeline.messages.answers import Completion
from pipeline.messages.engine_outputs import child_id
from pipeline.messages.step import bytes_to_floats
from pipeline.output.detokenizer import DetokenizerTable, IncrementalDetokenizer
from pipeline.output.stop_checker import StopChecker
from pipeline.sampling_params import SamplingParams

Emit = Callable[[RequestDelta | RequestResult], None]


@dataclass(slots=True)
class _Completion:
    index: int
    detok: IncrementalDetokenizer
    stop: StopChecker
    token_ids: list[int] = field(default_factory=list)
    text: list[str] = field(default_factory=list)
    logprobs: list[TokenLogprobs] | None = None
    finish_reason: str | None = None  # None while running
    stop_reason: int | str | None = None


@dataclass(slots=True)
class _ReqState:
    req_id: str
    params: SamplingParams
    stream: bool
    arrival_time: float
    num_prompt_tokens: int
    completions: list[_Completion]
    num_running: int
    num_cached_tokens: int = 0
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_output_time: float = 0.0
    last_batch: int = -1  # the process() call that last gave it tokens
    itl: list[float] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprobs] | None = None
    error: ErrorInfo | None = None  # the request as a whole was aborted or failed
    embedding: bytes | None = None  # an embedding request's answer (float32), with its final


class OutputProcessor:
    """Per-request output state of the token processor stage (one instance per stage)."""

    def __init__(self, table: DetokenizerTable, clock: Callable[[], float] = time.time) -> None:
        self.table = table
        self.clock = clock
        self._reqs: dict[str, _ReqState] = {}
        self._batch = 0
        self.num_dropped = 0  # outputs of completions already finished (or never added)

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
        completions = [
            _Completion(k, self.table.detokenizer(params.skip_special_tokens, prompt_token_ids),
                        StopChecker(params.stop, params.include_stop_str_in_output),
                        logprobs=[] if params.logprobs is not None else None)
            for k in range(params.n)]
        self._reqs[req_id] = _ReqState(
            req_id=req_id, params=params, stream=stream, arrival_time=arrival_time,
            num_prompt_tokens=num_prompt_tokens or (0 if prompt_token_ids is None else len(prompt_token_ids)),
            completions=completions, num_running=params.n,
            prompt_logprobs=[] if params.prompt_logprobs is not None else None)

    def process(self, batch: EngineOutputs, emit: Emit) -> list[str]:
        """Emit deltas and final answers for one engine batch, in order per completion.

        Returns the engine ids (``child_id``) of completions that a stop string finished
        here while the engine still runs them: the stage must send
        ``AbortRequest(ids, reason="stop")`` to the engine.
        """
        now = self.clock()
        self._batch += 1
        outs = batch.outputs
        stopped: list[str] = []
        # First tokens go out before anything else in the batch. A completion seen earlier
        # in this batch keeps its order, so only its earliest output may jump the queue.
        seen: set[tuple[str, int]] = set()
        later: list[EngineOutput] = []
        for o in outs:
            key = (o.req_id, o.index)
            c = self._completion(o)
            if c is not None and key not in seen and not c.token_ids and o.new_token_ids:
                self._process_one(self._reqs[o.req_id], c, o, now, emit, stopped)
            else:
                later.append(o)
            seen.add(key)
        for o in later:
            c = self._completion(o)
            if c is None:
                self.num_dropped += 1
                continue
            self._process_one(self._reqs[o.req_id], c, o, now, emit, stopped)
        return stopped

    def _completion(self, o: EngineOutput) -> _Completion | None:
        """The running completion ``o`` is for; None if it is over (or never existed)."""
        st = self._reqs.get(o.req_id)
        if st is None or not 0 <= o.index < len(st.completions):
            return None
        c = st.completions[o.index]
        return c if c.finish_reason is None else None

    def abort(self, req_id: str, finish_reason: str = "abort",
              error: ErrorInfo | None = None) -> RequestResult | None:
        """Finish a request here (client gone, stage died, time-out). None if already over;
        later engine outputs for it are dropped. Its text is what was already released:
        a held-back possible stop-string prefix or incomplete character is dropped, so the
        final text still equals the concatenated deltas."""
        st = self._reqs.get(req_id)
        if st is None:
            return None
        st.error = self._error_of(finish_reason, error)
        for c in st.completions:
            if c.finish_reason is None:
                c.finish_reason = finish_reason
        return self._finish(st, self.clock())

    @staticmethod
    def _error_of(reason: str, error: ErrorInfo | str | None) -> ErrorInfo | None:
        """The ErrorInfo of a completion ending with ``reason`` (None: a normal end)."""
        if isinstance(error, ErrorInfo):
            return error
        if reason == "abort":
            return ErrorInfo("aborted", error or "aborted by the client")
        if reason == "error":
            return ErrorInfo("engine_error", error or "the engine failed this request")
        if reason not in FINISH_REASONS:
            return ErrorInfo("engine_error", f"unknown finish_reason {reason!r}")
        return None

    def _process_one(self, st: _ReqState, c: _Completion, o: EngineOutput, now: float,
                     emit: Emit, stopped: list[str]) -> None:
        if o.first_scheduled_time and st.first_scheduled_time is None:
            st.first_scheduled_time = o.first_scheduled_time
        st.num_prompt_tokens = max(st.num_prompt_tokens, o.num_prompt_tokens)
        if o.index == 0:  # the siblings take the prompt from the cache the first one filled
            st.num_cached_tokens = max(st.num_cached_tokens, o.num_cached_tokens)
        if st.prompt_logprobs is not None and o.prompt_logprobs:
            st.prompt_logprobs += o.prompt_logprobs
        if o.embedding is not None:
            st.embedding = o.embedding
        if o.kv is not None and st.stream:  # disaggregation: the decode side's reservation
            emit(RequestDelta(st.req_id, "", [], None, c.index, kv=o.kv))
        if o.new_token_ids:
            if st.first_token_time is None:
                st.first_token_time = now
            elif st.last_batch != self._batch:  # the n completions of one step: one gap
                st.itl.append(now - st.last_output_time)
            st.last_output_time = now
            st.last_batch = self._batch
        p = st.params
        # A stop token / EOS that ended the request is kept in token_ids but, like vLLM,
        # not in the text unless include_stop_str_in_output (EOS: the engine's "stop" with no
        # stop_reason; its text shows with skip_special_tokens false).
        hide_last = (o.finish_reason == "stop" and (o.stop_reason is None or isinstance(o.stop_reason, int))
                     and not p.include_stop_str_in_output)
        parts: list[str] = []
        start = len(c.token_ids)
        hit: str | None = None
        last = len(o.new_token_ids) - 1
        for i, tok in enumerate(o.new_token_ids):
            c.token_ids.append(tok)
            if hide_last and i == last and o.stop_reason in (None, tok):
                continue
            text, hit = c.stop.feed(c.detok.add_token(tok), check=len(c.token_ids) >= p.min_tokens)
            parts.append(text)
            if hit is not None:
                break
        kept = len(c.token_ids) - start
        if c.logprobs is not None and o.logprobs:
            c.logprobs.extend(o.logprobs[:kept])
        finish = "stop" if hit is not None else o.finish_reason
        if finish is not None and hit is None:
            text, hit = c.stop.feed(c.detok.flush(), check=len(c.token_ids) >= p.min_tokens)
            parts.append(text)
            if hit is None:
                parts.append(c.stop.flush())
            else:
                finish = "stop"
        delta = "".join(parts)
        c.text.append(delta)
        if st.stream and (delta or kept):
            emit(RequestDelta(st.req_id, delta, c.token_ids[start:],
                              o.logprobs[:kept] if c.logprobs is not None and o.logprobs else None,
                              c.index))
        if finish is None:
            return
        if hit is not None and o.finish_reason is None:
            stopped.append(child_id(st.req_id, c.index, p.n))  # the engine still runs it
        c.finish_reason = finish
        c.stop_reason = hit if hit is not None else o.stop_reason
        st.num_running -= 1
        error = self._error_of(finish, o.error if o.error_code is None
                               else ErrorInfo(o.error_code, o.error or o.error_code))
        if error is not None and st.error is None:
            st.error = error
        if error is not None and error.code != "aborted":
            # The request failed: its other completions end with it (and in the engine).
            for other in st.completions:
                if other.finish_reason is None:
                    other.finish_reason = "error"
                    stopped.append(child_id(st.req_id, other.index, p.n))
            st.num_running = 0
        if st.num_running == 0:
            emit(self._finish(st, now))

    def _finish(self, st: _ReqState, now: float) -> RequestResult:
        del self._reqs[st.req_id]
        arrival = st.arrival_time
        timings = Timings(
            arrival_time=arrival, first_scheduled_time=st.first_scheduled_time,
            first_token_time=st.first_token_time, finish_time=now,
            queue_time=None if st.first_scheduled_time is None else st.first_scheduled_time - arrival,
            ttft=None if st.first_token_time is None else st.first_token_time - arrival,
            e2e=now - arrival, itl=st.itl)
        outputs = [Completion(
            index=c.index, text="".join(c.text), token_ids=c.token_ids,
            finish_reason=c.finish_reason if c.finish_reason in FINISH_REASONS else "error",
            stop_reason=c.stop_reason, logprobs=c.logprobs,
            cumulative_logprob=None if c.logprobs is None else sum(lp.logprob for lp in c.logprobs))
            for c in st.completions]
        first, error = outputs[0], st.error
        reason = first.finish_reason
        if error is not None:
            reason = "abort" if error.code == "aborted" else "error"
        usage = Usage(st.num_prompt_tokens, sum(len(c.token_ids) for c in outputs), st.num_cached_tokens)
        return RequestResult(
            id=st.req_id, text=first.text, token_ids=first.token_ids, finish_reason=reason,
            usage=usage, timings=timings, error=error, stop_reason=first.stop_reason,
            logprobs=first.logprobs, outputs=outputs if len(outputs) > 1 else [],
            cumulative_logprob=first.cumulative_logprob,
            prompt_logprobs=None if st.prompt_logprobs is None else [None, *st.prompt_logprobs],
            embedding=None if st.embedding is None else bytes_to_floats(st.embedding))
