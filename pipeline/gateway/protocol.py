"""Gateway (daemon) <-> client wire protocol over ZMQ, and the one request parser that pipe
mode (JSON lines) and ZMQ share. Owns no state; ``sessions.ClientSessions`` tracks clients.
The parser checks types and transport bounds only; the limits that need the model are
checked once, by the tokenizer stage (``tokenizer.validate``).

Transport: the daemon binds a ROUTER socket (``ROUTER_MANDATORY`` on), each client connects
one DEALER socket and multiplexes all its requests over it. Every message is ONE frame of
msgpack (a DEALER sends ``[frame]``, the ROUTER sees ``[identity, frame]``): a map whose
``op`` field names the message and whose ``v`` field is ``PROTOCOL_VERSION``.

client -> daemon (``ClientMsg``):
  generate {id, prompt | prompt_token_ids | messages, stream, sampling fields, priority, cache_salt}
  abort {id}          health {id}          stats {id}
  ping {}             every ``HEARTBEAT_INTERVAL_S`` while the client lives (background I/O)
  bye {}              the client closes: abort everything it has in flight
daemon -> client (``ReplyMsg``):
  delta {delta: RequestDelta}   final {result: RequestResult}   (exactly one final per generate)
  error {id, error: ErrorInfo}  an op other than generate failed, or a frame with no usable id
  health_reply {id, status, detail}   stats_reply {id, stats}

Request ids are the client's; the daemon keys them per client identity, so two clients may
use the same id. A generate with an id still in flight from that client is answered with a
final of ``error.code == "duplicate_id"``.

Client gone => abort, never a leak. The daemon aborts all of a client's requests when
(1) it gets ``bye``; (2) a send to it fails with EHOSTUNREACH (ROUTER_MANDATORY: ZMQ has
dropped the peer, e.g. its TCP connection closed); (3) nothing, not even a ping, came from it
for ``CLIENT_IDLE_TIMEOUT_S`` while it has requests in flight (crashed host, cut network).

Bad input: frames over ``max_frame_bytes``, undecodable msgpack, unknown ops or fields, wrong
types, a bad version, out-of-range values (from the tokenizer stage) each get an answer (a final for a generate whose
id could be read, else an ``error``) with ``ErrorInfo(code, message)`` where the message names
the field and the limit; the daemon keeps serving.
"""
from __future__ import annotations

import re
import time
from typing import Annotated, Any

import msgspec
from msgspec import UNSET, Meta, UnsetType

from pipeline.messages import (
    MAX_PROMPT_CHARS,
    MAX_PROMPT_TOKENS,
    ErrorInfo,
    GatewayRequest,
    RequestDelta,
    RequestResult,
)
from pipeline.sampling_params import SamplingParams

PROTOCOL_VERSION = 1
HEARTBEAT_INTERVAL_S = 1.0
CLIENT_IDLE_TIMEOUT_S = 5.0
MAX_FRAME_BYTES = 16 << 20
MAX_ID_LEN = 256
MAX_MESSAGES = 4096

ReqId = Annotated[str, Meta(min_length=1, max_length=MAX_ID_LEN)]


class _Msg(msgspec.Struct, tag_field="op", forbid_unknown_fields=True, kw_only=True,
           omit_defaults=True):
    v: int = PROTOCOL_VERSION


class ChatMessage(msgspec.Struct, forbid_unknown_fields=True, omit_defaults=True):
    role: Annotated[str, Meta(min_length=1, max_length=64)]
    content: Annotated[str, Meta(max_length=MAX_PROMPT_CHARS)]
    name: str | None = None


class Generate(_Msg, tag="generate"):
    """One request. Pipe mode JSON lines decode into this type too (``op``/``v`` optional
    there, ``id`` may be an integer). Unset sampling fields take the caller's defaults."""
    id: ReqId | int | None = None
    prompt: Annotated[str, Meta(max_length=MAX_PROMPT_CHARS)] | None = None
    prompt_token_ids: Annotated[list[int], Meta(max_length=MAX_PROMPT_TOKENS)] | None = None
    messages: Annotated[list[ChatMessage], Meta(min_length=1, max_length=MAX_MESSAGES)] | None = None
    stream: bool = False
    priority: Annotated[int, Meta(ge=-(2**31), lt=2**31)] = 0
    cache_salt: Annotated[str, Meta(max_length=256)] | None = None
    # The SamplingParams fields (tests check the two lists match).
    max_tokens: int | UnsetType = UNSET
    min_tokens: int | UnsetType = UNSET
    temperature: float | UnsetType = UNSET
    top_p: float | UnsetType = UNSET
    top_k: int | UnsetType = UNSET
    min_p: float | UnsetType = UNSET
    repetition_penalty: float | UnsetType = UNSET
    presence_penalty: float | UnsetType = UNSET
    frequency_penalty: float | UnsetType = UNSET
    seed: int | None | UnsetType = UNSET
    stop: str | list[str] | UnsetType = UNSET
    stop_token_ids: list[int] | UnsetType = UNSET
    ignore_eos: bool | UnsetType = UNSET
    include_stop_str_in_output: bool | UnsetType = UNSET
    logprobs: int | None | UnsetType = UNSET
    skip_special_tokens: bool | UnsetType = UNSET


