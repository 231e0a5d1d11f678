"""Tokenizer stage process loop: text or chat messages -> token ids, and request validation.

Owns the tokenizer (and its chat template), a small pool of tokenizing threads and the table
of requests being tokenized. It receives GatewayRequest / AbortRequest from the gateway in
arrival order. Each request is tokenized and validated on a pool thread (`Tokenizer` encodes
with `tokenizers`' encode_batch, which releases the GIL), so a multi-megabyte prompt does not
hold up the small requests behind it: requests leave in the order their tokenization ends.
A request with ``structured_outputs`` runs on its own threads (``GRAMMAR_THREADS``), where its
grammar compiles once per spec under a time budget in a child process (grammar_server.py) and
then travels with it (``EngineRequest.grammar``): a pending compile never holds up a request
without a grammar (pending ones are bounded apart, ``MAX_PENDING_GRAMMARS``). A valid request is
registered with the token processor first and then handed to the engine as an EngineRequest
(so the token processor always knows a request before any of its tokens can reach it); an
invalid one is answered straight to the gateway with an error naming the field and the
limit. An abort for a request still being tokenized is answered here (finish_reason "abort")
and the request is dropped when its tokenization ends; any other abort is forwarded to the
engine, after the request it cancels (both go out under one lock, the request first). It
never touches KV blocks. The chat template is the checkpoint's, or ``--chat-template``'s
(``EngineConfig.chat_template``, the file's text).

State: ``pending`` (req_id -> request being tokenized; ``num_grammars`` of them have a
grammar) under ``lock``, which every ring send
holds too (each ring has one producer: this process).
"""
from __future__ import annotations

import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor

from pipeline.messages import (
    AbortRequest,
    EngineRequest,
    GatewayRequest,
    OutputRegistration,
    RequestResult,
    error_result,
    ids_to_bytes,
)
from pipeline.runtime import rings
from pipeline.runtime.process import ReadyFn, log
from pipeline.runtime.spec import StageSpec
from pipeline.tokenizer.grammar_server import COMPILE_PROCESSES, GrammarService
from pipeline.tokenizer.tokenizer import Tokenizer, check_chat_options, max_token_text_bytes, settle_reasoning
from pipeline.tokenizer.validate import (
    InvalidRequest,
    check_answer_fits,
    check_kv_transfer,
    one_prompt_field,
    prepare_request,
)

TOKENIZE_THREADS = 4
MAX_PENDING = 4 * TOKENIZE_THREADS  # requests read but not sent on yet: bounds memory
GRAMMAR_THREADS = COMPILE_PROCESSES  # requests with structured_outputs (each waits on its compile)
# Requests with a grammar read but not sent on (apart from MAX_PENDING): past it the loop
# waits, at most the compile budget times the grammars ahead per compile process.
MAX_PENDING_GRAMMARS = 4 * MAX_PENDING
ERROR_MESSAGE_BYTES = 4096  # an error answer's message is clipped to this (rejects ring)


def clip(message: str, limit: int = ERROR_MESSAGE_BYTES) -> str:
    """``message`` as valid UTF-8 of at most ``limit`` bytes (an error may quote user input)."""
    raw = message.encode("utf-8", "replace")
    if len(raw) <= limit:
        return raw.decode("utf-8")
    return raw[:limit - 3].decode("utf-8", "ignore") + "..."


class _Pending:
    __slots__ = ("req", "future", "grammar")

    def __init__(self, req: GatewayRequest) -> None:
        self.req = req
        self.future: Future | None = None
        self.grammar = req.sampling_params.structured_outputs is not None


