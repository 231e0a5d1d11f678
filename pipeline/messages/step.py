"""Engine <-> worker messages: the per-step diff and its result.

The engine stage builds SchedulerOutput (broadcast to every TP rank); worker rank 0 builds
ModelRunnerOutput. Token id arrays travel as raw little-endian int32 bytes
(``ids_to_bytes`` / ``bytes_to_ids``): msgpack carries them as one bin blob.
"""
from __future__ import annotations

import msgspec
import numpy as np

from pipeline.sampling_params import SamplingParams


def ids_to_bytes(ids) -> bytes:
    return np.asarray(ids, dtype="<i4").tobytes()


def bytes_to_ids(b: bytes) -> np.ndarray:
    return np.frombuffer(b, dtype="<i4")


def bytes_to_floats(b: bytes) -> list[float]:
    """An embedding's little-endian float32 bytes (``Pooled.data``) as floats."""
    return np.frombuffer(b, dtype="<f4").tolist()


class NewRequestData(msgspec.Struct, array_like=True):
    """A request the worker has not seen, or one resumed after preemption.

    ``token_ids`` are all tokens known so far (prompt, plus generated ones on resume); the
    worker computes them from ``num_computed_tokens`` on (the cached prefix is skipped).
    """
    req_id: str
    token_ids: bytes
    num_prompt_tokens: int
    sampling_params: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int
    grammar: bytes | None = None  # EngineRequest.grammar: the compiled structured_outputs
    embed: bool = False  # EngineRequest.embed: pool the prompt's hidden states, sample nothing


class CachedRequestData(msgspec.Struct, array_like=True):
    """A request the worker already holds: only the blocks it got this step.

    ``num_computed_tokens``: where this step starts. With async scheduling it counts the
    request's steps still running ahead of this one, and the last token to compute may be
    one the worker sampled itself (appended to its batch) that the engine has not seen yet.
    """
    req_id: str
    new_block_ids: list[int]
    num_computed_tokens: int


class SchedulerOutput(msgspec.Struct, array_like=True):
    step_id: int
    new_reqs: list[NewRequestData]
    cached_reqs: list[CachedRequestData]
    # req_id -> tokens to run this step, in batch order (new and cached alike).
    num_scheduled_tokens: dict[str, int]
    total_num_scheduled_tokens: int
    # Requests the worker must drop before this step (finished, aborted, preempted).
    finished_req_ids: list[str]
    preempted_req_ids: list[str]
    # Speculative decoding: req_id -> the draft tokens this step verifies (int32 bytes). Such
    # a request runs 1 + len(drafts) tokens: its last known token, then the drafts.
    spec_token_ids: dict[str, bytes] = {}
    # Requests that will not verify drafts at their next step (dormant, or drafts do not pay
    # now): the worker proposes nothing for them.
    spec_idle: list[str] = []
    # Requests that may verify fewer than K drafts at their next step: how many (the worker
    # proposes no more; a draft model runs a forward per draft).
    spec_fewer: dict[str, int] = {}

    @property
    def num_prefill_tokens(self) -> int:
        """Tokens of the requests that run more than one this step (prompt chunks; a
        speculative verify counts too)."""
        return sum(n for n in self.num_scheduled_tokens.values() if n > 1)


class TokenLogprobs(msgspec.Struct, array_like=True):
    token_id: int
    logprob: float
    top_ids: list[int]
    top_logprobs: list[float]


class PromptLogprobs(msgspec.Struct, array_like=True):
    """Logprobs of prompt tokens ``start .. start + len(logprobs) - 1`` of one request, each
    given the tokens before it (a prefill chunk's share; the first prompt token has none)."""
    req_id: str
    start: int
    logprobs: list[TokenLogprobs]


class Pooled(msgspec.Struct, array_like=True):
    """An embedding request's pooled vector (``worker.pooling``), once its prefill is done:
    little-endian float32, hidden_size of them."""
    req_id: str
    data: bytes


class ModelRunnerOutput(msgspec.Struct, array_like=True):
    """The tokens of each request that finished its (chunked) prefill or decoded: one, or
    with speculative decoding the accepted drafts and one more (``num_sampled``)."""
    step_id: int
    req_ids: list[str]
    sampled_token_ids: list[int]
    logprobs: list[TokenLogprobs | None] = []  # parallel to req_ids when any asked for them
    execute_s: float = 0.0  # the worker's execute() wall time (forward + sampling)
    prompt_logprobs: list[PromptLogprobs] = []  # of this step's prefill chunks that asked
    wait_s: float = 0.0  # how long the worker waited for this step after its previous result
    # Speculative decoding. Tokens per request (parallel to req_ids; sampled_token_ids and
    # logprobs are flat, in that order); empty when each has one.
    num_sampled: list[int] = []
    # req_id -> drafts proposed for its next step (int32 bytes): the engine schedules them.
    draft_token_ids: dict[str, bytes] = {}
    propose_s: float = 0.0  # the worker's time proposing them
    num_proposed: int = 0  # for how many requests it proposed
    num_drafts_asked: int = 0  # how many drafts in all it was asked for them (engine.spec_cost)
    pooled: list[Pooled] = []  # embedding requests whose prefill ended this step
