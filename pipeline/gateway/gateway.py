"""Gateway (main process): starts the stage processes, feeds them and supervises them.

The instance's start-up and tear-down (rings, stage processes) are its base class's
(``gateway.stages``); here: the in-flight table, the two threads that receive answers and
watch the stages, and the drain. The in-flight table is what guarantees every accepted
request exactly one final answer: from the token processor, from the tokenizer (invalid
request), or from the gateway itself when a stage died or a drain ran out of time. It never
tokenizes or schedules. `pipeline run` and `pipeline serve` are thin front ends over it.

A request `submit` cannot take (the server is failed or draining, a request over the byte
limits of ``messages.requests``, measured as it will cross the submit ring, or one more than
max_num_seqs + ``--max-queued-requests`` in flight: "queue_full") gets an error answer through
``on_output`` instead of being accepted; `submit` does not raise for it.
The rings are sized from those limits and max_model_len (``runtime.rings``).
Owns: the in-flight table, the engine's latest stats, the two threads (each with an Event it
sets when it ends).
"""
from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable
from multiprocessing.connection import wait as wait_sentinels

import msgspec

from pipeline.config import EngineConfig
from pipeline.gateway.stages import STOP_GRACE_S, GatewayStages
from pipeline.ipc.errors import PeerDied
from pipeline.ipc.ring import wait_any
from pipeline.messages import AbortRequest, EngineStats, GatewayRequest, RequestDelta, RequestResult, error_result
from pipeline.runtime.lifecycle import describe_exit, last_words, stop_stages
from pipeline.runtime.process import EXIT_PEER_DIED
from pipeline.runtime.spec import ModelInfo
from pipeline.tokenizer.validate import InvalidRequest, check_messages_bytes, check_prompt_text

Answer = RequestDelta | RequestResult
ABORT_CHUNK = 1024  # request ids per AbortRequest (ids are at most 1 KiB of UTF-8 each)
OnOutput = Callable[[Answer], None]


def size_problem(req: GatewayRequest, encoded_size: int, limit: int) -> str | None:
    """Why ``req`` (``encoded_size`` bytes as the submit ring carries it) is too large, if
    it is: its prompt over MAX_PROMPT_BYTES, or the whole over ``limit`` (naming the field
    that takes the most)."""
    try:
        if req.prompt is not None:
            check_prompt_text(req.prompt)
        if req.messages is not None:
            check_messages_bytes(req.messages)
    except InvalidRequest as exc:
        return str(exc)
    if encoded_size <= limit:
        return None
    fields = {f: len(msgspec.msgpack.encode(getattr(req, f))) for f in
              ("prompt", "prompt_token_ids", "messages", "chat_template_kwargs", "tools", "sampling_params",
               "cache_salt", "req_id")}
    name = max(fields, key=fields.__getitem__)
    return (f"request: {encoded_size} bytes encoded, the limit is {limit} bytes "
            f"(MAX_REQUEST_BYTES); field `{name}` takes {fields[name]} of them")


