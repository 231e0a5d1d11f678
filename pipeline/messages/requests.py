"""Requests on their way in: gateway -> tokenizer -> (token processor, engine).

gateway -> tokenizer: GatewayRequest (text, token ids or chat messages, not yet validated),
AbortRequest; tokenizer -> token processor: OutputRegistration (before any of the request's
tokens can exist); tokenizer -> engine: EngineRequest (validated token ids), AbortRequest;
token processor -> engine: AbortRequest(reason="stop") when a stop string was hit.
"""
from __future__ import annotations

import msgspec

from pipeline.sampling_params import SamplingParams

# Bounds every way in shares (the wire protocol's decoder and the tokenizer's validator).
MAX_PROMPT_CHARS = 4 << 20
MAX_PROMPT_TOKENS = 1 << 20


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


class GatewayRequest(msgspec.Struct, kw_only=True, omit_defaults=True):
    """A parsed client request, before tokenization and validation (gateway -> tokenizer)."""
    req_id: str
    sampling_params: SamplingParams
    prompt: str | None = None
    prompt_token_ids: list[int] | None = None
    messages: list[dict[str, str]] | None = None  # role, content, optional name
    stream: bool = False
    arrival_time: float = 0.0
    priority: int = 0
    cache_salt: str | None = None


class OutputRegistration(msgspec.Struct, array_like=True, kw_only=True):
    """tokenizer -> token processor: what it must know about a request before its tokens."""
    req_id: str
    prompt_token_ids: bytes  # little-endian int32
    sampling_params: SamplingParams
    stream: bool
    arrival_time: float
