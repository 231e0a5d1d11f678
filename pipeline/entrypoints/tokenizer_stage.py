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

import msgspec
import numpy as np

from pipeline.engine.messages import AbortRequest, EngineRequest
from pipeline.engine.sched_output import ids_to_bytes
from pipeline.entrypoints.protocol import ProtocolError, check_prompt_len
from pipeline.entrypoints.stages import ReadyFn, StageSpec, Unpacker, log, pack
from pipeline.ipc.ring import Ring
from pipeline.output.stage import OutputRegistration, error_result
from pipeline.sampling_params import SamplingParams

MAX_PROMPT_CHARS = 4 << 20


class GatewayRequest(msgspec.Struct, kw_only=True, omit_defaults=True):
    """A parsed client request, before tokenization (gateway -> tokenizer)."""
    req_id: str
    sampling_params: SamplingParams
    prompt: str | None = None
    prompt_token_ids: list[int] | None = None
    messages: list[dict[str, str]] | None = None  # role, content, optional name
    stream: bool = False
    arrival_time: float = 0.0
    priority: int = 0
    cache_salt: str | None = None


def gateway_request(gen, sp: SamplingParams, req_id: str) -> GatewayRequest:
    """From the protocol's validated Generate (pipe mode or ZMQ) to the tokenizer's input."""
    return GatewayRequest(
        req_id=req_id, sampling_params=sp, prompt=gen.prompt,
        prompt_token_ids=gen.prompt_token_ids, stream=gen.stream, arrival_time=time.time(),
        messages=None if gen.messages is None else [msgspec.to_builtins(m) for m in gen.messages],
        priority=gen.priority, cache_salt=gen.cache_salt)


class InvalidRequest(ValueError):
    pass


class TokenizerLoop:
    def __init__(self, spec: StageSpec) -> None:
        from pipeline.worker.tokenizer import Tokenizer  # noqa: PLC0415

        assert spec.model is not None
        self.spec = spec
        self.model = spec.model
        self.tokenizer = Tokenizer(spec.config.model)
        self.eos = list(spec.model.eos_token_ids)
        self.inbox = Ring.attach(spec.rings["submit"])
        self.rejects = Ring.attach(spec.rings["rejects"], "writer")
        self.register = Ring.attach(spec.rings["register"], "writer")
        self.requests = Ring.attach(spec.rings["requests"], "writer")
        self.unpack = Unpacker({b"Q": GatewayRequest, b"A": AbortRequest})

    def prompt_ids(self, req: GatewayRequest) -> list[int]:
        given = [f for f in ("prompt", "prompt_token_ids", "messages")
                 if getattr(req, f) is not None]
        if len(given) != 1:
            raise InvalidRequest("exactly one of prompt, prompt_token_ids, messages "
                                 f"is required, got {given or 'none'}")
        if req.prompt is not None:
            if len(req.prompt) > MAX_PROMPT_CHARS:
                raise InvalidRequest(f"field `prompt`: at most {MAX_PROMPT_CHARS} characters, "
                                     f"got {len(req.prompt)}")
            ids = self.tokenizer.encode(req.prompt)
        elif req.messages is not None:
            if not req.messages:
                raise InvalidRequest("field `messages`: at least one message is required")
            ids = self.tokenizer.apply_chat_template(req.messages)
        else:
            ids = list(req.prompt_token_ids or [])
            vocab = self.model.vocab_size
            arr = np.asarray(ids, dtype=np.int64)
            if arr.size and (arr.min() < 0 or arr.max() >= vocab):
                bad = int(arr[(arr < 0) | (arr >= vocab)][0])
                raise InvalidRequest(f"field `prompt_token_ids`: ids must be in [0, vocab_size={vocab}),"
                                     f" got {bad}")
        return ids

    def validate(self, req: GatewayRequest, ids: list[int]) -> None:
        limit = self.model.max_model_len
        try:
            req.sampling_params.validate(vocab_size=self.model.vocab_size, max_model_len=limit)
        except ValueError as exc:
            name, _, rest = str(exc).partition(" ")
            raise InvalidRequest(f"field `{name}`: {rest}") from None
        field = next(f for f in ("prompt", "prompt_token_ids", "messages")
                     if getattr(req, f) is not None)
        try:
            check_prompt_len(len(ids), limit, field)  # the protocol's one rule
        except ProtocolError as exc:
            raise InvalidRequest(exc.error.message) from None
        need = len(ids) + req.sampling_params.max_tokens
        if need > limit:
            raise InvalidRequest(f"field `max_tokens`: {len(ids)} prompt tokens + max_tokens "
                                 f"{req.sampling_params.max_tokens} = {need} exceeds "
                                 f"max_model_len ({limit})")

    def _reject(self, req: GatewayRequest, code: str, message: str) -> None:
        res = error_result(req.req_id, code, message, arrival_time=req.arrival_time)
        self.rejects.send(pack(b"R", res))

    def handle(self, req: GatewayRequest) -> None:
        try:
            ids = self.prompt_ids(req)
            self.validate(req, ids)
        except (InvalidRequest, ValueError, TypeError, KeyError) as exc:
            self._reject(req, "invalid_request", str(exc))
            return
        except Exception as exc:  # noqa: BLE001 - one bad request must not stop the stage
            self._reject(req, "tokenizer_error", f"{type(exc).__name__}: {exc}")
            return
        token_bytes = ids_to_bytes(ids)
        reg = OutputRegistration(req_id=req.req_id, prompt_token_ids=token_bytes,
                                 sampling_params=req.sampling_params, stream=req.stream,
                                 arrival_time=req.arrival_time)
        # Sends block while a ring is full (back-pressure); PeerDied if its reader died.
        self.register.send(pack(b"G", reg))
        ereq = EngineRequest(req_id=req.req_id, prompt_token_ids=token_bytes,
                             sampling_params=req.sampling_params,
                             arrival_time=req.arrival_time or time.time(),
                             eos_token_ids=self.eos, priority=req.priority,
                             cache_salt=req.cache_salt)
        self.requests.send(pack(b"E", ereq))

    def run_forever(self) -> None:
        while True:
            msg = self.unpack(self.inbox.recv(timeout=None))  # PeerDied if the gateway is gone
            if isinstance(msg, AbortRequest):
                self.requests.send(pack(b"A", msg))
            else:
                self.handle(msg)


def run(spec: StageSpec, ready: ReadyFn) -> None:
    loop = TokenizerLoop(spec)
    log(spec, "tokenizer loaded")
    ready({})
    loop.run_forever()