class Gateway(GatewayStages):
    def __init__(self, config: EngineConfig, on_output: OnOutput,
                 log: Callable[[str], None] | None = None) -> None:
        super().__init__(config, log or (lambda m: print(f"[gateway] {m}", file=sys.stderr, flush=True)))
        self.on_output = on_output
        self.inflight: dict[str, bool] = {}  # req_id -> stream
        self.lock = threading.Lock()  # the in-flight table; held while answering
        self.submit_lock = threading.Lock()  # the submit ring has a single producer
        self.idle = threading.Condition(self.lock)
        self.accepting = False
        self.failure: str | None = None  # set once when a stage dies
        self.failed = threading.Event()
        self.stopping = threading.Event()
        self._threads: list[tuple[threading.Thread, threading.Event]] = []  # and its end
        self.engine_stats = EngineStats()
        self.stats_updated = threading.Event()

    # ---- start-up ----
    def start(self, timeout_s: float = 600.0) -> ModelInfo:
        model = self._start_stages(timeout_s)
        self.accepting = True
        for target in (self._receive_loop, self._supervise_loop):
            ended = threading.Event()
            t = threading.Thread(target=self._run_thread, args=(target, ended),
                                 name=f"gateway-{target.__name__}", daemon=True)
            t.start()
            self._threads.append((t, ended))
        self.log(f"ready: {len(self.stages)} stage processes, instance {self.config.instance_id}")
        return model

    @staticmethod
    def _run_thread(target: Callable[[], None], ended: threading.Event) -> None:
        # The thread says itself when it ended: Thread.join is not trusted for that (on
        # Python 3.11 a signal handler's exception raised inside join() can mark a live
        # thread stopped, bpo-45274), and close() unmaps the rings these threads read.
        try:
            target()
        finally:
            ended.set()

    # ---- requests ----
    def submit(self, req: GatewayRequest) -> bool:
        """Hand a request to the tokenizer stage. False if refused: then it got its error
        answer; ``failure`` / ``accepting`` say whether later requests will be refused too.

        ValueError only for a ``req_id`` already in flight: internal ids are the front end's
        to keep unique, and an answer under that id would be taken for the running one's."""
        ring = self.rings["submit"]
        buf: bytearray | None = None
        try:
            buf = ring.encode(req)
            problem = size_problem(req, len(buf), ring.max_message_bytes)
        except Exception as exc:  # noqa: BLE001 - e.g. a string msgpack cannot carry
            problem = f"request: cannot be encoded: {exc}"
        with self.lock:
            code, refusal = "unavailable", self.failure
            if refusal is None and not self.accepting:
                code, refusal = "draining", "the server is draining: it accepts no new requests"
            if refusal is None and problem is not None:
                code, refusal = "invalid_request", problem
            queued = self.config.scheduler_config.max_queued_requests
            room = self.config.scheduler_config.max_num_seqs + queued
            if refusal is None and queued and len(self.inflight) >= room:
                code, refusal = "queue_full", (
                    f"the server is full: {len(self.inflight)} requests in flight, the limit is "
                    f"{room} (--max-num-seqs {self.config.scheduler_config.max_num_seqs} + --max-queued-requests "
                    f"{queued}); retry later")
            if req.req_id in self.inflight:
                raise ValueError(f"request id {req.req_id!r} is already in flight")
            if refusal is None:
                self.inflight[req.req_id] = req.stream
        if refusal is not None:
            self._answer(error_result(req.req_id, code, refusal, arrival_time=req.arrival_time))
            return False
        assert buf is not None  # else `problem` refused it
        try:
            with self.submit_lock:
                ring.send_encoded(buf, timeout=30.0)
            return True
        except Exception as exc:  # noqa: BLE001 - PeerDied, TimeoutError, ...: answered here
            with self.lock:
                if self.inflight.pop(req.req_id, None) is not None:
                    self._answer(error_result(req.req_id, "unavailable",
                                              f"tokenizer stage unavailable: {exc}",
                                              arrival_time=req.arrival_time))
                    if not self.inflight:
                        self.idle.notify_all()
            return False

    def abort(self, req_ids: list[str], message: str = "aborted by the client") -> None:
        """Abort requests in flight; each gets a final answer with finish_reason "abort" and
        ``ErrorInfo("aborted", message)`` (``message`` says who aborted and why)."""
        with self.lock:
            ids = [i for i in req_ids if i in self.inflight]
        try:
            # In chunks: a drain may abort any number of requests, and each message (and the
            # engine's answer to it) must fit its ring.
            for at in range(0, len(ids) if self.failure is None else 0, ABORT_CHUNK):
                with self.submit_lock:
                    self.rings["submit"].send(AbortRequest(req_ids=ids[at:at + ABORT_CHUNK],
                                                           reason="abort", message=message),
                                              timeout=5.0)
        except (PeerDied, TimeoutError):
            pass  # the supervisor answers everything when a stage is gone

    def _answer(self, out: Answer) -> None:
        # A front end that fails to take an answer (stdout closed, ...) must not stop the
        # threads that answer everyone else.
        try:
            self.on_output(out)
        except Exception as exc:  # noqa: BLE001
            self.log(f"dropped the answer of {out.id}: {type(exc).__name__}: {exc}")

    def num_inflight(self) -> int:
        with self.lock:
            return len(self.inflight)

    def _deliver(self, out: Answer) -> None:
        # Under the lock, so no delta can follow the final answer the supervisor gave.
        with self.lock:
            if out.id not in self.inflight:
                return  # already answered (e.g. failed by the gateway first)
            if isinstance(out, RequestResult):
                del self.inflight[out.id]
                if not self.inflight:
                    self.idle.notify_all()
            self._answer(out)

    def _receive_loop(self) -> None:
        answers, rejects, stats = self.rings["answers"], self.rings["rejects"], self.rings["stats"]
        while not self.stopping.is_set():
            try:
                try:
                    wait_any([answers.ring, rejects.ring, stats.ring], 0.2)
                except TimeoutError:
                    continue
                for ch in (answers, rejects):
                    while not self.stopping.is_set() and (out := ch.try_recv()) is not None:
                        self._deliver(out)
                while (snap := stats.try_recv()) is not None:
                    self.engine_stats = snap
                    self.stats_updated.set()
            except PeerDied:
                # The supervisor names the stage and answers. Not when close() stopped the
                # stages: it set `stopping` before, and joins this thread.
                if not self.stopping.is_set():
                    self.failed.wait(2.0)
                return
            except Exception as exc:  # noqa: BLE001 - nobody would answer in-flight requests
                self._fail(f"gateway: receiving answers failed: {type(exc).__name__}: {exc}")
                return

    def fresh_engine_stats(self, timeout_s: float = 1.0) -> EngineStats:
        """The engine's next stats snapshot (it publishes a few per second)."""
        self.stats_updated.clear()
        self.stats_updated.wait(timeout_s)
        return self.engine_stats

    # ---- supervision ----
    def _supervise_loop(self) -> None:
        procs = {s.process.sentinel: s for s in self.stages}
        while not self.stopping.is_set():
            ready = wait_sentinels(list(procs), timeout=0.5)
            if not ready or self.stopping.is_set():
                continue
            # Give the others a moment to follow, then blame one that did not die of a peer.
            time.sleep(0.05)
            dead = [s for s in self.stages if not s.process.is_alive()]
            first = next((s for s in dead if s.process.exitcode != EXIT_PEER_DIED), dead[0])
            why = last_words(first)
            self._fail(f"stage {first.spec.name} (pid {first.process.pid}) died: "
                       f"{describe_exit(first.process.exitcode)}" + (f" ({why})" if why else ""))
            return

    def _fail(self, message: str) -> None:
        with self.lock:
            if self.failure is not None:
                return
            self.failure = message
            self.accepting = False
            for req_id in self.inflight:
                self._answer(error_result(req_id, "stage_died", message))
            self.inflight.clear()
            self.idle.notify_all()
        self.log(message)
        self.failed.set()

    # ---- shutdown ----
    def stop_accepting(self) -> None:
        """Refuse every later submit ("draining"). Takes no lock, so a signal handler may call
        it: the flag is one attribute store, which submit reads under its lock."""
        self.accepting = False

    def drain(self, timeout_s: float, message: str = "aborted by the server: it shut down "
                                                        "before the request finished") -> int:
        """Stop accepting, wait for in-flight requests, abort what is left with ``message``;
        returns #aborted."""
        with self.lock:
            self.accepting = False
            self.idle.wait_for(lambda: not self.inflight or self.failure is not None, timeout_s)
            left = list(self.inflight)
        if not left:
            return 0
        self.log(f"drain timeout: aborting {len(left)} request(s)")
        self.abort(left, message)
        with self.lock:
            self.idle.wait_for(lambda: not self.inflight or self.failure is not None, 2.0)
            for req_id in self.inflight:
                self._answer(error_result(req_id, "aborted", message, finish_reason="abort"))
            self.inflight.clear()
        return len(left)

    def close(self) -> None:
        self.stopping.set()
        self.accepting = False
        stop_stages(self.stages, STOP_GRACE_S)
        others = [ended for t, ended in self._threads if t is not threading.current_thread()]
        for ended in others:
            ended.wait(1.0)
        self._release(unmap=all(ended.is_set() for ended in others))
