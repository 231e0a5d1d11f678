"""The OpenAI API as a FastAPI app: routes and error shapes.

Owns the HTTP side of each request only: its engine requests go to the daemon through one
``AsyncClient`` (``HttpState.client``), whose answers it turns into OpenAI bodies or
server-sent events (``convert``, ``stream``). The key and the body's size and time are
checked before a route runs (``limit``); each route decodes and converts its body in a
worker thread (``body``). A client that disconnects, mid-stream or while waiting for a whole
answer, has its engine requests aborted (the daemon frees their blocks). Errors are
OpenAI's error object: 400 invalid parameter (naming the field), 401 bad key, 404 unknown
model or route, 408 body too slow, 413 body or prompt over its limit, 503 draining / queue
full / daemon unreachable / too many connections, 500 anything else.
"""
from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import msgspec
from fastapi import FastAPI, Request
from fastapi.responses import Response
from starlette.exceptions import HTTPException

from pipeline.chat_parse import ChatParsers, ChatParsing
from pipeline.client import AsyncClient
from pipeline.client.base import RequestError
from pipeline.http import openai_convert as C
from pipeline.http import openai_response as R
from pipeline.http.body import check_sizes, decode, off_loop
from pipeline.http.embeddings import add_embeddings_route
from pipeline.http.limit import BodyLimit
from pipeline.http.openai_api import ChatCompletionRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest
from pipeline.http.stream import disconnected, sse_response
from pipeline.messages import RequestResult
from pipeline.sampling_params.limits import max_tokens_that_fit
from pipeline.tokenizer.tokenizer import Tokenizer, check_chat_options
from pipeline.version import __version__

T = TypeVar("T")


@dataclass
class HttpState:
    client: AsyncClient
    tokenizer: Tokenizer
    model: str  # the served model name
    model_path: str
    max_model_len: int
    fingerprint: str
    api_key: str | None = None
    created: int = 0
    answer_limit: int = 0  # the daemon's largest answer (bytes; 0: unknown, no budget)
    token_text_bytes: int = 0  # the most text one token adds (tokenizer.stage.max_token_text_bytes)
    chat_parsers: ChatParsers = ChatParsers()  # --tool-call-parser and co: how answers are parsed
    hidden_size: int = 0  # an embedding's length (0: unknown; then `dimensions` is refused)

    def implied_max_tokens(self, n: int, logprobs: int | None) -> int:
        """max_tokens of a body that set none: as many as the context and the answer's
        byte budget allow (vLLM: the context's room), never a refusal."""
        if not self.answer_limit:
            return self.max_model_len
        return min(self.max_model_len, max_tokens_that_fit(n, logprobs, self.token_text_bytes, self.answer_limit))


def _json(body: dict[str, Any], status: int = 200) -> Response:
    return Response(msgspec.json.encode(body), status_code=status, media_type="application/json")


