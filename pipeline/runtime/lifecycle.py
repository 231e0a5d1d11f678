"""The life of a stage process, seen from the process that owns it: start, watch, stop.

One set of tools for every owner of stage processes: the gateway (all stages of an
instance), a TP node's main process (``gateway.worker_node``: its worker ranks) and the
in-process ``LLM`` over several ranks (``llm_tp``: ranks 1..N-1).

- start: ``spawn_stage`` starts one stage process (``runtime.process.stage_process``) with the
  'spawn' context; ``send_start`` tells one started with ``spec.await_start`` to go on (with
  the worker's ModelInfo where it needs it); ``wait_ready`` waits for the ready reports (or
  names the stage that failed), calling back on each. ``free_tcp_port``: where the ranks of
  one host meet (torch.distributed's master port).
- watch: ``last_words`` and ``describe_exit`` say why a stage died.
- stop: ``signal_stop`` sends STOP_SIGNAL (the stage exits 0 at once), ``reap`` waits for
  the exits under one deadline, kills what is left and collects it; ``stop_stages`` is both.

Owns no state: the owner holds the Stage records.
"""
from __future__ import annotations

import os
import signal
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from multiprocessing.connection import wait as wait_objects
from multiprocessing.process import BaseProcess

import msgspec

from pipeline.runtime.process import EXIT_PEER_DIED, STOP_SIGNAL, stage_process
from pipeline.runtime.spec import StageSpec


class StartupError(RuntimeError):
    """A stage could not start (bad model path, bad config, too little memory...)."""


@dataclass(slots=True)
class Stage:
    spec: StageSpec
    process: BaseProcess
    ctrl: Connection
    info: dict = field(default_factory=dict)
    started: bool = False  # send_start told it to start


def spawn_stage(ctx, spec: StageSpec) -> Stage:
    """Start one stage process (``ctx``: the 'spawn' multiprocessing context)."""
    parent, child = ctx.Pipe(duplex=True)  # the stage reports; the gateway says start
    proc = ctx.Process(target=stage_process, name=f"pipeline-{spec.name}",
                       args=(msgspec.msgpack.encode(spec), child), daemon=False)
    proc.start()
    child.close()
    return Stage(spec, proc, parent)


def send_start(stage: Stage, model: dict | None) -> None:
    """Tell a stage started with ``spec.await_start`` to start: the rings exist; ``model`` is
    the worker's ModelInfo (a dict) for a stage of ``runtime.process.NEEDS_MODEL``. A stage
    already gone is left to ``wait_ready``, which names it."""
    stage.started = True
    try:
        stage.ctrl.send(("start", model))
    except OSError:
        pass


def wait_ready(stages: list[Stage], timeout_s: float,
               on_ready: Callable[[Stage], None] | None = None) -> dict:
    """Wait for each stage's ready report (merged infos), or raise StartupError naming it.
    ``on_ready(stage)`` runs as each report comes, its ``info`` set."""
    deadline = time.monotonic() + timeout_s
    pending = {s.ctrl: s for s in stages}
    info: dict = {}
    while pending:
        left = deadline - time.monotonic()
        if left <= 0:
            raise StartupError(f"{', '.join(s.spec.name for s in pending.values())} "
                               f"did not become ready within {timeout_s:.0f}s")
        by_sentinel = {s.process.sentinel: s for s in pending.values()}
        for obj in wait_objects([*pending, *by_sentinel], timeout=min(left, 1.0)):
            stage = (pending.get(obj) if isinstance(obj, Connection)
                     else by_sentinel.get(obj) if isinstance(obj, int) else None)
            if stage is None or stage.ctrl not in pending:
                continue
            try:
                kind, payload = stage.ctrl.recv()
            except (EOFError, OSError):
                stage.process.join(1.0)
                raise StartupError(f"{stage.spec.name} exited during start-up "
                                   f"({describe_exit(stage.process.exitcode)})") from None
            if kind != "ready":
                raise StartupError(f"{stage.spec.name} failed to start: {payload}")
            stage.info = payload
            info |= payload
            del pending[stage.ctrl]
            if on_ready is not None:
                on_ready(stage)
    return info


def last_words(stage: Stage) -> str | None:
    """The error a dead stage reported on its control pipe, if it had time to."""
    try:
        while stage.ctrl.poll(0):
            kind, payload = stage.ctrl.recv()
            if kind == "error":
                return str(payload)
    except (EOFError, OSError):
        pass
    return None


def describe_exit(code: int | None) -> str:
    if code is None:
        return "still running"
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    if code == EXIT_PEER_DIED:
        return "stopped because a peer stage died"
    return f"exit code {code}"


def signal_stop(stages: list[Stage]) -> None:
    """Send STOP_SIGNAL to every stage still running (they exit 0 on it)."""
    for s in stages:
        if s.process.is_alive() and s.process.pid is not None:
            try:
                os.kill(s.process.pid, STOP_SIGNAL)
            except ProcessLookupError:
                pass


def reap(stages: list[Stage], grace_s: float) -> None:
    """Wait up to ``grace_s`` (one deadline for all) for the stages to exit, SIGKILL those
    still running, and collect every exit (no zombie is left)."""
    # Process.join waits on the process's sentinel and reaps with waitpid: it is no
    # Thread.join, so a signal handler raising meanwhile cannot leave a live stage marked
    # ended (bpo-45274); that exception propagates instead.
    deadline = time.monotonic() + grace_s
    for s in stages:
        s.process.join(max(0.0, deadline - time.monotonic()))
    for s in stages:
        if s.process.is_alive():
            s.process.kill()
            s.process.join(2.0)


def stop_stages(stages: list[Stage], grace_s: float) -> None:
    """Stop ``stages``: STOP_SIGNAL, ``grace_s`` to exit, then SIGKILL."""
    signal_stop(stages)
    reap(stages, grace_s)


def free_tcp_port(host: str = "127.0.0.1") -> int:
    """A TCP port free now on ``host``: where the TP ranks of one host meet."""
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])
