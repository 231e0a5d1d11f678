"""The one request parser that pipe mode (JSON lines) and ZMQ share: a decoded ``Generate``
(``protocol``) or a JSON line -> its ``SamplingParams`` -> the tokenizer stage's input
(``GatewayRequest``). Owns no state.

It checks types and the limits that need no model (SamplingParams's own), raising
``protocol.ProtocolError`` naming the field and the limit; those that need the model (vocab
size, max_model_len) are checked once, by the tokenizer stage (``tokenizer.validate``).
"""
from __future__ import annotations

import time
from typing import Any

import msgspec
from msgspec import UNSET

from pipeline.frontend.protocol import Generate, ProtocolError, error_from_validation, invalid
from pipeline.messages import GatewayRequest
from pipeline.sampling_params import SAMPLING_FIELDS, SamplingParams


def sampling_params(req: Generate, defaults: dict[str, Any] | None = None) -> SamplingParams:
    """Build a request's SamplingParams (fields the request leaves unset come from
    ``defaults``). SamplingParams checks every limit that needs no model; those that need
    it (vocab size, max_model_len) are checked once, by ``tokenizer.validate``."""
    rid = None if req.id is None else str(req.id)
    fields = dict(defaults or {})
    for name in SAMPLING_FIELDS:
        value = getattr(req, name)
        if value is not UNSET:
            fields[name] = value
    try:
        return msgspec.convert(fields, SamplingParams)
    except msgspec.ValidationError as exc:
        # SamplingParams says "<field> must be <limit>, got <value>".
        name, _, rest = str(exc).partition(" ")
        error = (invalid(f"field `{name}`: {rest}")
                 if name.split(".")[0] in SAMPLING_FIELDS and rest.startswith("must")
                 else error_from_validation(exc))
        raise ProtocolError(error, rid, "generate") from None


def request_from_json(data: bytes | str | dict[str, Any],
                      defaults: dict[str, Any] | None = None) -> tuple[Generate, SamplingParams]:
    """Pipe mode's parser (a JSON line or an already-decoded object), same rules as ZMQ."""
    try:
        if isinstance(data, dict):
            req = msgspec.convert(data, Generate)
        else:
            req = msgspec.json.decode(data, type=Generate)
    except msgspec.ValidationError as exc:
        rid = data.get("id") if isinstance(data, dict) else None
        raise ProtocolError(error_from_validation(exc), rid if isinstance(rid, str) else None) from None
    except msgspec.DecodeError as exc:
        raise ProtocolError(invalid(f"line is not valid JSON: {exc}")) from None
    return req, sampling_params(req, defaults)


def gateway_request(gen: Generate, sp: SamplingParams, req_id: str) -> GatewayRequest:
    """From a decoded Generate (pipe mode or ZMQ) to the tokenizer stage's input."""
    return GatewayRequest(
        req_id=req_id, sampling_params=sp, prompt=gen.prompt,
        prompt_token_ids=gen.prompt_token_ids, stream=gen.stream, arrival_time=time.time(),
        messages=None if gen.messages is None else [msgspec.to_builtins(m) for m in gen.messages],
        add_generation_prompt=gen.add_generation_prompt,
        continue_final_message=gen.continue_final_message,
        chat_template_kwargs=gen.chat_template_kwargs, tools=gen.tools,
        priority=gen.priority, cache_salt=gen.cache_salt, kv_transfer=gen.kv_transfer,
        task=gen.task)
