"""OpenAI's embeddings API: ``POST /v1/embeddings``, its body, its conversion to engine
requests (task "embed", one per input) and its answer.

``input`` is a string, a list of strings, a list of token ids or a list of token-id lists
(OpenAI's four forms); ``encoding_format`` "float" (default) or "base64" (the little-endian
float32 bytes, base64, as OpenAI sends them); ``dimensions`` only as the model's hidden
size (no shortened embeddings); ``user`` accepted and ignored. Each vector is the engine's
pooled final hidden state, L2-normalised (``--pooling``: last token or mean). An input the
engine refuses (over max_model_len, a token id outside the vocabulary) is a 400 naming
``input`` (``input[i]`` in a list). Owns no state.
"""
from __future__ import annotations

import asyncio
import base64
import re
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Annotated, Any, Literal, TypeVar

import msgspec
import numpy as np
from fastapi import FastAPI, Request
from fastapi.responses import Response
from pydantic import Field

from pipeline.http.body import check_sizes, decode, off_loop
from pipeline.http.openai_api import _Body
from pipeline.http.openai_convert import ApiError, from_error, invalid
from pipeline.messages import RequestResult

if TYPE_CHECKING:
    from pipeline.http.app import HttpState

T = TypeVar("T")
# Inputs in one body (OpenAI's limit).
MAX_INPUTS = 2048
TokenIds = Annotated[list[Annotated[int, Field(ge=0)]], Field(min_length=1)]
# The tokenizer stage names the prompt field it refused: here that is `input`.
_PROMPT_FIELD = re.compile(r"field `(prompt|prompt_token_ids)(\[\d+\])?`")


class EmbeddingRequest(_Body):
    input: str | list[str] | TokenIds | list[TokenIds]
    model: str | None = None
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None
    user: str | None = None  # accepted, not used
    truncate_prompt_tokens: Annotated[int, Field(ge=-1)] | None = None  # vLLM's: keep the last k


def embedding_fields(body: EmbeddingRequest, hidden_size: int) -> list[dict[str, Any]]:
    """One ``Generate`` field dict (task "embed") per input; ApiError 400 naming the field."""
    if body.dimensions is not None and body.dimensions != hidden_size:
        have = f"{hidden_size} dimensions" if hidden_size else "its hidden size"
        raise invalid(f"field `dimensions`: {body.dimensions}, but this model's embeddings have "
                      f"{have} (shortened embeddings are not supported)", "dimensions")
    base: dict[str, Any] = {"task": "embed"}
    if body.truncate_prompt_tokens is not None:
        base["truncate_prompt_tokens"] = body.truncate_prompt_tokens
    inp = body.input
    if isinstance(inp, str):
        inputs: list[str | list[int]] = [inp]
    elif not inp:
        raise invalid("field `input`: must not be empty", "input")
    elif isinstance(inp[0], int):
        inputs = [inp]  # one list of token ids
    else:
        inputs = list(inp)  # strings, or token-id lists
    if len(inputs) > MAX_INPUTS:
        raise invalid(f"field `input`: {len(inputs)} inputs, at most {MAX_INPUTS}", "input")
    out = []
    for i, x in enumerate(inputs):
        where = "input" if isinstance(inp, str) or isinstance(inp[0], int) else f"input[{i}]"
        if isinstance(x, str):
            if not x:
                raise invalid(f"field `{where}`: must not be an empty string", where)
            out.append(base | {"prompt": x})
        else:
            out.append(base | {"prompt_token_ids": x})
    check_sizes([x for x in inputs if isinstance(x, str)])
    return out


def failure(results: list[RequestResult], listed: bool) -> ApiError | None:
    """The first failed input's error, its prompt field named as the body's ``input``."""
    for i, r in enumerate(results):
        if r.error is None:
            continue
        where = f"input[{i}]" if listed else "input"
        message = _PROMPT_FIELD.sub(f"field `{where}`", r.error.message)
        err = from_error(msgspec.structs.replace(r.error, message=message))
        if err.status == 400:
            err.param = where
        return err
    return None


def encode(vector: list[float], encoding_format: str) -> list[float] | str:
    if encoding_format == "base64":
        return base64.b64encode(np.asarray(vector, dtype="<f4").tobytes()).decode("ascii")
    return vector


def embeddings_body(model: str, results: list[RequestResult], encoding_format: str) -> bytes:
    """OpenAI's answer (``id``/``created`` as vLLM adds them), encoded."""
    data = [{"object": "embedding", "index": i, "embedding": encode(r.embedding or [], encoding_format)}
            for i, r in enumerate(results)]
    tokens = sum(r.usage.prompt_tokens for r in results)
    return msgspec.json.encode({
        "id": f"embd-{uuid.uuid4().hex}", "object": "list", "created": int(time.time()),
        "model": model, "data": data, "usage": {"prompt_tokens": tokens, "total_tokens": tokens}})


def add_embeddings_route(app: FastAPI, state: HttpState, check_model: Callable[[str | None], None],
                         until_done: Callable[[Request, Awaitable[Any]], Awaitable[Any]]) -> None:
    """``POST /v1/embeddings`` on ``app`` (``check_model`` and ``until_done``: the app's)."""

    def parse(raw: bytes) -> tuple[EmbeddingRequest, list[dict[str, Any]]]:
        body = decode(raw, EmbeddingRequest)
        check_model(body.model)
        return body, embedding_fields(body, state.hidden_size)

    @app.post("/v1/embeddings")
    async def embeddings(request: Request) -> Response:
        body, reqs = await off_loop(parse, await request.body())
        results = await until_done(request, asyncio.gather(
            *(state.client.generate(timeout=None, **f) for f in reqs)))
        listed = isinstance(body.input, list) and not isinstance(body.input[0], int)
        if (err := failure(results, listed)) is not None:
            raise err
        out = await asyncio.to_thread(embeddings_body, state.model, results, body.encoding_format)
        return Response(out, media_type="application/json")