SAMPLING_FIELDS: tuple[str, ...] = SamplingParams.__struct_fields__


class Abort(_Msg, tag="abort"):
    id: ReqId


class Health(_Msg, tag="health"):
    id: ReqId


class Stats(_Msg, tag="stats"):
    id: ReqId


class Ping(_Msg, tag="ping"):
    pass


class Bye(_Msg, tag="bye"):
    pass


class Delta(_Msg, tag="delta"):
    delta: RequestDelta


class Final(_Msg, tag="final"):
    result: RequestResult


class Error(_Msg, tag="error"):
    id: str | None
    error: ErrorInfo


class HealthReply(_Msg, tag="health_reply"):
    id: str
    status: str  # ok | starting | draining | failed
    detail: dict[str, Any] = {}


class StatsReply(_Msg, tag="stats_reply"):
    id: str
    stats: dict[str, Any]


ClientMsg = Generate | Abort | Health | Stats | Ping | Bye
ReplyMsg = Delta | Final | Error | HealthReply | StatsReply


class ProtocolError(ValueError):
    """A frame or request that cannot be served; ``req_id`` is None if it could not be read."""

    def __init__(self, error: ErrorInfo, req_id: str | None = None, op: str | None = None) -> None:
        super().__init__(error.message)
        self.error = error
        self.req_id = req_id
        self.op = op


class _IdOnly(msgspec.Struct):
    op: Any = None
    id: Any = None


_encoder = msgspec.msgpack.Encoder()
_client_decoder = msgspec.msgpack.Decoder(ClientMsg)
_reply_decoder = msgspec.msgpack.Decoder(ReplyMsg)
_id_decoder = msgspec.msgpack.Decoder(_IdOnly)
_AT = re.compile(r"^(.*?)(?: - at `\$(?:\.([\w.\[\]]+))?`)?$", re.S)


def invalid(message: str, code: str = "invalid_request") -> ErrorInfo:
    return ErrorInfo(code=code, message=message)


def error_from_validation(exc: Exception) -> ErrorInfo:
    """msgspec's "Expected `int`, got `str` - at `$.max_tokens`" -> "field `max_tokens`: ..."."""
    m = _AT.match(str(exc))
    text, path = (m.group(1), m.group(2)) if m else (str(exc), None)
    text = text.replace("Object contains unknown field", "unknown field")
    text = text.replace("Object missing required field", "missing required field")
    if path:
        return invalid(f"field `{path}`: {text[:1].lower()}{text[1:]}")
    return invalid(text)


def encode(msg: ClientMsg | ReplyMsg) -> bytes:
    return _encoder.encode(msg)


def _peek(frame: bytes) -> tuple[str | None, str | None]:
    try:
        head = _id_decoder.decode(frame)
    except (msgspec.DecodeError, msgspec.ValidationError):
        return None, None
    rid = head.id if isinstance(head.id, str) and 0 < len(head.id) <= MAX_ID_LEN else None
    return (head.op if isinstance(head.op, str) else None), rid


def decode_client(frame: bytes, max_frame_bytes: int = MAX_FRAME_BYTES) -> ClientMsg:
    """Strictly decode one client frame; raise ProtocolError naming the field and limit."""
    if len(frame) > max_frame_bytes:
        op, rid = _peek(frame)
        raise ProtocolError(invalid(f"frame of {len(frame)} bytes exceeds the limit of "
                                    f"{max_frame_bytes} bytes (max_frame_bytes)"), rid, op)
    try:
        msg = _client_decoder.decode(frame)
    except msgspec.ValidationError as exc:
        op, rid = _peek(frame)
        raise ProtocolError(error_from_validation(exc), rid, op) from None
    except msgspec.DecodeError as exc:
        raise ProtocolError(invalid(f"frame is not valid msgpack: {exc}")) from None
    if msg.v != PROTOCOL_VERSION:
        rid = getattr(msg, "id", None)
        tag = msg.__struct_config__.tag  # a str for every ClientMsg
        raise ProtocolError(invalid(f"field `v`: protocol version {msg.v} is not supported "
                                    f"(this daemon speaks {PROTOCOL_VERSION})", "unsupported_version"),
                            rid if isinstance(rid, str) else None, tag if isinstance(tag, str) else None)
    return msg


def decode_reply(frame: bytes) -> ReplyMsg:
    return _reply_decoder.decode(frame)


def sampling_params(req: Generate, defaults: dict[str, Any] | None = None) -> SamplingParams:
    """Build a request's SamplingParams (fields the request leaves unset come from
    ``defaults``). Only types are checked here: the limits that need the model (vocab size,
    max_model_len) are checked once, by ``tokenizer.validate``."""
    rid = None if req.id is None else str(req.id)
    fields = dict(defaults or {})
    for name in SAMPLING_FIELDS:
        value = getattr(req, name)
        if value is not UNSET:
            fields[name] = [value] if name == "stop" and isinstance(value, str) else value
    try:
        return msgspec.convert(fields, SamplingParams)
    except msgspec.ValidationError as exc:
        raise ProtocolError(error_from_validation(exc), rid, "generate") from None


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
        priority=gen.priority, cache_salt=gen.cache_salt)
