"""What the in-process ``LLM`` returns, in vLLM's shapes: ``RequestOutput`` holding one
``CompletionOutput`` per completion, and ``Logprob`` per candidate token; ``LLM.embed``'s
``EmbeddingRequestOutput`` holding one ``EmbeddingOutput``.

Plain data, built from the token processor's ``RequestResult`` by ``request_output``; owns no state.
The module keeps vLLM's path (``vllm.outputs``): code written against vLLM finds these classes
where it looks. Not the engine's per-step ``messages.engine_outputs`` (a ring message), nor the
``pipeline.output`` package (the token processor stage).
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pipeline.messages import ErrorInfo, RequestResult, Timings, TokenLogprobs
from pipeline.messages.answers import Completion


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
    # LLM.chat with tools or a reasoning parser (llm_chat): ``text`` parsed into OpenAI's parts
    content: str | None = None
    tool_calls: list[dict[str, Any]] | None = None  # [{"id", "type": "function", "function": {...}}]
    reasoning_content: str | None = None

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


def request_output(r: RequestResult, request_id: str, prompt: str | None, prompt_token_ids: list[int],
                   decode1: Callable[[int], str | None]) -> RequestOutput:
    """The token processor's answer in vLLM's shape (``decode1``: one token's text, or None)."""
    completions = r.outputs or [Completion(
        index=0, text=r.text, token_ids=r.token_ids, finish_reason=r.finish_reason,
        stop_reason=r.stop_reason, logprobs=r.logprobs, cumulative_logprob=r.cumulative_logprob)]
    outputs = [CompletionOutput(c.index, c.text, c.token_ids, c.cumulative_logprob,
                                None if c.logprobs is None else [_position(x, decode1) for x in c.logprobs],
                                c.finish_reason, c.stop_reason) for c in completions]
    prompt_logprobs = None if r.prompt_logprobs is None else \
        [None if x is None else _position(x, decode1) for x in r.prompt_logprobs]
    return RequestOutput(request_id, prompt, prompt_token_ids, prompt_logprobs, outputs,
                         True, r.timings, r.usage.cached_tokens, r.error)


def _position(lp: TokenLogprobs, decode1: Callable[[int], str | None]) -> dict[int, Logprob]:
    """One position's logprobs as vLLM shows them: the sampled token first, then the top-N
    by rank (a token in both appears once, with its rank)."""
    ranks = {t: i for i, t in enumerate(lp.top_ids, 1)}
    out = {lp.token_id: Logprob(lp.logprob, ranks.get(lp.token_id), decode1(lp.token_id))}
    for t, x in zip(lp.top_ids, lp.top_logprobs):
        if t not in out:
            out[t] = Logprob(x, ranks[t], decode1(t))
    return out


@dataclass(slots=True)
class EmbeddingOutput:
    """A prompt's embedding (vLLM's ``EmbeddingOutput``): the pooled, L2-normalised final
    hidden state, hidden_size floats (empty when the request failed: see ``error``)."""
    embedding: list[float]

    @property
    def hidden_size(self) -> int:
        return len(self.embedding)


@dataclass(slots=True)
class EmbeddingRequestOutput:
    """``LLM.embed``'s answer for one prompt (vLLM's ``EmbeddingRequestOutput``)."""
    request_id: str
    outputs: EmbeddingOutput
    prompt_token_ids: list[int]
    finished: bool = True
    error: ErrorInfo | None = None


def embedding_output(r: RequestResult, request_id: str, prompt_token_ids: list[int]) -> EmbeddingRequestOutput:
    return EmbeddingRequestOutput(request_id, EmbeddingOutput(r.embedding or []), prompt_token_ids,
                                  True, r.error)