class TokenizerLoop:
    def __init__(self, spec: StageSpec) -> None:
        assert spec.model is not None
        self.spec = spec
        self.model = spec.model
        self.role = spec.config.kv_transfer_config.role
        self.tokenizer = Tokenizer(spec.config.model_config.model, chat_template=spec.config.model_config.chat_template)
        self.token_text_bytes = max_token_text_bytes(self.tokenizer.tok)
        # The gateway sized the answers ring for a max_model_len at least this one's.
        self.answer_limit = rings.message_limits(spec.config, spec.model.max_model_len)["answers"]
        self.eos = list(spec.model.eos_token_ids)
        self.inbox = rings.attach(spec, "submit")
        self.rejects = rings.attach(spec, "rejects", "writer")
        self.register = rings.attach(spec, "register", "writer")
        self.requests = rings.attach(spec, "requests", "writer")
        self.lock = threading.Lock()
        self.room = threading.Condition(self.lock)  # notified when `pending` shrinks
        self.pending: dict[str, _Pending] = {}
        self.num_grammars = 0  # of `pending`, those with structured_outputs
        self.pool = ThreadPoolExecutor(TOKENIZE_THREADS, thread_name_prefix="tokenize")
        self.grammar_pool = ThreadPoolExecutor(GRAMMAR_THREADS, thread_name_prefix="grammar")
        self.failure: BaseException | None = None  # a pool thread's, re-raised by the loop
        self._grammars: GrammarService | None = None  # compile processes start with the first grammar
        self._grammars_lock = threading.Lock()

    def prompt_ids(self, req: GatewayRequest) -> tuple[list[int], str]:
        """The prompt as token ids, and the field they came from."""
        field = one_prompt_field(prompt=req.prompt, prompt_token_ids=req.prompt_token_ids,
                                 messages=req.messages)
        options = check_chat_options(has_messages=req.messages is not None,
                                     add_generation_prompt=req.add_generation_prompt,
                                     continue_final_message=req.continue_final_message,
                                     chat_template_kwargs=req.chat_template_kwargs, tools=req.tools)
        if req.prompt is not None:  # the gateway checked its size
            return self.tokenizer.encode(req.prompt), field
        if req.messages is not None:
            if not req.messages:
                raise InvalidRequest("field `messages`: at least one message is required")
            return self.tokenizer.apply_chat_template(req.messages, req.add_generation_prompt,
                                                      **options), field
        return list(req.prompt_token_ids or []), field

    def prepare(self, req: GatewayRequest) -> tuple[bytearray, bytearray] | RequestResult:
        """Tokenize and validate (on a pool thread): the encoded registration and engine
        request, or the error answer."""
        try:
            ids, field = self.prompt_ids(req)
            embed = req.task == "embed"
            ids, sp = prepare_request(ids, req.sampling_params, field=field,
                                      vocab_size=self.model.vocab_size,
                                      max_model_len=self.model.max_model_len,
                                      encode=self._encode_plain, embed=embed)
            if embed and req.kv_transfer is not None:
                raise InvalidRequest("field `task`: an embedding request runs on one instance "
                                     "(no kv_transfer)")
            sp = settle_reasoning(sp, ids, self.tokenizer)
            check_answer_fits(sp, len(ids), self.token_text_bytes, self.answer_limit)
            # Compiled once per spec (a refused one never reaches the engine); the worker loads it.
            grammar = None if sp.structured_outputs is None else self.grammars().compile(sp.structured_outputs)
            check_kv_transfer(req.kv_transfer, self.role, num_prompt_tokens=len(ids), sp=sp,
                              stream=req.stream, block_size=self.model.kv.block_size)
            token_bytes = ids_to_bytes(ids)
            reg = self.register.encode(OutputRegistration(
                req_id=req.req_id, prompt_token_ids=token_bytes, sampling_params=sp,
                stream=req.stream, arrival_time=req.arrival_time))
            eng = self.requests.encode(EngineRequest(
                req_id=req.req_id, prompt_token_ids=token_bytes, sampling_params=sp,
                arrival_time=req.arrival_time or time.time(), eos_token_ids=self.eos,
                priority=req.priority, cache_salt=req.cache_salt, kv_transfer=req.kv_transfer,
                grammar=grammar, embed=embed))
            for ch, buf in ((self.register, reg), (self.requests, eng)):
                if len(buf) > ch.max_message_bytes:  # both checked before either is sent
                    raise InvalidRequest(f"request: {len(buf)} bytes once tokenized, the limit is "
                                         f"{ch.max_message_bytes} bytes (ring {ch.role})")
            return reg, eng
        except (ValueError, TypeError, KeyError) as exc:  # InvalidRequest, chat template errors
            return self._error(req, "invalid_request", str(exc))
        except Exception as exc:  # noqa: BLE001 - one bad request must not stop the stage
            return self._error(req, "tokenizer_error", f"{type(exc).__name__}: {exc}")

    def grammars(self) -> GrammarService:
        """The compiler of structured outputs (its cache keyed by the spec), made once."""
        with self._grammars_lock:
            if self._grammars is None:
                self._grammars = GrammarService(self.spec.config.model_config.model, self.model.vocab_size,
                                                self.eos)
            return self._grammars

    def _encode_plain(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False)

    def _error(self, req: GatewayRequest, code: str, message: str) -> RequestResult:
        return error_result(req.req_id, code, clip(message), arrival_time=req.arrival_time)

    def _tokenize(self, p: _Pending) -> None:
        """Pool thread: prepare the request, then send it on unless it was aborted meanwhile."""
        try:
            out = self.prepare(p.req)
            with self.lock:
                if self.pending.get(p.req.req_id) is not p:
                    return  # aborted while it was tokenized: answered already
                self._forget(p)
                # Sends block while a ring is full (back-pressure); PeerDied if its reader died.
                if isinstance(out, RequestResult):
                    self.rejects.send(out)
                else:
                    self.register.send_encoded(out[0])
                    self.requests.send_encoded(out[1])
        except BaseException as exc:  # noqa: BLE001 - the loop re-raises it: the stage stops
            self.failure = self.failure or exc

    def _forget(self, p: _Pending) -> None:
        """Under ``lock``: ``p`` leaves ``pending``."""
        del self.pending[p.req.req_id]
        self.num_grammars -= p.grammar
        self.room.notify()

    def _full(self, grammar: bool) -> bool:
        if grammar:
            return self.num_grammars >= MAX_PENDING_GRAMMARS
        return len(self.pending) - self.num_grammars >= MAX_PENDING

    def accept(self, req: GatewayRequest) -> None:
        p = _Pending(req)
        with self.lock:
            while self._full(p.grammar) and self.failure is None:
                self.room.wait(self.spec.ring_timeout_s)
            self.pending[req.req_id] = p
            self.num_grammars += p.grammar
        p.future = (self.grammar_pool if p.grammar else self.pool).submit(self._tokenize, p)

    def abort(self, msg: AbortRequest) -> None:
        why = msg.message or "aborted"
        with self.lock:
            forward = []
            for rid in msg.req_ids:
                p = self.pending.get(rid)
                if p is None:
                    forward.append(rid)  # in the engine already (or answered): its job
                    continue
                self._forget(p)
                if p.future is not None:
                    p.future.cancel()  # frees its pool slot if it has not started
                self.rejects.send(error_result(rid, "aborted", clip(f"{why} (while it was tokenized)"),
                                               finish_reason="abort",
                                               arrival_time=p.req.arrival_time))
            if forward:
                self.requests.send(AbortRequest(req_ids=forward, reason=msg.reason, message=msg.message))

    def run_forever(self) -> None:
        while self.failure is None:
            try:
                # PeerDied if the gateway is gone; the timeout is how soon a pool thread's
                # failure stops the stage.
                msg = self.inbox.recv(timeout=self.spec.ring_timeout_s)
            except TimeoutError:
                continue
            if isinstance(msg, AbortRequest):
                self.abort(msg)
            else:
                self.accept(msg)
        if self._grammars is not None:
            self._grammars.close()
        raise self.failure


def run(spec: StageSpec, ready: ReadyFn) -> None:
    loop = TokenizerLoop(spec)
    log(spec, f"tokenizer loaded ({TOKENIZE_THREADS} tokenizing threads)")
    ready({})
    loop.run_forever()
