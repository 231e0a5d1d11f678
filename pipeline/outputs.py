"""What the in-process ``LLM`` returns, in vLLM's shapes: ``RequestOutput`` holding one
``CompletionOutput`` per completion, and ``Logprob`` per candidate token.

Plain data built by ``LLM`` from the token processor's ``RequestResult``; owns no state.
The module keeps vLLM's path (``vllm.outputs``): code written against vLLM finds these classes
where it looks. Not the engine's per-step ``messages.engine_outputs`` (a ring message), nor the
``pipeline.output`` package (the token processor stage).
"""
from __future__ import annotations

from dataclasses import dataclass

from pipeline.messages import ErrorInfo, Timings


@dataclass(slots=True)
class Logprob:
    """One candidate token's log-probability at one position (vLLM's ``Logprob``)."""
    logprob: float
    rank: int | None = None  # 1 = most likely; None for a sampled token outside the top-N
    decoded_token: str | None = None


@dataclass(slots=True)
class CompletionOutput:
    """One of a request's ``n`` completions (vLLM's ``CompletionOutput``)."""
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[dict[int, Logprob]] | None  # per position: sampled token first, then top-N
    finish_reason: str | None = None  # stop | length | abort | error
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(slots=True)
class RequestOutput:
    """A request's final answer (vLLM's ``RequestOutput``); ``error`` is ours: why a completion
    finished with "error" or "abort"."""
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    prompt_logprobs: list[dict[int, Logprob] | None] | None
    outputs: list[CompletionOutput]
    finished: bool = True
    metrics: Timings | None = None
    num_cached_tokens: int | None = None
    error: ErrorInfo | None = None
