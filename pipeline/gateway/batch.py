"""Pipe mode's OpenAI batch files: reads a batch input line (``custom_id``, ``method``,
``url``, ``body``) into the engine requests it stands for, and builds its batch output line
(``id``, ``custom_id``, ``response`` {``status_code``, ``request_id``, ``body``}, ``error``)
once they have all finished. Bodies are validated by ``http.openai_api`` and mapped by
``http.openai_convert`` and ``http.openai_response``, the HTTP front end's own code, so a
body gets the same answer either way.

Owns / State (``BatchLines``, one per run in batch mode): the custom_ids seen so far (the
reader thread's), and the lines in flight: line index -> the results of its engine requests
(touched under the pipe writer's lock). The writer (``pipe_output.AnswerWriter``) orders and
writes the lines and counts failures; this module never writes.

A line the API refuses (a body field, ``stream`` true, another model) gets a ``response``
with OpenAI's error object and its HTTP status (400, 404); a line that is no batch request
(bad JSON, a plain or JSON pipe line, no ``custom_id``, a reused one, another method or url)
gets ``"response": null`` and ``error`` {``code``, ``message``}.
"""
from __future__ import annotations

import time
import uuid
from functools import lru_cache
from typing import Any

import msgspec
from pydantic import ValidationError

from pipeline.chat_parse import ChatParsers, ChatParsing
from pipeline.frontend.protocol import MAX_ID_LEN, ProtocolError
from pipeline.frontend.request_parser import gateway_request, request_from_json
from pipeline.http.openai_api import ChatCompletionRequest, CompletionRequest
from pipeline.http.openai_convert import ApiError, body_error, chat_fields, chat_parsing, completion_fields, invalid
from pipeline.http.openai_response import (
    chat_body,
    completion_body,
    failure,
    fingerprint,
    served_model_name,
    token_texts,
)
from pipeline.messages import GatewayRequest, RequestResult
from pipeline.runtime.spec import ModelInfo
from pipeline.sampling_params.limits import max_tokens_that_fit
from pipeline.tokenizer.tokenizer import Tokenizer, max_token_text_bytes

URLS: dict[str, type[ChatCompletionRequest] | type[CompletionRequest]] = {
    "/v1/chat/completions": ChatCompletionRequest, "/v1/completions": CompletionRequest}
LINE_FIELDS = ("custom_id", "method", "url", "body")
MIXED = ("mixing OpenAI batch lines ({\"custom_id\", \"method\", \"url\", \"body\"}) with plain "
         "or JSON request lines in one input is refused")
_enc = msgspec.json.Encoder()


def _decode(text: str) -> Any:
    try:
        return msgspec.json.decode(text)
    except msgspec.DecodeError:
        return None


def is_batch_line(text: str) -> bool:
    """Whether a (stripped, non-empty) input line is meant as an OpenAI batch line: a JSON
    object with ``custom_id`` or with ``url`` and ``body`` (text that is no JSON: whether it
    names a ``custom_id``)."""
    if not text.startswith("{") or ('"custom_id"' not in text and '"url"' not in text):
        return False
    obj = _decode(text)
    if obj is None:
        return '"custom_id"' in text
    return isinstance(obj, dict) and ("custom_id" in obj or ("url" in obj and "body" in obj))


@lru_cache(maxsize=4)
def _tokenizer(model_dir: str) -> Tokenizer:
    return Tokenizer(model_dir)


def _hex() -> str:
    return uuid.uuid4().hex


def output_line(custom_id: str | None, response: dict[str, Any] | None = None,
                error: dict[str, str] | None = None) -> bytes:
    return _enc.encode({"id": f"batch_req_{_hex()}", "custom_id": custom_id,
                        "response": response, "error": error})


def _response(status: int, body: dict[str, Any]) -> dict[str, Any]:
    return {"status_code": status, "request_id": _hex(), "body": body}


class BatchLine(msgspec.Struct):
    """A batch line to run: one engine request per prompt (one for a chat)."""
    custom_id: str
    chat: bool
    n: int
    model: str
    requests: list[GatewayRequest]
    results: list[RequestResult | None] = []
    parsing: ChatParsing | None = None  # a chat's tool calls and reasoning (chat_parse)


class Refused(Exception):
    """A line that is not run; ``line`` is its output line."""

    def __init__(self, line: bytes) -> None:
        super().__init__()
        self.line = line


