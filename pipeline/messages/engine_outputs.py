"""What the engine stage sends out: sampled tokens per request and its stats snapshot.

engine -> token processor: EngineOutputs (a batch of EngineOutput, one per completion that
got tokens, prompt logprobs or finished this step); engine -> gateway: EngineStats, a few
times a second. A request with ``n > 1`` runs in the engine and the worker as n child
requests named by ``child_id``; outputs carry the request's own id and the child's index.
Not to be confused with ``pipeline.outputs`` (what ``LLM`` returns to its caller) or the
``pipeline.output`` package (the token processor stage that reads these). Owns no state.
"""
from __future__ import annotations

import msgspec

from pipeline.messages.kv import KVReservation
from pipeline.messages.step import TokenLogprobs


def child_id(req_id: str, index: int, n: int) -> str:
    """The engine's id of completion ``index`` of a request of ``n`` completions (what a
    stop-string abort of that one completion names)."""
    return req_id if n == 1 else f"{req_id}#{index}"


class EngineOutput(msgspec.Struct, array_like=True):
    req_id: str
    new_token_ids: list[int]
    finish_reason: str | None = None  # stop | length | abort | error, None while running
    stop_reason: int | str | None = None  # the stop token id that ended it, if any
    logprobs: list[TokenLogprobs] | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    first_scheduled_time: float = 0.0  # end of queueing, for the timings
    error: str | None = None  # why it failed ("error") or who aborted it ("abort")
    index: int = 0  # which of the request's n completions
    # The next prompt tokens' logprobs (each given the tokens before it), in prompt order:
    # the engine sends each prompt token's once, even when a preempted prefill reruns.
    prompt_logprobs: list[TokenLogprobs] | None = None
    # Disaggregation, decode role: the blocks reserved for the prompt's KV (sent once).
    kv: KVReservation | None = None
    error_code: str | None = None  # ErrorInfo.code of ``error`` when not the default
    # An embedding request's answer (ModelRunnerOutput.pooled): float32 bytes, with its final.
    embedding: bytes | None = None


class EngineOutputs(msgspec.Struct, array_like=True):
    outputs: list[EngineOutput]
    timestamp: float = 0.0


class EngineStats(msgspec.Struct, kw_only=True):
    """The scheduler's counters and gauges, plus the engine stage's step timing.

    Field names are what `pipeline serve`'s stats reply and pipe mode's ``--stats-json``
    show; the gateway turns some into Prometheus gauges."""
    running: int = 0
    waiting: int = 0
    kv_blocks_total: int = 0
    kv_blocks_used: int = 0
    kv_blocks_cached: int = 0
    kv_blocks_cached_evictable: int = 0
    kv_blocks_free: int = 0
    kv_usage: float = 0.0
    prefix_cache_hit_rate: float = 0.0
    prefix_cache_queried_tokens: int = 0
    prefix_cache_hit_tokens: int = 0
    num_preemptions: int = 0
    num_evictions: int = 0
    prompt_tokens: int = 0
    computed_tokens: int = 0
    generation_tokens: int = 0
    stale_results_dropped: int = 0
    reserve_blocks_per_running: float = 0.0
    # Disaggregation. Decode role: requests holding blocks while their KV is on its way, those
    # blocks, reservations that timed out, KV that arrived failed. Prefill role: blocks held
    # until the cache messager reports their transfer, requests whose transfer failed.
    kv_reserved_requests: int = 0
    kv_reserved_blocks: int = 0
    kv_reservation_timeouts: int = 0
    kv_transfer_leased_blocks: int = 0
    kv_transfers_failed: int = 0
    # A KV tier (--kv-offload-dir): prompt tokens found there (beyond the pool's hit) and
    # loaded intact, blocks that failed their load (computed again), load bytes and time,
    # requests that waited for a load and how long in all, blocks written and their bytes and
    # time, blocks held for a save now (and blocks not saved because too many were), requests
    # loading now.
    kv_tier_hit_tokens: int = 0
    kv_tier_loaded_tokens: int = 0
    kv_tier_failed_blocks: int = 0
    kv_tier_load_bytes: int = 0
    kv_tier_load_seconds: float = 0.0
    kv_tier_load_waits: int = 0
    kv_tier_load_wait_seconds: float = 0.0
    kv_tier_saved_blocks: int = 0
    kv_tier_save_bytes: int = 0
    kv_tier_save_seconds: float = 0.0
    kv_tier_saving_blocks: int = 0
    kv_tier_deferred_blocks: int = 0  # cached, waiting for a save slot (MAX_SAVING_SHARE)
    kv_tier_save_skipped: int = 0  # deferred blocks the pool evicted before their save
    kv_tier_loading_requests: int = 0
    # Speculative decoding (--speculative-config): verify steps that carried drafts, drafted
    # and accepted tokens, tokens per verify step (1 + accepted / steps), accepted drafts by
    # position (index 0: the first draft).
    spec_num_drafts: int = 0
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    spec_mean_acceptance_length: float = 0.0
    spec_accepted_per_position: list[int] = []
    spec_drafted_per_position: list[int] = []
    spec_draft_cap: int = 0  # draft positions worth their cost now (engine.spec_decode)
    # What one more token run costs, in tokens produced (the step cost line's slope x tokens
    # produced a second): a draft position pays when more than this share of steps keep it.
    spec_token_price: float = 0.0
    spec_proposal_price: float = 0.0  # what proposing for one request costs, the same unit
    # Equal for two instances exactly when they read the same tier files (``KVLayout.
    # tier_group``): the router sends a prefix to a sibling of the instance that computed it.
    # "" without a tier.
    kv_tier_group: str = ""
    # Set by the engine stage (zero in-process): steps that ran tokens, their wall time and
    # the worker's share of it.
    engine_steps: int = 0
    engine_step_seconds: float = 0.0
    engine_worker_seconds: float = 0.0
    engine_overhead_share: float = 0.0
    timestamp: float = 0.0

    def as_dict(self) -> dict[str, int | float | str | list[int]]:
        return msgspec.structs.asdict(self)
