"""Engine stage: one request's scheduling state, owned by the Scheduler alone.

A Request lives from ``Scheduler.add_request`` until it finishes or is aborted. It holds the
token ids known so far (prompt, then every sampled token), how many of them have KV in the
cache, the blocks it owns, the chain hashes of its full blocks, and the timings the token
processor reports. A client request of ``n > 1`` completions is n Requests ("children"):
each has its own id, ``out_id`` (the client request's id) and ``index``. Nothing outside the
engine stage ever sees or mutates it.

Transfer state (where its KV comes from or goes) is the KV connector's
(``engine.kv_connector``), not the request's. Two statuses say that a connector holds it:
WAITING_FOR_KV (decode role: queued for a reservation or receiving its prompt's KV) and
PARKED (prefill role, --pd-fallback local: its first token is out, its transfers are not
all reported yet).
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from pipeline.sampling_params import SamplingParams

if TYPE_CHECKING:
    from pipeline.engine.block_pool import KVBlock


class RequestStatus(enum.IntEnum):
    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2
    WAITING_FOR_KV = 3  # decode role: queued for a reservation, or reserved and receiving
    # Prefill role, --pd-fallback local: its first token is out, its transfers are not all
    # reported yet; out of the batch, holding its blocks, until they are (PrefillConnector.parked).
    PARKED = 4
    # Every finished status is above the others (the waiting queue drops them by comparison).
    FINISHED_STOPPED = 5
    FINISHED_LENGTH = 6
    FINISHED_ABORTED = 7
    FINISHED_ERROR = 8


FINISH_REASONS: dict[RequestStatus, str] = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_ERROR: "error",
}
ABORT_STATUS: dict[str, RequestStatus] = {
    "abort": RequestStatus.FINISHED_ABORTED,
    "stop": RequestStatus.FINISHED_STOPPED,  # a stop string hit in the token processor
    "error": RequestStatus.FINISHED_ERROR,
    "length": RequestStatus.FINISHED_LENGTH,
}


@dataclass(slots=True, eq=False)
class Request:
    req_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    arrival_time: float = 0.0
    eos_token_ids: frozenset[int] = frozenset()
    priority: int = 0
    cache_salt: str | None = None
    out_id: str = ""  # the id outputs carry: the client request's ("" : req_id)
    index: int = 0  # which completion of the client request
    params_bytes: int = 0  # its sampling params and grammar, encoded (what admitting it costs a step)
    grammar: bytes | None = None  # EngineRequest.grammar, sent with every NewRequestData
    # An embedding request (EngineRequest.embed): it ends with its prefill, pooled by the
    # worker; ``pool_mean``: mean pooling, which needs every prompt position computed here.
    embed: bool = False
    pool_mean: bool = False

    status: RequestStatus = RequestStatus.WAITING
    # Prompt followed by every sampled token; grows by one per decode step.
    all_token_ids: list[int] = field(default_factory=list)
    num_prompt_tokens: int = 0
    # Tokens whose KV is in the cache (advanced when the worker reports the step done;
    # steps scheduled but not reported are in ``num_inflight_tokens``).
    num_computed_tokens: int = 0
    # Blocks owned, in position order.
    blocks: list[KVBlock] = field(default_factory=list)
    # Chain hashes of every full block of all_token_ids, computed incrementally.
    block_hashes: list[bytes] = field(default_factory=list)
    # How many leading blocks of ``blocks`` are already in the prefix cache.
    num_cached_blocks: int = 0
    # Prefix-cache hit at first admission (reported to the client).
    num_cached_tokens: int = -1
    # Steps it is in flight in, oldest first (results come back in step order; a result of
    # any other step is stale), the tokens they compute and the tokens they sample, which
    # the worker knows and the engine does not yet (engine.inflight: async scheduling).
    inflight_steps: list[int] = field(default_factory=list)
    num_inflight_tokens: int = 0
    num_placeholders: int = 0
    # Admission order, for the "newest admitted" preemption victim.
    admit_seq: int = 0
    num_preemptions: int = 0
    first_scheduled_time: float = 0.0
    finish_time: float = 0.0
    stop_reason: int | str | None = None
    # Set by the scheduler once the worker holds the request (drop it there on finish).
    sent_to_worker: bool = False
    # Fast pre-check for check_stop: tokens that may end it, and the length that does.
    stop_ids: frozenset[int] = frozenset()
    max_num_tokens: int = 0
    # Set by the waiting queue while the request is in it; its place there at arrival.
    in_queue: bool = False
    order: int = 0
    # First child of n > 1: its siblings, queued once its prompt KV is computed and cached.
    held: list[Request] = field(default_factory=list)
    # Next prompt token whose logprobs go out (token 0 has none); prompt_logprobs only.
    prompt_logprobs_sent: int = 1
    # Speculative decoding (engine.spec_decode): the worker's drafts for its next decode
    # step, how many it may verify (K), its accepted drafts per step averaged, its dormant
    # probe countdown and interval.
    spec_token_ids: list[int] = field(default_factory=list)
    spec_k: int = 0
    spec_ema: float = 1.0
    spec_probe: int = 0
    spec_backoff: int = 0

    def __post_init__(self) -> None:
        if not self.out_id:
            self.out_id = self.req_id
        if not self.all_token_ids:
            self.all_token_ids = list(self.prompt_token_ids)
        self.num_prompt_tokens = len(self.prompt_token_ids)
        sp = self.sampling_params
        self.stop_ids = frozenset(sp.stop_token_ids).union(
            () if sp.ignore_eos else self.eos_token_ids)
        # An embedding request computes its prompt and no more: like one that samples one
        # token, never scheduled ahead past it (engine.inflight).
        self.max_num_tokens = self.num_prompt_tokens + (1 if self.embed else sp.max_tokens)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def owes_prompt_logprobs(self) -> bool:
        return (self.sampling_params.prompt_logprobs is not None
                and self.prompt_logprobs_sent < self.num_prompt_tokens)

    @property
    def computes_whole_prompt(self) -> bool:
        """Every prompt position must run here (no prefix-cache or tier hit): its prompt
        logprobs are still owed, or mean pooling sums them all."""
        return self.owes_prompt_logprobs or self.pool_mean

    @property
    def finish_reason(self) -> str | None:
        return FINISH_REASONS.get(self.status)

    def check_stop(self, max_model_len: int) -> bool:
        """Set a FINISHED_* status after a token was appended; True if the request ended.

        A stop token beats the length cap when both happen on the same token, so the client
        learns why it ended. EOS and stop tokens count only once ``min_tokens`` are out.
        """
        sp = self.sampling_params
        n_out = len(self.all_token_ids) - self.num_prompt_tokens
        last = self.all_token_ids[-1]
        if n_out >= sp.min_tokens:
            if not sp.ignore_eos and last in self.eos_token_ids:
                self.status = RequestStatus.FINISHED_STOPPED
                return True
            if sp.stop_token_ids and last in sp.stop_token_ids:
                self.status = RequestStatus.FINISHED_STOPPED
                self.stop_reason = last
                return True
        if n_out >= sp.max_tokens or len(self.all_token_ids) >= max_model_len:
            self.status = RequestStatus.FINISHED_LENGTH
            return True
        return False