def build_app(state: HttpState) -> FastAPI:
    app = FastAPI(title="pipeline", docs_url=None, redoc_url=None, openapi_url=None)
    app.add_middleware(BodyLimit, api_key=state.api_key)

    @app.exception_handler(C.ApiError)
    async def _api_error(_: Request, exc: C.ApiError) -> Response:
        return _json(exc.body(), exc.status)

    @app.exception_handler(Exception)
    async def _internal(_: Request, exc: Exception) -> Response:  # uvicorn logs the traceback
        e = C.ApiError(500, f"internal error in the HTTP front end: {type(exc).__name__}: {exc}")
        return _json(e.body(), e.status)

    @app.exception_handler(HTTPException)
    async def _http(_: Request, exc: HTTPException) -> Response:
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, "http_error")
        e = C.ApiError(exc.status_code, str(exc.detail), code=code)
        return _json(e.body(), e.status)

    def check_model(name: str | None) -> None:
        if name is not None and name != state.model:
            raise C.ApiError(404, f"the model `{name}` does not exist; this server serves `{state.model}`",
                             "model", "model_not_found")

    token_text = R.token_texts(lambda: state.tokenizer)

    async def until_done(request: Request, work: Awaitable[T]) -> T:
        """``work``, cancelled (so its engine requests are aborted) if the client goes away."""
        task = asyncio.ensure_future(work)
        gone = asyncio.ensure_future(disconnected(request))
        try:
            await asyncio.wait((task, gone), return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            raise C.ApiError(499, "the client disconnected", code="client_disconnected")
        try:
            return task.result()
        except RequestError as exc:
            raise C.from_error(exc.error) from None

    @app.get("/version")
    async def version() -> Response:  # vLLM's
        return _json({"version": __version__})

    @app.api_route("/ping", methods=["GET", "POST"])  # vLLM's (SageMaker's probe): /health
    @app.get("/health")
    async def health() -> Response:
        try:
            reply = await state.client.health(timeout=5.0)
        except (RequestError, TimeoutError) as exc:
            return _json({"status": "unreachable", "detail": str(exc)}, 503)
        return _json({"status": reply.status}, 200 if reply.status == "ok" else 503)

    @app.get("/metrics")
    async def metrics() -> Response:
        try:
            text = await state.client.metrics(timeout=10.0)
        except RequestError as exc:
            raise C.from_error(exc.error) from None
        return Response(text, media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/v1/models")
    async def models() -> Response:
        return _json({"object": "list", "data": [{
            "id": state.model, "object": "model", "created": state.created, "owned_by": "pipeline",
            "root": state.model_path, "parent": None, "max_model_len": state.max_model_len}]})

    async def answer(request: Request, body: CompletionRequest | ChatCompletionRequest,
                     reqs: list[dict[str, Any]], prefix: str,
                     build: Callable[[str, int, list[RequestResult]], dict[str, Any]],
                     parsing: ChatParsing | None = None) -> Response:
        """A body's engine requests, streamed or as one answer built by ``build``."""
        rid, created = f"{prefix}-{uuid.uuid4().hex}", int(time.time())
        if body.stream:
            return await sse_response(request, state, reqs, body, rid, created, token_text, parsing)
        results = await until_done(request, asyncio.gather(
            *(state.client.generate(timeout=None, **f) for f in reqs)))
        if (err := R.failure(results)) is not None:
            raise err
        return _json(build(rid, created, results))

    # Each route's body is decoded, checked and converted in a worker thread (``off_loop``):
    # none of that work, which grows with the body, runs on the event loop.
    def completion_request(raw: bytes) -> tuple[CompletionRequest, list[dict[str, Any]]]:
        body = decode(raw, CompletionRequest)
        check_model(body.model)
        check_sizes(body.prompt)
        return body, C.completion_fields(body, state.max_model_len, state.implied_max_tokens)

    def chat_request(raw: bytes) -> tuple[ChatCompletionRequest, dict[str, Any], ChatParsing]:
        body = decode(raw, ChatCompletionRequest)
        check_model(body.model)
        parsing = C.chat_parsing(body, state.chat_parsers)
        fields = C.chat_fields(body, state.max_model_len, state.implied_max_tokens, parsing)
        check_sizes(messages=fields["messages"])
        return body, fields, parsing

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        body, reqs = await off_loop(completion_request, await request.body())
        return await answer(request, body, reqs, "cmpl", lambda rid, created, results: R.completion_body(
            rid, created, state.model, state.fingerprint, body.n, results, token_text))

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        body, fields, parsing = await off_loop(chat_request, await request.body())
        return await answer(request, body, [fields], "chatcmpl", lambda rid, created, results: R.chat_body(
            rid, created, state.model, state.fingerprint, results[0], token_text, parsing), parsing)

    def tokenized(raw: bytes) -> bytes:
        body = decode(raw, TokenizeRequest)
        check_model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise C.invalid("exactly one of `prompt` and `messages` is required", "prompt")
        if body.tools and body.messages is None:
            raise C.invalid("field `tools`: only valid with `messages`", "tools")
        try:
            if body.messages is not None:
                msgs = C.messages(body.messages)
                check_sizes(messages=msgs)
                options = check_chat_options(
                    has_messages=True, add_generation_prompt=body.add_generation_prompt,
                    continue_final_message=body.continue_final_message,
                    chat_template_kwargs=body.chat_template_kwargs,
                    tools=[t.model_dump(exclude_none=True) for t in body.tools] if body.tools else None)
                ids = state.tokenizer.apply_chat_template(msgs, body.add_generation_prompt, **options)
            else:
                check_sizes(body.prompt)
                ids = state.tokenizer.encode(body.prompt or "", add_special_tokens=body.add_special_tokens)
        except ValueError as exc:
            raise C.invalid(str(exc)) from None
        return msgspec.json.encode({
            "count": len(ids), "max_model_len": state.max_model_len, "tokens": ids,
            "token_strs": [token_text(i) for i in ids] if body.return_token_strs else None})

    def detokenized(raw: bytes) -> bytes:
        body = decode(raw, DetokenizeRequest)
        check_model(body.model)
        vocab = state.tokenizer.vocab_size
        bad = next((i for i, t in enumerate(body.tokens) if not 0 <= t < vocab), None)
        if bad is not None:
            raise C.invalid(f"field `tokens[{bad}]`: token id {body.tokens[bad]} is outside the "
                            f"vocabulary [0, {vocab})", f"tokens[{bad}]")
        return msgspec.json.encode({"prompt": state.tokenizer.decode(body.tokens)})

    @app.post("/tokenize")
    async def tokenize(request: Request) -> Response:
        return Response(await off_loop(tokenized, await request.body()), media_type="application/json")

    @app.post("/detokenize")
    async def detokenize(request: Request) -> Response:
        return Response(await off_loop(detokenized, await request.body()), media_type="application/json")

    add_embeddings_route(app, state, check_model, until_done)  # POST /v1/embeddings
    return app

