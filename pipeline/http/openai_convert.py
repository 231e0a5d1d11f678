"""From the OpenAI API to the daemon's protocol, for the HTTP front end and for pipe mode's
OpenAI batch lines: request bodies (``openai_api``) -> the ``Generate`` fields of each engine
request, checked as the daemon will check them; a refused body or an error answer ->
OpenAI's error object with its HTTP status (``ApiError``). The way back, answers -> response
bodies, is ``openai_response``. Owns no state.

Each prompt of a completion body is one engine request (``n`` completions each, one
prefill).
"""
from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

from pipeline.chat_parse import ChatParseError, ChatParsers, ChatParsing
from pipeline.frontend import protocol as P
from pipeline.frontend.request_parser import sampling_params
from pipeline.http.openai_api import ChatCompletionRequest, ChatMessageParam, CompletionRequest, SamplingBody
from pipeline.messages import ErrorInfo
from pipeline.sampling_params import SAMPLING_FIELDS
from pipeline.sampling_params.structured import StructuredOutputsParams

# error.code of an answer -> HTTP status; anything else is the server's fault (500).
STATUS = {"invalid_request": 400, "duplicate_id": 400, "unsupported_version": 400,
          "answer_too_large": 400, "draining": 503, "queue_full": 503, "unavailable": 503,
          "unreachable": 503, "connection_lost": 503, "aborted": 499}
# The body's fields that go to the wire as they are: its sampling fields (the one
# declaration's, ``SAMPLING_FIELDS``) but those converted below, and cache_salt.
_CONVERTED = {"logit_bias", "structured_outputs"}
_PASS = (*(f for f in SAMPLING_FIELDS if f in SamplingBody.model_fields and f not in _CONVERTED),
         "cache_salt")
# The field an error message names: "field `x`: ...", or the tokenizer stage's verdict on a
# structured outputs spec ("structured_outputs.regex: not a valid regex: ...").
_FIELD = re.compile(r"field `([^`]+)`|^(structured_outputs(?:\.\w+)?):")


