"""Gateway (main process): starts the stage processes, feeds them and supervises them.

Owns the instance's shared-memory rings (it creates and unlinks them all), the stage
processes, and the table of in-flight requests, which is what guarantees every accepted
request exactly one final answer: from the token processor, from the tokenizer (invalid
request), or from the gateway itself when a stage died or a drain ran out of time. It never
tokenizes or schedules. `pipeline run` and `pipeline serve` are thin front ends over it.

A request `submit` cannot take (the server is failed or draining, a request over the byte
limits of ``messages.requests``, measured as it will cross the submit ring, or one more than
max_num_seqs + ``--max-queued-requests`` in flight: "queue_full") gets an error answer through
``on_output`` instead of being accepted; `submit` does not raise for it.
The rings are sized from those limits and max_model_len (``runtime.rings``).
"""
from __future__ import annotations

import multiprocessing as mp
import os
import socket
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from multiprocessing.connection import wait as wait_sentinels
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgspec

from pipeline.config import EngineConfig
from pipeline.gateway.supervisor import Stage, describe_exit, last_words, send_start, spawn_stage, wait_ready
from pipeline.ipc.broadcast import BroadcastRing
from pipeline.ipc.errors import PeerDied
from pipeline.ipc.instance import Instance, owner_alive, unlink_instance
from pipeline.ipc.layer_signal import LayerSignal
from pipeline.ipc.ring import Doorbell, Ring, wait_any
from pipeline.ipc.sweep import sweep_stale
from pipeline.messages import AbortRequest, EngineStats, GatewayRequest, RequestDelta, RequestResult, error_result
from pipeline.models.config import load_model_config
from pipeline.runtime.process import EXIT_PEER_DIED, NEEDS_MODEL, STOP_SIGNAL
from pipeline.runtime.ring_sizes import capacity
from pipeline.runtime.rings import (
    LAYERS_ROLE,
    SHARED_DOORBELLS,
    STEPS_ROLE,
    Channel,
    message_limits,
    ring_names,
    ring_roles,
)
from pipeline.runtime.spec import ModelInfo, StageSpec
from pipeline.tokenizer.validate import InvalidRequest, check_messages_bytes, check_prompt_text

if TYPE_CHECKING:
    import psutil

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
              ("prompt", "prompt_token_ids", "messages", "chat_template_kwargs", "sampling_params",
               "cache_salt", "req_id")}
    name = max(fields, key=fields.__getitem__)
    return (f"request: {encoded_size} bytes encoded, the limit is {limit} bytes "
            f"(MAX_REQUEST_BYTES); field `{name}` takes {fields[name]} of them")


def sweep_kv_sockets(run_dir: Path) -> None:
    """Remove the ipc sockets decode instances left behind when killed (`<id>`: a dead
    instance, by the owner record ``ipc.sweep`` judges /dev/shm entries by)."""
    for path in run_dir.glob("pipeline-*.kv"):
        iid = path.name[len("pipeline-"):-len(".kv")]
        if owner_alive(iid) is not True and path.is_socket() and path.stat().st_uid == os.geteuid():
            path.unlink(missing_ok=True)


def free_tcp_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