class BatchLines:
    def __init__(self, model_dir: str, model: ModelInfo | None, max_model_len: int,
                 answer_limit: int = 0, chat_parsers: ChatParsers | None = None) -> None:
        self.chat_parsers = chat_parsers or ChatParsers()  # --tool-call-parser and co
        self.served = served_model_name(model_dir)
        self.fingerprint = fingerprint(model.kv.model_hash if model is not None else "")
        self.max_model_len = max_model_len
        self.answer_limit = answer_limit  # the answers ring's message limit (0: unknown)
        self.text = token_texts(lambda: _tokenizer(model_dir))
        self._token_text_bytes = lru_cache(1)(lambda: max_token_text_bytes(_tokenizer(model_dir).tok))
        self.seen: dict[str, int] = {}  # custom_id -> index of the line that has it
        self.inflight: dict[str, tuple[int, int, BatchLine]] = {}  # engine request id -> (line, k, its line)

    def implied_max_tokens(self, n: int, logprobs: int | None) -> int:
        """max_tokens of a line that set none: as many as the context and the answer's byte
        budget allow, never a refusal over limits the line did not set (as over HTTP)."""
        if not self.answer_limit:
            return self.max_model_len
        return min(self.max_model_len, max_tokens_that_fit(n, logprobs, self._token_text_bytes(),
                                                           self.answer_limit))

    # ---- input (the reader thread) ----
    def parse(self, index: int, text: str, defaults: dict[str, Any]) -> BatchLine:
        """The line's engine requests (ids ``<index>.<k>``); Refused with its output line."""
        obj = _decode(text)
        cid = obj.get("custom_id") if isinstance(obj, dict) else None
        cid = cid if isinstance(cid, str) and 0 < len(cid) <= MAX_ID_LEN else None

        def no_request(message: str, code: str = "invalid_request") -> Refused:
            return Refused(output_line(cid, error={"code": code, "message": message}))

        if obj is None and not text.startswith("{"):
            raise no_request(f"line: a plain prompt in an OpenAI batch input; {MIXED}")
        if obj is None:
            raise no_request("line: not valid JSON (an OpenAI batch line is a JSON object)")
        if not is_batch_line(text):
            raise no_request(f"line: a JSON request line in an OpenAI batch input; {MIXED}")
        if cid is None:
            raise no_request(f"field `custom_id`: must be a string of 1 to {MAX_ID_LEN} "
                             f"characters, got {obj.get('custom_id')!r:.80}")
        if (first := self.seen.setdefault(cid, index)) != index:
            raise no_request(f"field `custom_id`: {cid!r} is already the custom_id of the line at "
                             f"index {first}; custom_ids are unique within a batch, so this line "
                             f"(index {index}) was not run", "duplicate_custom_id")
        if extra := sorted(set(obj) - set(LINE_FIELDS)):
            raise no_request(f"field `{extra[0]}`: unknown field (a batch line has "
                             f"{', '.join(LINE_FIELDS)})")
        if obj.get("method") != "POST":
            raise no_request(f"field `method`: must be \"POST\", got {obj.get('method')!r:.80}")
        url = obj.get("url")
        if url not in URLS:
            raise no_request(f"field `url`: must be one of {', '.join(URLS)}, got {url!r:.80}")
        if not isinstance(obj.get("body"), dict):
            raise no_request("field `body`: must be a JSON object (the request's body)")
        try:
            return self._line(index, cid, url, obj["body"], defaults)
        except ApiError as err:
            raise Refused(output_line(cid, _response(err.status, err.body()))) from None

    def _line(self, index: int, cid: str, url: str, body: dict[str, Any],
              defaults: dict[str, Any]) -> BatchLine:
        try:
            req = URLS[url].model_validate(body)
        except ValidationError as exc:
            raise body_error(exc.errors(include_url=False)) from None
        if req.stream:
            raise invalid("field `stream`: must be false in a batch (a batch answer is never "
                          "streamed)", "stream")
        if req.model is not None and req.model != self.served:
            raise ApiError(404, f"field `model`: the model `{req.model}` does not exist; this "
                                f"server serves `{self.served}`", "model")
        parsing = None
        if isinstance(req, ChatCompletionRequest):
            parsing = chat_parsing(req, self.chat_parsers)
            all_fields = [chat_fields(req, self.max_model_len, self.implied_max_tokens, parsing)]
        else:
            all_fields = completion_fields(req, self.max_model_len, self.implied_max_tokens)
        requests = []
        for k, fields in enumerate(all_fields):
            try:
                gen, sp = request_from_json(fields, defaults)
            except ProtocolError as exc:
                raise invalid(exc.error.message) from None
            requests.append(gateway_request(gen, sp, f"{index}.{k}"))
        return BatchLine(cid, isinstance(req, ChatCompletionRequest), req.n, self.served, requests,
                         [None] * len(requests), parsing)

    def start(self, index: int, line: BatchLine) -> None:
        """Its requests are about to be submitted (the writer's lock held)."""
        for k, req in enumerate(line.requests):
            self.inflight[req.req_id] = (index, k, line)

    # ---- answers (the writer's lock held) ----
    def owns(self, req_id: str) -> bool:
        return req_id in self.inflight

    def finish(self, res: RequestResult) -> tuple[int, bytes, bool] | None:
        """A request's final answer; when it is its line's last: (line index, output line,
        whether it is a 200)."""
        index, k, line = self.inflight.pop(res.id)
        line.results[k] = res
        if any(r is None for r in line.results):
            return None
        results = [r for r in line.results if r is not None]
        if (err := failure(results)) is not None:
            return index, output_line(line.custom_id, _response(err.status, err.body())), False
        created = int(time.time())
        if line.chat:
            body = chat_body(f"chatcmpl-{_hex()}", created, line.model, self.fingerprint,
                             results[0], self.text, line.parsing)
        else:
            body = completion_body(f"cmpl-{_hex()}", created, line.model, self.fingerprint,
                                   line.n, results, self.text)
        return index, output_line(line.custom_id, _response(200, body)), True
