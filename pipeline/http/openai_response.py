"""From the daemon's answers to the OpenAI API, for the HTTP front end and for pipe mode's
OpenAI batch lines: final answers -> OpenAI's response bodies (choices, logprobs in the
legacy and the chat shape, usage), the parts of stream chunks (``stream``), the error a
failed answer is replaced by, and the ``model`` and ``system_fingerprint`` they name. The way
in, request bodies -> engine requests, is ``openai_convert``. Owns no state but the token
text cache ``token_texts`` returns.

Each prompt of a completion body is one engine request (``n`` completions each, one
prefill); choice ``i * n + j`` is completion ``j`` of prompt ``i``, as vLLM numbers them.
"""
from __future__ import annotations

import os
from collections.abc import Callable
from functools import lru_cache
from typing import Any

from pipeline.chat_parse import ChatParsing
from pipeline.http.openai_convert import ApiError, from_error
from pipeline.messages import Completion, RequestResult
from pipeline.messages.step import TokenLogprobs
from pipeline.tokenizer.tokenizer import Tokenizer

MIN_LOGPROB = -9999.0  # what OpenAI reports for an impossible token (JSON has no -inf)
TokenText = Callable[[int], str]


def completions_of(res: RequestResult) -> list[Completion]:
    return res.outputs or [Completion(index=0, text=res.text, token_ids=res.token_ids,
                                      finish_reason=res.finish_reason, stop_reason=res.stop_reason,
                                      logprobs=res.logprobs)]


def usage(results: list[RequestResult]) -> dict[str, Any]:
    prompt = sum(r.usage.prompt_tokens for r in results)
    completion = sum(r.usage.completion_tokens for r in results)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": sum(r.usage.cached_tokens for r in results)}}


def token_texts(tokenizer: Callable[[], Tokenizer]) -> TokenText:
    """Token id -> its own text, for logprobs: a cached decode (``tokenizer`` is called on
    the first use, so a path that never asks for logprobs never loads it)."""
    @lru_cache(maxsize=1 << 16)
    def text(token_id: int) -> str:
        return tokenizer().decode([token_id], skip_special_tokens=False)
    return text


def _lp(x: float) -> float:
    return x if x > MIN_LOGPROB else MIN_LOGPROB


def completion_logprobs(lps: list[TokenLogprobs] | None, text: TokenText,
                        offset: int = 0) -> dict[str, Any] | None:
    """The legacy shape: tokens, token_logprobs, top_logprobs ({token: logprob}, the sampled
    token among them, as vLLM does), text_offset (from ``offset``)."""
    if lps is None:
        return None
    tokens, offsets, tops = [], [], []
    for t in lps:
        s = text(t.token_id)
        tokens.append(s)
        offsets.append(offset)
        offset += len(s)
        top = {text(i): _lp(lp) for i, lp in zip(t.top_ids, t.top_logprobs)}
        top.setdefault(s, _lp(t.logprob))
        tops.append(top)
    return {"tokens": tokens, "token_logprobs": [_lp(t.logprob) for t in lps], "top_logprobs": tops,
            "text_offset": offsets}


def _entry(token: str, logprob: float) -> dict[str, Any]:
    return {"token": token, "logprob": _lp(logprob), "bytes": list(token.encode())}


def chat_logprobs(lps: list[TokenLogprobs] | None, text: TokenText) -> dict[str, Any] | None:
    if lps is None:
        return None
    return {"content": [_entry(text(t.token_id), t.logprob)
                        | {"top_logprobs": [_entry(text(i), lp) for i, lp in zip(t.top_ids, t.top_logprobs)]}
                        for t in lps]}


def finish_reason(c: Completion) -> str:
    return "abort" if c.finish_reason == "error" else c.finish_reason


def completion_body(rid: str, created: int, model: str, fingerprint: str, n: int,
                    results: list[RequestResult], text: TokenText) -> dict[str, Any]:
    choices = [{"index": i * n + c.index, "text": c.text, "logprobs": completion_logprobs(c.logprobs, text),
                "finish_reason": finish_reason(c), "stop_reason": c.stop_reason}
               for i, res in enumerate(results) for c in completions_of(res)]
    return {"id": rid, "object": "text_completion", "created": created, "model": model,
            "system_fingerprint": fingerprint, "choices": choices, "usage": usage(results)}


def chat_choice(c: Completion, text: TokenText, parsing: ChatParsing | None) -> dict[str, Any]:
    """A non-streamed chat choice: its message parsed by ``parsing`` (reasoning, tool calls)."""
    message: dict[str, Any] = {"role": "assistant", "content": c.text}
    reason = finish_reason(c)
    if parsing is not None and parsing.active:
        parser = parsing.answer()
        message |= parser.message(c.text)
        reason = parser.finish_reason(reason)
    return {"index": c.index, "message": message, "logprobs": chat_logprobs(c.logprobs, text),
            "finish_reason": reason, "stop_reason": c.stop_reason}


def chat_body(rid: str, created: int, model: str, fingerprint: str, res: RequestResult,
              text: TokenText, parsing: ChatParsing | None = None) -> dict[str, Any]:
    choices = [chat_choice(c, text, parsing) for c in completions_of(res)]
    return {"id": rid, "object": "chat.completion", "created": created, "model": model,
            "system_fingerprint": fingerprint, "choices": choices, "usage": usage([res])}


def failure(results: list[RequestResult]) -> ApiError | None:
    """The error a non-streamed answer is replaced by: the first failed request's."""
    for r in results:
        if r.error is not None and r.finish_reason == "error":
            return from_error(r.error)
    return None


def served_model_name(model: str, override: str | None = None) -> str:
    """What ``model`` must name (``--served-model-name``, else the ``--model`` path as given,
    as vLLM does; the embedded default model is "default")."""
    from pipeline.config import DEFAULT_MODEL
    if override:
        return override
    return "default" if os.path.realpath(model) == os.path.realpath(DEFAULT_MODEL) else model


def fingerprint(model_hash: str) -> str:
    """``system_fingerprint``: this build and this checkpoint's config."""
    return f"pipeline-{model_hash[:12]}" if model_hash else "pipeline"
