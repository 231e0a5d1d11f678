"""Gateway (daemon) <-> client wire protocol over ZMQ: its messages, their strict decoding
and the errors it answers with. Owns no state; ``sessions.ClientSessions`` tracks clients,
``request_parser`` makes a ``Generate`` (or pipe mode's JSON line) an engine request. The
decoding checks types and transport bounds only; the limits that need the model are checked
once, by the tokenizer stage (``tokenizer.validate``).

Transport: the daemon binds a ROUTER socket (``ROUTER_MANDATORY`` on), each client connects
one DEALER socket and multiplexes all its requests over it. Every message is ONE frame of
msgpack (a DEALER sends ``[frame]``, the ROUTER sees ``[identity, frame]``): a map whose
``op`` field names the message and whose ``v`` field is ``PROTOCOL_VERSION``.

client -> daemon (``ClientMsg``):
  generate {id, prompt | prompt_token_ids | messages, stream, sampling fields, priority, cache_salt,
            add_generation_prompt, continue_final_message, chat_template_kwargs (with messages),
            task}     task "embed": the answer's ``embedding`` is the prompt's pooled hidden state
            (no tokens; of the sampling fields only truncate_prompt_tokens counts)
  abort {id}          health {id}          stats {id}          metrics {id}
  ping {}             accepted and ignored (older clients send it; liveness is the connection's)
  bye {}              the client closes: abort everything it has in flight
daemon -> client (``ReplyMsg``):
  delta {delta: RequestDelta}   final {result: RequestResult}   (exactly one final per accepted generate)
  error {id, error: ErrorInfo}  a health or stats op failed (``id`` is that op's), or a frame that
                      answers no request of the client: ``id`` is null, the message says which
  health_reply {id, status, detail}   stats_reply {id, stats}   metrics_reply {id, text}
  ping {}             every ``HEARTBEAT_INTERVAL_S`` to a client with requests in flight; ignore it

Request ids are the client's; the daemon keys them per client identity, so two clients may
use the same id. A generate whose id is still in flight from that client is not run, and is
not answered with a final (that id's one final belongs to the running request): it gets an
``error`` with ``id`` null and ``error.code == "duplicate_id"``, whose message names the id.
The same goes for any generate frame that cannot be decoded while its id is in flight.
``Client``/``AsyncClient`` refuse such an id before sending.

Client gone => abort, never a leak; a live connection never loses an answer. Liveness is the
connection's, never the client's loop: a client whose event loop or process stalls (a blocking
call, a GC pause, SIGSTOP) keeps its connection, its requests run on, and their answers wait in
the socket buffers until it reads them. The daemon aborts all of a client's requests when
(1) it gets ``bye``; (2) the connection is gone, e.g. the client process died or closed its
socket: the daemon pings every client with requests in flight when the socket monitor reports
a disconnect and every ``HEARTBEAT_INTERVAL_S``, and ROUTER_MANDATORY makes the send to a
dropped peer fail with EHOSTUNREACH; (3) the client's host died or the network was cut: TCP
keepalive (probes a live host's kernel answers even while the process is stopped) drops the
connection after ``KEEPALIVE_IDLE_S + KEEPALIVE_PROBES * KEEPALIVE_INTERVAL_S`` of silence,
then (2) applies. While the daemon has unacknowledged data for such a host, the kernel's
retransmission time-out decides instead (Linux: about 15 minutes, ``net.ipv4.tcp_retries2``).

Bad input: frames over ``max_frame_bytes``, undecodable msgpack, unknown ops or fields, wrong
types, a bad version, out-of-range values (from the tokenizer stage) each get an answer (a final for a generate whose
id could be read, else an ``error``) with ``ErrorInfo(code, message)`` where the message names
the field and the limit; the daemon keeps serving, and the connection and the client's other
requests live on. The daemon, not libzmq, enforces ``max_frame_bytes``: libzmq drops the whole
connection on a frame over the socket's ZMQ_MAXMSGSIZE, so that is set ``FRAME_SLACK_BYTES``
higher, only to bound the memory one frame can take (libzmq reads a whole frame before the
daemon sees it); a frame beyond that ends the connection, as in (2) above.

Size limits are in bytes, the unit the transport enforces (``messages.requests``; README.md
"Limits"): a prompt is at most MAX_PROMPT_BYTES of UTF-8, a chat's messages together at most
MAX_PROMPT_BYTES encoded, the whole request at most MAX_REQUEST_BYTES encoded (as it crosses
the gateway's ring to the tokenizer stage), ``prompt_token_ids`` at most MAX_PROMPT_TOKENS ids
(and fewer than max_model_len). The gateway checks the byte limits before it accepts a
request: one over them gets a final with ``error.code == "invalid_request"`` whose message
names the field, its size and the limit in bytes.
"""
from __future__ import annotations

import re
from typing import TYPE_CHECKING, Annotated, Any, Literal

import msgspec
from msgspec import UNSET, Meta, UnsetType

from pipeline.messages import MAX_PROMPT_TOKENS, ErrorInfo, RequestDelta, RequestResult
from pipeline.messages.kv import KVTransferParams
from pipeline.sampling_params import SamplingParams

PROTOCOL_VERSION = 1
HEARTBEAT_INTERVAL_S = 1.0
# TCP keepalive on both ends: a host silent this long (10 + 3 * 5 s) is dropped.
KEEPALIVE_IDLE_S = 10
KEEPALIVE_INTERVAL_S = 5
KEEPALIVE_PROBES = 3
MAX_FRAME_BYTES = 16 << 20
# libzmq drops a connection on a frame over max_frame_bytes + this, before reading it (so a
# 100 MB frame costs nothing); frames in between are read and answered with an error.
FRAME_SLACK_BYTES = 1 << 20
MAX_ID_LEN = 256
MAX_MESSAGES = 4096