class Gateway:
    def __init__(self, config: EngineConfig, on_output: OnOutput,
                 log: Callable[[str], None] | None = None) -> None:
        self.config = config
        self.on_output = on_output
        self.log = log or (lambda m: print(f"[gateway] {m}", file=sys.stderr, flush=True))
        self.stages: list[Stage] = []
        self.model: ModelInfo | None = None
        self.instance: Instance | None = None
        self.rings: dict[str, Channel] = {}
        self.inflight: dict[str, bool] = {}  # req_id -> stream
        self.lock = threading.Lock()  # the in-flight table; held while answering
        self.submit_lock = threading.Lock()  # the submit ring has a single producer
        self.idle = threading.Condition(self.lock)
        self.accepting = False
        self.failure: str | None = None  # set once when a stage dies
        self.failed = threading.Event()
        self.stopping = threading.Event()
        self._threads: list[threading.Thread] = []
        self.engine_stats = EngineStats()
        self.stats_updated = threading.Event()
        self._ps: dict[int, psutil.Process] = {}  # cpu_percent needs the same handle
        self._names: dict[str, str] = {}  # ring role -> shared-memory name, told to every stage

    # ---- start-up ----
    def start(self, timeout_s: float = 600.0) -> ModelInfo:
        # A bad path or an unsupported checkpoint fails here, before any process starts.
        mc = load_model_config(self.config.model)
        # The worker's max_model_len is at most this (it refuses more than the checkpoint's).
        limits = message_limits(self.config, self.config.max_model_len or mc.max_position_embeddings)
        removed = sweep_stale()
        if removed:
            self.log(f"removed {len(removed)} stale shared-memory entries of dead instances")
        self.instance = Instance(self.config.instance_id)
        if self.config.role == "decode" and not self.config.kv_listen:
            # Same host only: where prefill instances' cache messagers reach ours.
            run_dir = Path(os.environ.get("XDG_RUNTIME_DIR") or tempfile.gettempdir())
            sweep_kv_sockets(run_dir)
            self.config = msgspec.structs.replace(
                self.config, kv_listen=f"ipc://{run_dir}/pipeline-{self.config.instance_id}.kv")
        try:
            # Every stage at once, the workers first, before the rings exist: each imports its
            # code (the workers: torch and the model) while the rings are made and the others
            # come up, then waits for ("start", model) (runtime.process): once the rings exist,
            # and for those built from the worker's ModelInfo (NEEDS_MODEL) once rank 0 sent it.
            self._names = self._ring_names()
            kinds = ["engine", "tokenizer", "output"] + (["messager"] if self.config.role != "mixed" else [])
            if self.config.tensor_parallel_size > 1 and not self.config.master_port:
                # One host: the ranks meet on loopback at a port free now.
                self.config = msgspec.structs.replace(self.config, master_port=free_tcp_port())
            for r in range(self.config.ranks_per_node):  # node 0's ranks; other nodes run theirs
                self._spawn(f"worker{r}", "worker", r)
            for k in kinds:
                self._spawn(k, k)
            self._create_rings(limits, mc.num_layers)
            for s in self.stages:
                self._start_stage(s)
            wait_ready(self.stages, timeout_s, self._on_ready)
            assert self.model is not None  # worker0 reported ready
        except BaseException:
            self.close()
            raise
        self.accepting = True
        for target in (self._receive_loop, self._supervise_loop):
            t = threading.Thread(target=target, name=f"gateway-{target.__name__}", daemon=True)
            t.start()
            self._threads.append(t)
        self.log(f"ready: {len(self.stages)} stage processes, instance {self.config.instance_id}")
        return self.model

    def _ring_names(self) -> dict[str, str]:
        """role -> shared-memory name of every ring (and the layer signal) of this instance."""
        assert self.instance is not None
        return {r: self.instance.name(r) for r in ring_names(self.config.role)}

    def _create_rings(self, limits: dict[str, int], num_layers: int) -> None:
        assert self.instance is not None
        bells = {c: Doorbell.create(self.instance, f"bell.{c}") for c in SHARED_DOORBELLS}
        self.doorbells = list(bells.values())
        for role, (producer, consumer) in ring_roles(self.config.role).items():
            mine = "gateway" in (producer, consumer)
            self.rings[role] = Channel(Ring.create(
                self.instance, role, capacity(limits[role]), doorbell=bells.get(consumer),
                role="writer" if producer == "gateway" else "reader", claim=mine), role)
        self.steps = BroadcastRing.create(self.instance, STEPS_ROLE, capacity(limits[STEPS_ROLE]),
                                          self.config.ranks_per_node)
        made = {r: ch.ring.name for r, ch in self.rings.items()} | {STEPS_ROLE: self.steps.name}
        if LAYERS_ROLE in self._names:
            # Worker rank 0 publishes each layer's "KV written" on it; the cache messager
            # blocks on it (the gateway owns it so it is unlinked with the instance).
            # Every rank's layers when the ranks share one KV segment (worker/kv_cache.py).
            self.layer_signal = LayerSignal.create(self.instance, LAYERS_ROLE,
                                                   num_layers * self.config.tensor_parallel_size)
            made[LAYERS_ROLE] = self.layer_signal.name
        assert made == self._names, (made, self._names)  # what the stages were told

    def _on_ready(self, stage: Stage) -> None:
        if stage.spec.kind == "worker" and stage.spec.rank == 0:
            self.model = msgspec.convert(stage.info, ModelInfo)
            for s in self.stages:
                self._start_stage(s)

    def _start_stage(self, stage: Stage) -> None:
        """Tell ``stage`` to start, once: when the rings exist and it has what it needs."""
        if stage.started or not self.rings:
            return
        if stage.spec.kind not in NEEDS_MODEL:
            send_start(stage, None)
        elif self.model is not None:
            send_start(stage, msgspec.structs.asdict(self.model))

    def _spawn(self, name: str, kind: str, rank: int = 0) -> Stage:
        stage = spawn_stage(mp.get_context("spawn"), StageSpec(
            name=name, kind=kind, config=self.config, rings=self._names, rank=rank,
            await_start=True))
        self.stages.append(stage)
        return stage

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
            queued = self.config.max_queued_requests
            room = self.config.max_num_seqs + queued
            if refusal is None and queued and len(self.inflight) >= room:
                code, refusal = "queue_full", (
                    f"the server is full: {len(self.inflight)} requests in flight, the limit is "
                    f"{room} (--max-num-seqs {self.config.max_num_seqs} + --max-queued-requests "
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

    def stats_stages(self) -> list[dict]:
        """Per stage process: pid, liveness, RSS and CPU % since the previous call."""
        import psutil  # here: a one-line `pipeline run` never asks, and start-up is shorter

        rows = []
        for s in self.stages:
            pid = s.process.pid
            assert pid is not None  # spawn_stage started every stage
            row: dict[str, Any] = {"stage": s.spec.name, "pid": pid, "alive": s.process.is_alive()}
            try:
                p = self._ps.get(pid) or self._ps.setdefault(pid, psutil.Process(pid))
                row |= {"rss_bytes": p.memory_info().rss, "cpu_percent": p.cpu_percent(None)}
            except (psutil.Error, TypeError):
                pass
            rows.append(row)
        return rows

    def close(self) -> None:
        self.stopping.set()
        self.accepting = False
        for s in self.stages:
            if s.process.is_alive():
                assert s.process.pid is not None  # alive, so started
                try:
                    os.kill(s.process.pid, STOP_SIGNAL)
                except ProcessLookupError:
                    pass
        deadline = time.monotonic() + 3.0
        for s in self.stages:
            s.process.join(max(0.0, deadline - time.monotonic()))
            if s.process.is_alive():
                s.process.kill()
                s.process.join(2.0)
        for t in self._threads:
            if t is not threading.current_thread():
                t.join(1.0)
        # Unmap only when no thread of ours can still touch a ring (unlinking below is what
        # frees the memory; a mapping dies with the process anyway).
        if not any(t.is_alive() for t in self._threads if t is not threading.current_thread()):
            for ring in [*(ch.ring for ch in self.rings.values()), getattr(self, "steps", None),
                         getattr(self, "layer_signal", None), *getattr(self, "doorbells", [])]:
                if ring is not None:
                    ring.close()
        if self.config.kv_listen.startswith("ipc://"):  # a killed messager leaves its socket
            Path(self.config.kv_listen[len("ipc://"):]).unlink(missing_ok=True)
        if self.instance is not None:
            self.instance.cleanup()
            # Segments a stage created itself (the worker's KV cache) and could not unlink
            # because it was killed belong to this instance too.
            unlink_instance(self.instance.id)
            self.instance = None
