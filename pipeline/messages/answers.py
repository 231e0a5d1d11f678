"""Answers: what every way in (ZMQ, pipe mode, in-process) hands back per request.

The token processor builds deltas and final answers; the tokenizer (invalid request) and the
gateway (dead stage, drain) build error answers with ``error_result``. The gateway forwards
them unchanged to clients (ZMQ, pipe mode JSON lines) and feeds them to the metrics. All are
msgspec structs so they encode to msgpack / JSON as-is; field names follow vLLM's / OpenAI's
where they exist.
"""
from __future__ import annotations

import time

import msgspec

from pipeline.messages.kv import KVReservation
from pipeline.messages.step import TokenLogprobs

FINISH_REASONS = ("stop", "length", "abort", "error")


class ErrorInfo(msgspec.Struct, forbid_unknown_fields=True):
    """Why a request failed. ``code`` is machine-readable, ``message`` names field and limit."""
    code: str  # invalid_request | aborted | unsupported_version | duplicate_id | engine_error | stage_died | ...
    message: str


class Usage(msgspec.Struct, forbid_unknown_fields=True):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens served from the prefix cache


class Timings(msgspec.Struct, forbid_unknown_fields=True):
    """Wall-clock instants (time.time()) and the durations derived from them, in seconds.

    ``queue_time``: arrival -> first scheduled; ``ttft``: arrival -> first token;
    ``itl``: gaps between consecutive engine outputs after the first token;
    ``e2e``: arrival -> final answer. Durations are None when the instant was never reached
    (e.g. a request aborted while waiting has no ttft).
    """
    arrival_time: float = 0.0
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finish_time: float | None = None
    queue_time: float | None = None
    ttft: float | None = None
    e2e: float | None = None
    itl: list[float] = []

    @property
    def mean_itl(self) -> float | None:
        return sum(self.itl) / len(self.itl) if self.itl else None


class RequestDelta(msgspec.Struct, forbid_unknown_fields=True):
    """New output of a streaming request's completion ``index`` since its previous delta.

    Concatenating every delta's ``text`` (and ``token_ids``) of a request's completion gives
    exactly that completion's final ``text`` (``token_ids``): held-back text (a possible
    stop string prefix, an incomplete UTF-8 character) is sent later or dropped, never twice.
    """
    id: str
    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprobs] | None = None
    index: int = 0
    # Disaggregation, decode role: where the prefill instance writes the prompt's KV (a
    # delta of its own, with no text or tokens, before any token).
    kv: KVReservation | None = None


class Completion(msgspec.Struct, forbid_unknown_fields=True):
    """One of the n completions of a request (vLLM's CompletionOutput)."""
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str  # stop | length | abort | error
    stop_reason: int | str | None = None
    logprobs: list[TokenLogprobs] | None = None
    cumulative_logprob: float | None = None  # sum of the sampled tokens' logprobs, if asked


class RequestResult(msgspec.Struct, forbid_unknown_fields=True):
    """The one final answer of a request (also the JSON line of pipe mode).

    With ``n > 1`` every completion is in ``outputs`` and text, token_ids, stop_reason,
    logprobs and cumulative_logprob mirror ``outputs[0]``; so does finish_reason, except
    that a request aborted or failed as a whole says "abort" / "error" (with ``error``).
    ``prompt_logprobs[0]`` is None (the first prompt token has no context).
    """
    id: str
    text: str
    token_ids: list[int]
    finish_reason: str  # stop | length | abort | error
    usage: Usage
    timings: Timings
    error: ErrorInfo | None = None
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it
    logprobs: list[TokenLogprobs] | None = None
    outputs: list[Completion] = []
    cumulative_logprob: float | None = None
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    # An embedding request's answer (task "embed"): the pooled, normalised hidden state.
    embedding: list[float] | None = None


def error_result(req_id: str, code: str, message: str, *, finish_reason: str = "error",
                 arrival_time: float = 0.0) -> RequestResult:
    """A final answer that carries no tokens: invalid request, dead stage, drain abort."""
    now = time.time()
    arrival = arrival_time or now
    return RequestResult(id=req_id, text="", token_ids=[], finish_reason=finish_reason,
                         usage=Usage(), error=ErrorInfo(code=code, message=message),
                         timings=Timings(arrival_time=arrival, finish_time=now,
                                         e2e=now - arrival))
