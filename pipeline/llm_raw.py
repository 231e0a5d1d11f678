"""What ``LLM(skip_tokenizer_init=True)`` answers with, without a token processor: token ids,
logprobs and timings per request and completion, one ``RequestResult`` per request once all
its ``n`` completions finished.

Owns / State: one ``RawState`` per unfinished request of the in-process LLM.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from pipeline.messages import EngineOutput, ErrorInfo, RequestResult, Timings, TokenLogprobs, Usage
from pipeline.messages.answers import Completion
from pipeline.messages.step import bytes_to_floats
from pipeline.sampling_params import SamplingParams


@dataclass(slots=True)
class RawState:
    params: SamplingParams
    timings: Timings
    num_prompt_tokens: int
    tokens: dict[int, list[int]]  # completion index -> token ids
    logprobs: dict[int, list[TokenLogprobs]]
    prompt_logprobs: list[TokenLogprobs | None]  # [None]: the first prompt token has none
    finished: dict[int, EngineOutput] = field(default_factory=dict)  # index -> its final output
    last_time: float = 0.0
    cached_tokens: int = 0
    embedding: bytes | None = None  # an embedding request's answer (float32)


class RawOutputs:
    """The token processor's bookkeeping for an LLM without a tokenizer: token ids, logprobs and
    timings per request and completion (``EngineOutput.index``), one answer per request once
    all its ``n`` completions finished. State: one ``RawState`` per unfinished request."""

    def __init__(self) -> None:
        self._reqs: dict[str, RawState] = {}

    def add(self, rid: str, sp: SamplingParams, arrival: float, num_prompt_tokens: int) -> None:
        self._reqs[rid] = RawState(sp, Timings(arrival_time=arrival), num_prompt_tokens,
                                    {i: [] for i in range(sp.n)}, {i: [] for i in range(sp.n)}, [None])

    def abort(self, rid: str) -> None:
        self._reqs.pop(rid, None)

    def process(self, outs: list[EngineOutput], now: float, emit: Callable[[RequestResult], None]) -> None:
        stepped: set[str] = set()  # requests whose timings this step already counted
        for o in outs:
            st = self._reqs.get(o.req_id)
            if st is None:
                continue
            t = st.timings
            if o.first_scheduled_time and t.first_scheduled_time is None:
                t.first_scheduled_time = o.first_scheduled_time
                t.queue_time = o.first_scheduled_time - t.arrival_time
            st.cached_tokens = max(st.cached_tokens, o.num_cached_tokens)
            if o.new_token_ids and o.req_id not in stepped:
                stepped.add(o.req_id)
                if t.first_token_time is None:
                    t.first_token_time, t.ttft = now, now - t.arrival_time
                else:
                    t.itl.append(now - st.last_time)
                st.last_time = now
            st.tokens[o.index] += o.new_token_ids
            if o.logprobs:
                st.logprobs[o.index] += o.logprobs
            if o.prompt_logprobs:
                st.prompt_logprobs += o.prompt_logprobs
            if o.embedding is not None:
                st.embedding = o.embedding
            if o.finish_reason is not None:
                st.finished[o.index] = o
            if len(st.finished) == st.params.n:
                del self._reqs[o.req_id]
                emit(self._result(o.req_id, st, now))

    def _result(self, rid: str, st: RawState, now: float) -> RequestResult:
        t = st.timings
        t.finish_time, t.e2e = now, now - t.arrival_time
        sp = st.params
        completions = []
        for i in range(sp.n):
            lps = st.logprobs[i] if sp.logprobs is not None else None
            completions.append(Completion(
                index=i, text="", token_ids=st.tokens[i], finish_reason=st.finished[i].finish_reason or "error",
                stop_reason=st.finished[i].stop_reason, logprobs=lps,
                cumulative_logprob=None if lps is None else sum(x.logprob for x in lps)))
        first = completions[0]
        # A completion that failed or was aborted makes the request's answer say so.
        failed = next((c for c in completions if c.finish_reason in ("error", "abort")), None)
        error = None
        if failed is not None:
            why = st.finished[failed.index].error or f"the engine ended completion {failed.index}"
            error = ErrorInfo("aborted" if failed.finish_reason == "abort" else "engine_error", why)
        return RequestResult(
            id=rid, text="", token_ids=first.token_ids,
            finish_reason=(failed or first).finish_reason,
            usage=Usage(st.num_prompt_tokens, sum(len(c.token_ids) for c in completions), st.cached_tokens),
            timings=t, error=error, stop_reason=first.stop_reason, logprobs=first.logprobs,
            cumulative_logprob=first.cumulative_logprob, outputs=completions if sp.n > 1 else [],
            prompt_logprobs=st.prompt_logprobs if sp.prompt_logprobs is not None else None,
            embedding=None if st.embedding is None else bytes_to_floats(st.embedding))
