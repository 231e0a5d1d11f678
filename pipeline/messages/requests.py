"""Requests on their way in: gateway -> tokenizer -> (token processor, engine), and the byte
limits every way in shares.

gateway -> tokenizer: GatewayRequest (text, token ids or chat messages, not yet validated),
AbortRequest; tokenizer -> token processor: OutputRegistration (before any of the request's
tokens can exist); tokenizer -> engine: EngineRequest (validated token ids), AbortRequest;
token processor -> engine: AbortRequest(reason="stop") when a stop string was hit.

Limits are in bytes because bytes are what the rings carry (a ring message is at most half
the ring). The gateway refuses a request over them before accepting it, and
``runtime.rings`` sizes every ring from them, so a request that passes them fits every ring
it crosses. README.md ("Limits") lists them for users.
"""
from __future__ import annotations

from typing import Any

import msgspec

from pipeline.messages.kv import KVTransferParams
from pipeline.sampling_params import SamplingParams

# A text prompt, or a chat's messages together (msgpack-encoded: their UTF-8 text and a few
# bytes per field).
MAX_PROMPT_BYTES = 4 << 20
# A whole GatewayRequest as it crosses the gateway -> tokenizer ring (prompt or token ids or
# messages, sampling params, ids): what catches everything no field limit does.
MAX_REQUEST_BYTES = 8 << 20
# prompt_token_ids, checked when a frame or a JSON line is decoded (max_model_len is
# checked later, by the tokenizer stage).
MAX_PROMPT_TOKENS = 1 << 20


class EngineRequest(msgspec.Struct, array_like=True):
    req_id: str
    prompt_token_ids: bytes  # little-endian int32
    sampling_params: SamplingParams
    arrival_time: float  # time.time() when the gateway accepted it
    eos_token_ids: list[int] = []
    priority: int = 0  # lower runs first, like vLLM
    cache_salt: str | None = None
    kv_transfer: KVTransferParams | None = None  # disaggregation (set by the router)
    # structured_outputs compiled by the tokenizer stage (structured_outputs.to_bytes): the
    # worker loads it instead of compiling on the step path.
    grammar: bytes | None = None
    # An embedding request (task "embed"): prefill only, its pooled hidden states are the
    # answer (EngineOutput.embedding); it samples nothing.
    embed: bool = False


class AbortRequest(msgspec.Struct, array_like=True):
    req_ids: list[str]
    reason: str = "abort"  # abort | stop (stop string hit) | error
    message: str = ""  # who aborted and why, for the answer's ErrorInfo (reason "abort")


class GatewayRequest(msgspec.Struct, kw_only=True, omit_defaults=True):
    """A parsed client request, before tokenization and validation (gateway -> tokenizer)."""
    req_id: str
    sampling_params: SamplingParams
    prompt: str | None = None
    prompt_token_ids: list[int] | None = None
    messages: list[dict[str, Any]] | None = None  # role, content, optional name
    # Chat options, for `messages` only (Tokenizer.apply_chat_template's).
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None  # OpenAI's function declarations, for the template
    stream: bool = False
    arrival_time: float = 0.0
    priority: int = 0
    cache_salt: str | None = None
    kv_transfer: KVTransferParams | None = None
    task: str = "generate"  # generate | embed (the wire's ``task``)


class OutputRegistration(msgspec.Struct, array_like=True, kw_only=True):
    """tokenizer -> token processor: what it must know about a request before its tokens."""
    req_id: str
    prompt_token_ids: bytes  # little-endian int32
    sampling_params: SamplingParams
    stream: bool
    arrival_time: float
