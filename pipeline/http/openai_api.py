"""The OpenAI API's request bodies as pydantic models (validated by FastAPI, and by pipe mode
for OpenAI batch lines): ``CompletionRequest``, ``ChatCompletionRequest``, ``TokenizeRequest``,
``DetokenizeRequest``. Owns no state.

Types are checked here (the framework names the field); value limits are the engine's
(``SamplingParams``, then the tokenizer stage), so every way in refuses the same values with
the same message. Unknown fields are refused (400 naming them), as the ZMQ protocol does;
OpenAI fields with no meaning here are accepted and ignored only where ignoring them cannot
change the answer (``user``, ``store``, ``metadata``, ``service_tier``,
``service_tier``); the others (echo, suffix, audio...) are refused when set, naming the
field. docs/openai.md lists them all.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Annotated, Any, Literal

import msgspec
from pydantic import BaseModel, ConfigDict, Field, create_model

from pipeline.frontend.protocol import MAX_MESSAGES, MAX_TOOLS
from pipeline.messages import MAX_PROMPT_TOKENS
from pipeline.sampling_params import SamplingParams

# OpenAI's `logprobs` / `top_logprobs` (the engine's own limit is checked by SamplingParams).
MAX_TOP_LOGPROBS = 20
MAX_PROMPTS = 1024  # prompts in one /v1/completions body


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid")


class StreamOptions(_Body):
    include_usage: bool = False


class TextPart(_Body):
    type: Literal["text"]
    text: str


class FunctionCall(_Body):
    name: Annotated[str, Field(max_length=256)]
    arguments: str  # JSON text, as OpenAI sends it back


class ToolCallParam(_Body):
    """An earlier assistant turn's call, as the API returned it."""
    id: Annotated[str, Field(max_length=256)]
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessageParam(_Body):
    role: Annotated[str, Field(min_length=1, max_length=64)]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: Annotated[list[ToolCallParam], Field(max_length=MAX_TOOLS)] | None = None
    tool_call_id: Annotated[str, Field(max_length=256)] | None = None  # role "tool"


class FunctionDefinition(_Body):
    # OpenAI: a-z, A-Z, 0-9, underscores and dashes, at most 64; dots too (namespaced names).
    name: Annotated[str, Field(pattern=r"^[A-Za-z0-9_.\-]{1,64}$")]
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema of the arguments object
    strict: bool | None = None  # accepted: required/named choices are always enforced


class ChatTool(_Body):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(_Body):
    name: Annotated[str, Field(max_length=64)]


class NamedToolChoice(_Body):
    """``tool_choice`` naming one function: the answer is a call of it."""
    type: Literal["function"]
    function: NamedFunction


class JsonSchemaFormat(_Body):
    """OpenAI's ``response_format.json_schema``; the output always matches ``schema``
    (``strict`` is accepted: the grammar is always enforced)."""
    name: Annotated[str, Field(max_length=256)]
    # `schema` would shadow a BaseModel attribute; the JSON name is the alias.
    schema_: Annotated[dict[str, Any], Field(alias="schema")]
    description: str | None = None
    strict: bool | None = None


class ResponseFormat(_Body):
    """``text`` (no constraint), ``json_object`` (any JSON object) or ``json_schema``."""
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputs(_Body):
    """vLLM's ``structured_outputs`` extra, as ``SamplingParams.structured_outputs``: exactly
    one of these (that, and the spec's size in bytes, SamplingParams checks)."""
    json_: Annotated[str | dict[str, Any] | None, Field(alias="json")] = None  # `json` would shadow
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None


# The SamplingParams fields a body carries as they are (OpenAI's and vLLM's extras), each
# optional (null: the engine's default), derived from the one declaration (SamplingParams).
# These are shaped their own way: below (n defaults to 1; bad_words is a list of strings;
# logit_bias has string keys, JSON's; structured_outputs is vLLM's object), per route
# (max_tokens, logprobs), or not in the API (prompt_logprobs, bad_words_token_ids).
OWN_SHAPE = frozenset({"n", "bad_words", "logit_bias", "structured_outputs", "max_tokens", "logprobs",
                       "prompt_logprobs", "bad_words_token_ids"})
if TYPE_CHECKING:
    _SamplingFields = _Body
else:
    _SamplingFields = create_model(
        "_SamplingFields", __base__=_Body,
        **{f.name: (f.type | None, None) for f in msgspec.structs.fields(SamplingParams)
           if f.name not in OWN_SHAPE})


class SamplingBody(_SamplingFields):
    """The fields both routes map onto ``SamplingParams`` (OpenAI's, then vLLM's extras)."""
    model: str | None = None
    n: int = 1
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    bad_words: list[str] | None = None
    priority: Annotated[int, Field(ge=-(2**31), lt=2**31)] = 0  # the wire's (int32)
    cache_salt: Annotated[str, Field(max_length=256)] | None = None
    # Structured outputs: OpenAI's response_format, vLLM's structured_outputs, or vLLM's
    # older guided_* extras (at most one of them; openai_convert.structured).
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    # OpenAI's, accepted and ignored (they cannot change an answer)
    store: bool | None = None
    metadata: dict[str, str] | None = None
    service_tier: str | None = None


TokenIds = Annotated[list[int], Field(max_length=MAX_PROMPT_TOKENS)]


class CompletionRequest(SamplingBody):
    prompt: str | Annotated[list[str], Field(min_length=1, max_length=MAX_PROMPTS)] | TokenIds \
        | Annotated[list[TokenIds], Field(min_length=1, max_length=MAX_PROMPTS)]
    max_tokens: int | None = 16  # OpenAI's default for completions
    logprobs: Annotated[int, Field(ge=0, le=MAX_TOP_LOGPROBS)] | None = None
    echo: bool = False  # refused when true
    suffix: str | None = None  # refused when set
    best_of: int | None = None  # refused unless equal to n


class ChatCompletionRequest(SamplingBody):
    messages: Annotated[list[ChatMessageParam], Field(min_length=1, max_length=MAX_MESSAGES)]
    max_tokens: int | None = None  # None: as many as the context leaves
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: Annotated[int, Field(ge=0, le=MAX_TOP_LOGPROBS)] | None = None
    tools: Annotated[list[ChatTool], Field(max_length=MAX_TOOLS)] | None = None
    # None: "auto" with tools (OpenAI's default), else "none" (chat_parse)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None  # false: at most one call
    # vLLM's chat extras
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None


class TokenizeRequest(_Body):
    """vLLM's /tokenize: a prompt, or chat messages rendered with the chat template."""
    model: str | None = None
    prompt: str | None = None
    messages: Annotated[list[ChatMessageParam], Field(min_length=1, max_length=MAX_MESSAGES)] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    tools: Annotated[list[ChatTool], Field(max_length=MAX_TOOLS)] | None = None  # with messages
    return_token_strs: bool = False


class DetokenizeRequest(_Body):
    model: str | None = None
    tokens: TokenIds
