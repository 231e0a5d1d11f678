"""Engine stage: the EngineOutputs the scheduler makes for a request (a sampled token, its
end without one) and the part of a step's prompt logprobs still owed to the client.

Owns / State: nothing but ``Request.prompt_logprobs_sent``, advanced as they go out.
"""
from __future__ import annotations

from pipeline.engine.request import FINISH_REASONS, Request
from pipeline.messages import EngineOutput, TokenLogprobs
from pipeline.messages.step import PromptLogprobs


def token_output(req: Request, toks: list[int], done: bool, lps: list[TokenLogprobs | None] | None,
                 plp: list[TokenLogprobs] | None) -> EngineOutput:
    """``req`` sampled ``toks`` (one, or accepted drafts and one more; ``done``: it ended, its
    status says how) with their logprobs ``lps`` (None or None entries: not asked)."""
    logprobs = [lp for lp in lps if lp is not None] if lps else None
    return EngineOutput(req.out_id, toks, FINISH_REASONS.get(req.status) if done else None,
                        req.stop_reason, logprobs or None, req.num_prompt_tokens,
                        req.num_cached_tokens, req.first_scheduled_time, None, req.index, plp)


def final_output(req: Request, toks: list[int], error: str | None,
                 prompt_logprobs: list[TokenLogprobs] | None = None,
                 error_code: str | None = None, embedding: bytes | None = None) -> EngineOutput:
    """``req`` as it is (finished: with its finish reason; ``error`` and its ``error_code``;
    an embedding request's pooled vector)."""
    return EngineOutput(req.out_id, toks, req.finish_reason, req.stop_reason, None,
                        req.num_prompt_tokens, max(req.num_cached_tokens, 0),
                        req.first_scheduled_time, error, req.index, prompt_logprobs,
                        error_code=error_code, embedding=embedding)


def new_prompt_logprobs(req: Request, p: PromptLogprobs | None) -> list[TokenLogprobs] | None:
    """The part of a step's prompt logprobs not sent yet (a rerun after preemption computes
    them again)."""
    if p is None:
        return None
    sent = req.prompt_logprobs_sent
    if p.start > sent:
        raise RuntimeError(f"worker sent prompt logprobs of {req.req_id!r} from token "
                           f"{p.start}, expected from {sent} or before")
    new = p.logprobs[sent - p.start:]
    req.prompt_logprobs_sent = max(sent, p.start + len(p.logprobs))
    return new or None