class ApiError(Exception):
    """An OpenAI error object and its HTTP status."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param = status, message, param
        self.code = code or {400: "invalid_request", 401: "invalid_api_key", 404: "model_not_found",
                             413: "request_too_large", 503: "unavailable"}.get(status, "internal_error")

    @property
    def type(self) -> str:
        return {401: "authentication_error", 404: "not_found_error", 503: "service_unavailable",
                413: "invalid_request_error"}.get(
            self.status, "invalid_request_error" if self.status < 500 else "internal_server_error")

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}


def invalid(message: str, param: str | None = None) -> ApiError:
    if param is None and (m := _FIELD.search(message)):
        param = m.group(1) or m.group(2)
    return ApiError(400, message, param)


def from_error(err: ErrorInfo) -> ApiError:
    status = STATUS.get(err.code, 500)
    return invalid(err.message) if status == 400 else ApiError(status, err.message, code=err.code)


# ---- requests ----------------------------------------------------------------------------
# Fields whose several accepted types make pydantic's per-member errors unhelpful.
UNION_FIELDS = {"prompt": "a string, a list of strings, a list of token ids or a list of token-id lists",
                "input": "a string, a list of strings, a list of token ids or a list of token-id lists",
                "stop": "a string or a list of strings",
                "messages[].content": 'a string or a list of text parts ({"type": "text", "text": ...}; '
                                      "no multi-modal input)",
                "structured_outputs.json": "a JSON schema (an object, or its text)",
                "guided_json": "a JSON schema (an object, or its text)"}


def _path(loc: tuple) -> str:
    # pydantic names the union member it tried ("str", "list[int]"...): not a field.
    parts = [str(p) for p in loc if p != "body"]
    parts = [p for p in parts if not (p[:1].islower() and ("[" in p or p in ("str", "int", "float", "bool")))]
    return "".join(f"[{p}]" if p.isdigit() else f".{p}" for p in parts).lstrip(".")


def body_error(errors: list[Any]) -> ApiError:
    """A body the models refused (pydantic's errors, FastAPI's or pipe mode's): 400 naming
    the first failing field by its path (``messages[0].content``) and what it must be."""
    err: dict[str, Any] = dict(errors[0]) if errors else {"loc": (), "msg": "invalid body", "type": ""}
    field = _path(tuple(err.get("loc", ())))
    if err.get("type") == "json_invalid":
        return invalid(f"body is not valid JSON: {err.get('msg')}")
    if not field:
        return invalid(f"body: {err.get('msg')}")
    if (kind := re.sub(r"\[\d+\]", "[]", field)) in UNION_FIELDS:
        return invalid(f"field `{field}`: must be {UNION_FIELDS[kind]}", field)
    what = {"extra_forbidden": "unknown field", "missing": "missing required field"}.get(
        err.get("type", ""), err.get("msg", "invalid"))
    return invalid(f"field `{field}`: {what}", field)


def messages(msgs: list[ChatMessageParam]) -> list[dict[str, Any]]:
    """Chat messages for the wire: ``content`` always present (null too: the tokenizer stage
    names the message that lacks it), ``name`` only when set."""
    return [m.model_dump(exclude_none=True) | {"content": m.model_dump()["content"]} for m in msgs]


def _common(req: CompletionRequest | ChatCompletionRequest) -> dict[str, Any]:
    fields = {k: v for k in _PASS if (v := getattr(req, k)) is not None}
    if req.priority:
        fields["priority"] = req.priority
    if req.logit_bias:
        try:
            bias = {int(k): v for k, v in req.logit_bias.items()}
        except ValueError:
            bias = {-1: 0.0}
        if not all(0 <= k < 2**63 for k in bias):  # a key msgpack cannot carry is no token id either
            raise invalid("field `logit_bias`: keys must be token ids (integers >= 0, as strings)",
                          "logit_bias")
        fields["logit_bias"] = bias
    if (so := structured(req)) is not None:
        fields["structured_outputs"] = so
    return fields


# vLLM's older extras -> the structured_outputs field each stands for.
_GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
           "guided_grammar": "grammar"}


def structured(req: CompletionRequest | ChatCompletionRequest) -> dict[str, Any] | None:
    """The body's ``SamplingParams.structured_outputs`` (a dict, for the wire) from at most
    one of ``response_format``, ``structured_outputs`` and the ``guided_*`` extras; ApiError
    naming the field the body used for a spec SamplingParams refuses (exactly one kind, its
    size in bytes). xgrammar's own verdict on the spec comes from the tokenizer stage."""
    given: list[tuple[str, dict[str, Any]]] = []  # (the body's field, the spec)
    rf = req.response_format
    if rf is not None:
        if rf.type == "json_schema":
            if rf.json_schema is None:
                raise invalid("field `response_format.json_schema`: required with type `json_schema`")
            given.append(("response_format", {"json": rf.json_schema.schema_}))
        elif rf.json_schema is not None:
            raise invalid(f"field `response_format.json_schema`: only with type `json_schema`, "
                          f"not `{rf.type}`")
        elif rf.type == "json_object":
            given.append(("response_format", {"json_object": True}))
    if req.structured_outputs is not None:
        given.append(("structured_outputs", req.structured_outputs.model_dump(by_alias=True, exclude_none=True)))
    given += [(k, {kind: v}) for k, kind in _GUIDED.items() if (v := getattr(req, k)) is not None]
    if len(given) > 1:
        names = " and ".join(f"`{f}`" for f, _ in given)
        raise invalid(f"fields {names}: at most one of response_format (json_object or json_schema), "
                      f"structured_outputs and guided_* may be given", given[0][0])
    if not given:
        return None
    field, spec = given[0]
    try:
        StructuredOutputsParams(**spec)
    except RecursionError:  # a schema object nested past what JSON encoding allows
        raise invalid(f"field `{_spec_field(field, 'structured_outputs.json')}`: nested too deeply") from None
    except (ValueError, TypeError) as exc:
        # "structured_outputs.<kind> must be ..., got ...": named as the body named it.
        name, _, rest = str(exc).partition(" ")
        raise invalid(f"field `{_spec_field(field, name)}`: {rest}") from None
    return spec


def _spec_field(field: str, name: str) -> str:
    """SamplingParams' name for a part of the spec (``structured_outputs.json``) as the
    body's ``field`` spells it."""
    if field == "response_format":
        return "response_format.json_schema.schema" if name.endswith(".json") else "response_format"
    return name if field == "structured_outputs" else field


def _checked(fields: dict[str, Any]) -> dict[str, Any]:
    """The fields as the daemon will check them (types, SamplingParams' limits): ApiError
    now rather than after part of a multi-prompt body ran."""
    try:
        sampling_params(P.Generate(**{k: v for k, v in fields.items() if k in SAMPLING_FIELDS}))
    except P.ProtocolError as exc:
        raise invalid(exc.error.message) from None
    except TypeError as exc:
        raise invalid(str(exc)) from None
    return fields


# A body without max_tokens gets as many as fit: (n, logprobs) -> max_tokens (at most
# max_model_len; the tokenizer stage cuts it to the room the prompt leaves).
Implied = Callable[[int, "int | None"], int]


def _max_tokens(given: int | None, max_model_len: int, implied: Implied | None, n: int,
                logprobs: int | None) -> int:
    if given is not None:
        return given  # the client's: checked against every limit, refused naming it
    return max_model_len if implied is None else implied(n, logprobs)


def completion_fields(req: CompletionRequest, max_model_len: int,
                      implied: Implied | None = None) -> list[dict[str, Any]]:
    """One ``Generate`` field dict per prompt of the body."""
    if req.echo:
        raise invalid("field `echo`: not supported (send the prompt's text yourself)", "echo")
    if req.suffix is not None:
        raise invalid("field `suffix`: not supported (no fill-in-the-middle)", "suffix")
    if req.best_of is not None and req.best_of != req.n:
        raise invalid(f"field `best_of`: only best_of == n is supported, got {req.best_of} "
                      f"with n {req.n}", "best_of")
    fields = _common(req)
    fields["max_tokens"] = _max_tokens(req.max_tokens, max_model_len, implied, req.n, req.logprobs)
    if req.logprobs is not None:
        fields["logprobs"] = req.logprobs
    _checked(fields)
    p = req.prompt
    if isinstance(p, str):
        return [fields | {"prompt": p}]
    if p and isinstance(p[0], str):
        return [fields | {"prompt": s} for s in p]
    if p and isinstance(p[0], list):
        return [fields | {"prompt_token_ids": ids} for ids in p]
    return [fields | {"prompt_token_ids": p}]


def chat_parsing(req: ChatCompletionRequest, server: ChatParsers) -> ChatParsing:
    """How the body's answers are parsed (its tools and tool_choice, the server's parsers);
    ApiError naming the field the server cannot honour."""
    tools = [t.model_dump(exclude_none=True) for t in req.tools] if req.tools else None
    choice = req.tool_choice if isinstance(req.tool_choice, str | None) else req.tool_choice.model_dump()
    try:
        return ChatParsing(tools, choice, req.parallel_tool_calls, server)
    except ChatParseError as exc:
        raise invalid(str(exc), exc.field) from None


def chat_fields(req: ChatCompletionRequest, max_model_len: int,
                implied: Implied | None = None, parsing: ChatParsing | None = None) -> dict[str, Any]:
    """The engine request of a chat body; ``parsing`` (``chat_parsing``): its tools go to the
    chat template and a forced tool choice becomes its grammar."""
    if req.top_logprobs is not None and not req.logprobs:
        raise invalid("field `top_logprobs`: needs `logprobs` true", "top_logprobs")
    fields = _common(req)
    if parsing is not None and parsing.structured is not None:
        if "structured_outputs" in fields:
            raise invalid(f"field `tool_choice`: {parsing.mode!r} forces the answer's shape; it cannot "
                          "be combined with response_format, structured_outputs or guided_*", "tool_choice")
        try:  # the grammar built from the tools: its limits name the tools, not structured_outputs
            StructuredOutputsParams(**parsing.structured)
        except (ValueError, TypeError, RecursionError) as exc:
            raise invalid(f"field `tools`: the calls' JSON schema (from the functions' parameters) "
                          f"for tool_choice {parsing.mode!r}: {str(exc) or type(exc).__name__}", "tools") from None
        fields["structured_outputs"] = parsing.structured
    elif parsing is not None and parsing.reasoning_end and req.response_format is not None \
            and "structured_outputs" in fields:
        # The answer's format applies after a reasoning model's thinking (vLLM's behaviour);
        # vLLM's raw structured_outputs / guided_* constrain the whole text as given.
        fields["structured_outputs"] = fields["structured_outputs"] | {"reasoning_end": parsing.reasoning_end}
    if parsing is not None and parsing.mode == "auto" and getattr(req, "skip_special_tokens", None) is None:
        # The call markers of some formats are special tokens ([TOOL_CALLS], <|python_tag|>):
        # the parser must see them (as vLLM's parsers ask for).
        fields["skip_special_tokens"] = False
    limit = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    fields["max_tokens"] = _max_tokens(limit, max_model_len, implied, req.n,
                                       (req.top_logprobs or 0) if req.logprobs else None)
    if req.logprobs:
        fields["logprobs"] = req.top_logprobs or 0
    _checked(fields)
    fields["messages"] = messages(req.messages)
    fields["add_generation_prompt"] = req.add_generation_prompt
    fields["continue_final_message"] = req.continue_final_message
    if req.chat_template_kwargs:
        fields["chat_template_kwargs"] = req.chat_template_kwargs
    if req.tools:  # rendered with tool_choice "none" too, as vLLM does
        fields["tools"] = parsing.tools if parsing is not None else [t.model_dump(exclude_none=True)
                                                                     for t in req.tools]
    return fields
