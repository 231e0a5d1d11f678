"""Every struct that crosses a process boundary, and the ring tags that name them.

A leaf package: it imports nothing of ours but ``sampling_params``. Stages import their
messages from here (``from pipeline.messages import EngineRequest``).

- requests: GatewayRequest, EngineRequest, AbortRequest, OutputRegistration, the size limits
- step: SchedulerOutput (the per-step diff), ModelRunnerOutput, PromptLogprobs, token id <-> bytes
- engine_outputs: EngineOutput(s), EngineStats, ``child_id`` (the ids of a request's n completions)
- answers: RequestDelta, RequestResult, Completion (and their parts), ``error_result``
- kv: what prefill/decode disaggregation sends (KVTransferParams, TransferPlan, KVReady, ...)
- kv_layout: KVLayout (a KV pool's shape, the handshake of a KV transfer), LayoutMismatch
- tags: ``Tag``, the first byte of a ring message (each ring's tag -> type map is
  ``runtime.rings.RING_MESSAGES``)
"""
from pipeline.messages.answers import (
    FINISH_REASONS,
    Completion,
    ErrorInfo,
    RequestDelta,
    RequestResult,
    Timings,
    Usage,
    error_result,
)
from pipeline.messages.engine_outputs import (
    EngineOutput,
    EngineOutputs,
    EngineStats,
    child_id,
)
from pipeline.messages.kv_layout import KVLayout, LayoutMismatch
from pipeline.messages.requests import (
    MAX_PROMPT_BYTES,
    MAX_PROMPT_TOKENS,
    MAX_REQUEST_BYTES,
    AbortRequest,
    EngineRequest,
    GatewayRequest,
    OutputRegistration,
)
from pipeline.messages.step import (
    CachedRequestData,
    ModelRunnerOutput,
    NewRequestData,
    PromptLogprobs,
    SchedulerOutput,
    TokenLogprobs,
    bytes_to_ids,
    ids_to_bytes,
)
from pipeline.messages.tags import Tag

__all__ = [
    "FINISH_REASONS",
    "Completion",
    "ErrorInfo",
    "RequestDelta",
    "RequestResult",
    "Timings",
    "Usage",
    "error_result",
    "EngineOutput",
    "EngineOutputs",
    "EngineStats",
    "child_id",
    "KVLayout",
    "LayoutMismatch",
    "MAX_PROMPT_BYTES",
    "MAX_PROMPT_TOKENS",
    "MAX_REQUEST_BYTES",
    "AbortRequest",
    "EngineRequest",
    "GatewayRequest",
    "OutputRegistration",
    "CachedRequestData",
    "ModelRunnerOutput",
    "NewRequestData",
    "PromptLogprobs",
    "SchedulerOutput",
    "TokenLogprobs",
    "bytes_to_ids",
    "ids_to_bytes",
    "Tag",
]
