"""The process entry of every stage, and how a stage reports back to the gateway.

Every stage (tokenizer, engine, worker per TP rank, token processor) runs in its own OS
process started by its owner (the gateway, a TP node, ``llm_tp``; ``runtime.lifecycle``) with
the multiprocessing 'spawn' context. The process gets a StageSpec (msgspec-encoded) and one end of a control pipe on
which it reports, exactly once, either ``("ready", info)`` or ``("error", message)``. The
gateway starts the stages before it has created the rings (``spec.await_start``): a stage
imports its code (the worker: torch and the model), then waits on the same pipe for
``("start", model)``, sent once the rings exist; ``model`` is the worker's ModelInfo for the
stages of NEEDS_MODEL (sent when rank 0 reports ready), None for the others. After that the
pipe is silent: all traffic goes through the shared-memory rings named in the spec.
A stage dies with the process that started it (PR_SET_PDEATHSIG); ``die_with_parent_env``
gives a `pipeline` command the same (SIGTERM) when asked to by PIPELINE_DIE_WITH.
Owns no state beyond the process-wide signal set-up of the stage it runs.
"""
from __future__ import annotations

import gc
import importlib
import multiprocessing
import os
import signal
import sys
import traceback
from collections.abc import Callable
from multiprocessing.connection import Connection

import msgspec

from pipeline.ipc.errors import PeerDied
from pipeline.ipc.prctl import PR_SET_PDEATHSIG, name_process, prctl
from pipeline.runtime.spec import ModelInfo, StageSpec

# A stage that stops because a peer died exits with this code, so the gateway can name
# the stage that died first instead of the ones that followed it.
EXIT_PEER_DIED = 3
EXIT_ERROR = 1

# stage kind -> module whose ``run(spec, ready)`` is the stage loop
STAGE_MODULES = {
    "tokenizer": "pipeline.tokenizer.stage",
    "engine": "pipeline.engine.stage",
    "worker": "pipeline.worker.stage",
    "output": "pipeline.output.stage",
    "messager": "pipeline.cache.stage",
}

# The worker computes on every core. The stages around it do little per step and, with
# async scheduling, have a whole step of slack, so they run as SCHED_BATCH: same fair share
# (no starvation on a busy machine), but a stage woken by a ring does not preempt a running
# worker thread; it runs in the worker's gaps or at the end of its slice. Without it a woken
# engine took 1.5-7 ms from the worker's main thread on 15 % of the steps of a 256-request
# run on 2 cores (docs/benchmarks.md, "offline: the stages around the worker as SCHED_BATCH").
# The cache messager keeps SCHED_OTHER: its layer-wise transfer must overlap the prefill.
BATCH_STAGES = frozenset({"tokenizer", "engine", "output"})

# Stages built from the worker's ModelInfo (KV blocks, max_model_len, vocabulary, ...).
NEEDS_MODEL = frozenset({"engine", "tokenizer", "messager"})

ReadyFn = Callable[[dict], None]


# `pipeline` commands started with PIPELINE_DIE_WITH=<pid of their parent> get SIGTERM when
# that parent dies (``die_with_parent_env``). The test suite sets it, so a daemon, router or
# pipe-mode run a test started drains and unlinks its shared memory when pytest is killed.
DIE_WITH_ENV = "PIPELINE_DIE_WITH"


def die_with_parent(signum: int, parent: int) -> None:
    """Have the kernel send ``signum`` to this process when ``parent`` (its parent's pid)
    dies (Linux prctl PR_SET_PDEATHSIG); at once if it is already gone. The kernel means the
    parent *thread* that started this process: start such children from a thread that lives
    as long as the parent (its main thread)."""
    if not prctl(PR_SET_PDEATHSIG, signum):
        return
    if os.getppid() != parent:  # it died before the prctl: no signal will come for it
        os.kill(os.getpid(), signum)


def die_with_parent_env() -> None:
    """Honour ``PIPELINE_DIE_WITH=<pid>`` (SIGTERM when that parent dies), and take it out of
    the environment: the processes this one starts die with it their own way."""
    value = os.environ.pop(DIE_WITH_ENV, None)
    if not value:
        return
    try:
        pid = int(value)
    except ValueError:
        raise SystemExit(f"{DIE_WITH_ENV}: must be a process id, got {value!r}") from None
    if os.getppid() == pid:
        die_with_parent(signal.SIGTERM, pid)
        return
    try:
        os.kill(pid, 0)
    except ProcessLookupError:  # it died before we looked (we were its child or grandchild)
        os.kill(os.getpid(), signal.SIGTERM)
    except PermissionError:
        pass
    # Alive and not our parent: a process it started started us; that one decides.


