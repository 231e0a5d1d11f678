"""Messages into and out of the engine stage (besides the step diff in sched_output.py).

tokenizer -> engine: EngineRequest, AbortRequest; engine -> token processor: EngineOutputs;
token processor -> engine: AbortRequest (a stop string was hit). All are msgspec structs.
"""
from __future__ import annotations

import msgspec

from pipeline.engine.sched_output import TokenLogprobs
from pipeline.sampling_params import SamplingParams


class EngineRequest(msgspec.Struct, array_like=True):
    req_id: str
    prompt_token_ids: bytes  # little-endian int32
    sampling_params: SamplingParams
    arrival_time: float  # time.time() when the gateway accepted it
    eos_token_ids: list[int] = []
    priority: int = 0  # lower runs first, like vLLM
    cache_salt: str | None = None


class AbortRequest(msgspec.Struct, array_like=True):
    req_ids: list[str]
    reason: str = "abort"  # abort | stop (stop string hit) | error


class EngineOutput(msgspec.Struct, array_like=True):
    req_id: str
    new_token_ids: list[int]
    finish_reason: str | None = None  # stop | length | abort | error, None while running
    stop_reason: int | str | None = None  # the stop token id that ended it, if any
    logprobs: list[TokenLogprobs] | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    first_scheduled_time: float = 0.0  # end of queueing, for the timings
    error: str | None = None


class EngineOutputs(msgspec.Struct, array_like=True):
    outputs: list[EngineOutput]
    timestamp: float = 0.0
