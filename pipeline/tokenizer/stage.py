"""Tokenizer stage process loop: text or chat messages -> token ids, and request validation.

Owns the tokenizer (and its chat template). It receives GatewayRequest / AbortRequest from
the gateway in arrival order. A valid request is registered with the token processor first
and then handed to the engine as an EngineRequest (so the token processor always knows a
request before any of its tokens can reach it); an invalid one is answered straight to the
gateway with an error naming the field and the limit. Aborts are forwarded in order, so an
abort can never overtake the request it cancels. It never touches KV blocks.
"""
from __future__ import annotations

import time

from pipeline.messages import (
    AbortRequest,
    EngineRequest,
    GatewayRequest,
    OutputRegistration,
    error_result,
    ids_to_bytes,
)
from pipeline.runtime import rings
from pipeline.runtime.process import ReadyFn, log
from pipeline.runtime.spec import StageSpec
from pipeline.tokenizer.tokenizer import Tokenizer
from pipeline.tokenizer.validate import InvalidRequest, check_prompt_text, one_prompt_field, validate_request


class TokenizerLoop:
    def __init__(self, spec: StageSpec) -> None:
        assert spec.model is not None
        self.spec = spec
        self.model = spec.model
        self.tokenizer = Tokenizer(spec.config.model)
        self.eos = list(spec.model.eos_token_ids)
        self.inbox = rings.attach(spec, "submit")
        self.rejects = rings.attach(spec, "rejects", "writer")
        self.register = rings.attach(spec, "register", "writer")
        self.requests = rings.attach(spec, "requests", "writer")

    def prompt_ids(self, req: GatewayRequest) -> tuple[list[int], str]:
        """The prompt as token ids, and the field they came from."""
        field = one_prompt_field(prompt=req.prompt, prompt_token_ids=req.prompt_token_ids,
                                 messages=req.messages)
        if req.prompt is not None:
            check_prompt_text(req.prompt)
            return self.tokenizer.encode(req.prompt), field
        if req.messages is not None:
            if not req.messages:
                raise InvalidRequest("field `messages`: at least one message is required")
            return self.tokenizer.apply_chat_template(req.messages), field
        return list(req.prompt_token_ids or []), field

    def _reject(self, req: GatewayRequest, code: str, message: str) -> None:
        self.rejects.send(error_result(req.req_id, code, message, arrival_time=req.arrival_time))

    def handle(self, req: GatewayRequest) -> None:
        try:
            ids, field = self.prompt_ids(req)
            validate_request(ids, req.sampling_params, field=field,
                             vocab_size=self.model.vocab_size,
                             max_model_len=self.model.max_model_len)
        except (ValueError, TypeError, KeyError) as exc:  # InvalidRequest, chat template errors
            self._reject(req, "invalid_request", str(exc))
            return
        except Exception as exc:  # noqa: BLE001 - one bad request must not stop the stage
            self._reject(req, "tokenizer_error", f"{type(exc).__name__}: {exc}")
            return
        token_bytes = ids_to_bytes(ids)
        # Sends block while a ring is full (back-pressure); PeerDied if its reader died.
        self.register.send(OutputRegistration(
            req_id=req.req_id, prompt_token_ids=token_bytes, sampling_params=req.sampling_params,
            stream=req.stream, arrival_time=req.arrival_time))
        self.requests.send(EngineRequest(
            req_id=req.req_id, prompt_token_ids=token_bytes, sampling_params=req.sampling_params,
            arrival_time=req.arrival_time or time.time(), eos_token_ids=self.eos,
            priority=req.priority, cache_salt=req.cache_salt))

    def run_forever(self) -> None:
        while True:
            msg = self.inbox.recv(timeout=None)  # PeerDied if the gateway is gone
            if isinstance(msg, AbortRequest):
                self.requests.send(msg)
            else:
                self.handle(msg)


def run(spec: StageSpec, ready: ReadyFn) -> None:
    loop = TokenizerLoop(spec)
    log(spec, "tokenizer loaded")
    ready({})
    loop.run_forever()