ReqId = Annotated[str, Meta(min_length=1, max_length=MAX_ID_LEN)]


class _Msg(msgspec.Struct, tag_field="op", forbid_unknown_fields=True, kw_only=True,
           omit_defaults=True):
    v: int = PROTOCOL_VERSION


class TextPart(msgspec.Struct, forbid_unknown_fields=True):
    """One part of OpenAI's list content; the tokenizer joins text parts and refuses any other
    ``type`` (no multi-modal input), naming the part."""
    type: Annotated[str, Meta(max_length=64)]
    text: str


class ChatMessage(msgspec.Struct, forbid_unknown_fields=True, omit_defaults=True):
    role: Annotated[str, Meta(min_length=1, max_length=64)]
    # A string or OpenAI's text parts (required; null is refused by the tokenizer, naming the
    # message). Sizes are bytes, checked by the gateway (see "Size limits" above).
    content: str | list[TextPart] | None
    name: str | None = None
    # An assistant turn's tool calls (OpenAI's shape, content may be null) and a tool
    # message's answer to one: passed to the chat template as they are.
    tool_calls: Annotated[list[dict[str, Any]], Meta(max_length=MAX_TOOLS)] | None = None
    tool_call_id: Annotated[str, Meta(max_length=256)] | None = None


# Tools one chat request may declare (OpenAI's limit), and the calls one message may carry.
MAX_TOOLS = 128
# Template variables a chat request may set (vLLM's chat_template_kwargs, e.g.
# enable_thinking): string keys, at most MAX_TEMPLATE_KWARGS of them; their size counts in the
# encoded request's (MAX_REQUEST_BYTES).
MAX_TEMPLATE_KWARGS = 256
ChatTemplateKwargs = Annotated[dict[str, Any], Meta(max_length=MAX_TEMPLATE_KWARGS)]


class _Request(_Msg):
    """``Generate``'s fields but the sampling ones. Pipe mode JSON lines decode into
    ``Generate`` too (``op``/``v`` optional there, ``id`` may be an integer). Unset sampling
    fields take the caller's defaults."""
    id: ReqId | int | None = None
    prompt: str | None = None  # at most MAX_PROMPT_BYTES of UTF-8, checked by the gateway
    prompt_token_ids: Annotated[list[int], Meta(max_length=MAX_PROMPT_TOKENS)] | None = None
    messages: Annotated[list[ChatMessage], Meta(min_length=1, max_length=MAX_MESSAGES)] | None = None
    # Chat options (with `messages` only; the tokenizer stage refuses them otherwise), as in
    # vLLM's chat API.
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: ChatTemplateKwargs | None = None
    # OpenAI's `tools` (function declarations), rendered by the chat template; choosing and
    # parsing calls is the front end's (tool_choice becomes a structured_outputs grammar).
    tools: Annotated[list[dict[str, Any]], Meta(max_length=MAX_TOOLS)] | None = None
    stream: bool = False
    priority: Annotated[int, Meta(ge=-(2**31), lt=2**31)] = 0
    cache_salt: Annotated[str, Meta(max_length=256)] | None = None
    # Disaggregation: set by `pipeline router` on a prefill/decode instance, never by clients
    # (an instance of role mixed refuses it).
    kv_transfer: KVTransferParams | None = None
    # "embed": an embedding request (prefill only; RequestResult.embedding is its answer).
    task: Literal["generate", "embed"] = "generate"


# The sampling fields are SamplingParams's own (the one declaration: ``SAMPLING_FIELDS``),
# each unset unless the request sets it; SamplingParams checks their limits.
if TYPE_CHECKING:
    class Generate(_Request, tag="generate"):
        def __init__(self, **fields: Any) -> None: ...
        def __getattr__(self, name: str) -> Any: ...
else:
    Generate = msgspec.defstruct(
        "Generate", [(f.name, f.type | UnsetType, UNSET) for f in msgspec.structs.fields(SamplingParams)],
        bases=(_Request,), tag="generate", kw_only=True, module=__name__)


class Abort(_Msg, tag="abort"):
    id: ReqId


class Health(_Msg, tag="health"):
    id: ReqId


class Stats(_Msg, tag="stats"):
    id: ReqId


class Metrics(_Msg, tag="metrics"):
    """The daemon's Prometheus text (what --metrics-port serves): the HTTP front's /metrics."""
    id: ReqId


class Ping(_Msg, tag="ping"):
    """Both ways: ignored by the daemon; sent by it to probe a client's connection."""


class Bye(_Msg, tag="bye"):
    pass


class Delta(_Msg, tag="delta"):
    delta: RequestDelta


class Final(_Msg, tag="final"):
    result: RequestResult


class Error(_Msg, tag="error"):
    id: str | None  # the failed health/stats op's; None when no request waits on this answer
    error: ErrorInfo


class HealthReply(_Msg, tag="health_reply"):
    id: str
    status: str  # ok | starting | draining | failed
    detail: dict[str, Any] = {}


class StatsReply(_Msg, tag="stats_reply"):
    id: str
    stats: dict[str, Any]


class MetricsReply(_Msg, tag="metrics_reply"):
    id: str
    text: str  # Prometheus text exposition format


ClientMsg = Generate | Abort | Health | Stats | Metrics | Ping | Bye
ReplyMsg = Delta | Final | Error | HealthReply | StatsReply | MetricsReply | Ping


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