def _die_with_parent() -> None:
    # The gateway is the only supervisor: a stage must not outlive it (e.g. gateway
    # SIGKILLed by the OOM killer), or it would hold the KV memory forever.
    parent = multiprocessing.parent_process()
    die_with_parent(signal.SIGKILL, parent.pid if parent is not None and parent.pid else os.getppid())


def _yield_to_the_worker(kind: str) -> None:
    if kind in BATCH_STAGES and hasattr(os, "sched_setscheduler"):
        try:  # a policy of lower priority needs no privilege
            os.sched_setscheduler(0, os.SCHED_BATCH, os.sched_param(0))
        except OSError:
            pass


# The gateway stops a stage with this signal. SIGTERM and SIGINT are ignored: `kill -TERM
# -PGID`, `timeout`, Ctrl-C and systemd's control-group kill reach every process of the
# group at once, and a stage that exited on them would turn a graceful drain into a "stage
# died" failure. Only the gateway decides when its stages stop.
STOP_SIGNAL = signal.SIGUSR1


def _on_stop(signum, frame) -> None:
    raise SystemExit(0)


def stage_process(spec_bytes: bytes, ctrl: Connection) -> None:
    """Process entry of every stage (target of the spawn context's Process)."""
    _die_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(STOP_SIGNAL, _on_stop)
    spec = msgspec.msgpack.decode(spec_bytes, type=StageSpec)
    name_process(spec.name)
    _yield_to_the_worker(spec.kind)
    def ready(info: dict) -> None:
        # What start-up made (modules, the model, tables) lives as long as the stage: out of
        # the collector's sight, so a full collection under load does not walk it again
        # (one took 74 ms in the middle of a 256-request step). freeze() only moves lists.
        gc.freeze()
        ctrl.send(("ready", info))

    code = 0
    try:
        try:
            module = importlib.import_module(STAGE_MODULES[spec.kind])
            if spec.await_start:
                spec = _await_start(spec, ctrl)
            module.run(spec, ready)
        except PeerDied as exc:
            print(f"[{spec.name}] stopping: {exc}", file=sys.stderr, flush=True)
            code = EXIT_PEER_DIED
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 0
    except BaseException as exc:  # noqa: BLE001 - reported to the gateway, then exit non-zero
        msg = f"{type(exc).__name__}: {exc}"
        try:  # before ready: why start-up failed; after: why the stage died
            ctrl.send(("error", msg))
        except OSError:
            pass
        if not isinstance(exc, (ValueError, OSError)):  # those already say what is wrong
            traceback.print_exc()
        # One write with its newline: print() writes the end apart, and the gateway's own
        # line could land between them (seen in CI: two messages on one line).
        sys.stderr.write(f"[{spec.name}] failed: {msg}\n")
        sys.stderr.flush()
        code = EXIT_ERROR
    finally:
        try:
            ctrl.close()
        except OSError:
            pass
    sys.stderr.flush()
    sys.stdout.flush()
    os._exit(code)


def _await_start(spec: StageSpec, ctrl: Connection) -> StageSpec:
    """``spec`` once the gateway says start (it stops us instead if start-up fails), with
    the worker's ModelInfo for a stage of NEEDS_MODEL."""
    try:
        kind, model = ctrl.recv()
    except EOFError:
        raise PeerDied("the gateway closed the control pipe before it said start") from None
    if kind != "start":
        raise ValueError(f"control pipe: expected ('start', model info), got {kind!r}")
    if model is not None:
        return msgspec.structs.replace(spec, model=msgspec.convert(model, ModelInfo))
    if spec.kind in NEEDS_MODEL and spec.model is None:
        raise ValueError(f"stage {spec.kind} needs the worker's model info to start")
    return spec


def log(spec: StageSpec, msg: str) -> None:
    # One write with its newline: the stages share stderr, and unbuffered (python -u,
    # PYTHONUNBUFFERED) print() writes the text and the newline apart, so lines interleave.
    sys.stderr.write(f"[{spec.name}] {msg}\n")
    sys.stderr.flush()
