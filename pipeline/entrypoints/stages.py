"""Gateway <-> stage process plumbing: what a stage is told at start and how it reports back.

Every stage (tokenizer, engine, worker per TP rank, token processor) runs in its own OS
process started by the gateway with the multiprocessing 'spawn' context. The process gets
a StageSpec (msgspec-encoded) and one end of a control pipe on which it reports, exactly
once, either ``("ready", info)`` or ``("error", message)``. After that the pipe is silent:
all traffic goes through the shared-memory rings named in the spec. The gateway side
(spawn_stage, wait_ready) is here too. This module owns no state beyond the process-wide
signal set-up of the stage it starts.
"""
from __future__ import annotations

import ctypes
import importlib
import os
import signal
import sys
import time
import traceback
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from multiprocessing.connection import wait as wait_objects
from multiprocessing.process import BaseProcess
from typing import Callable

import msgspec

from pipeline.config import EngineConfig

# A stage that stops because a peer died exits with this code, so the gateway can name
# the stage that died first instead of the ones that followed it.
EXIT_PEER_DIED = 3
EXIT_ERROR = 1

# stage kind -> module whose ``run(spec, ready)`` is the stage loop
STAGE_MODULES = {
    "tokenizer": "pipeline.entrypoints.tokenizer_stage",
    "engine": "pipeline.engine.stage",
    "worker": "pipeline.worker.stage",
    "output": "pipeline.output.stage",
}


class ModelInfo(msgspec.Struct, kw_only=True):
    """What the worker learnt at load time and the other stages need to be built."""
    num_blocks: int
    block_size: int
    max_model_len: int
    vocab_size: int
    eos_token_ids: list[int]
    kv_cache_bytes: int = 0


class StageSpec(msgspec.Struct, kw_only=True):
    name: str  # e.g. "worker0"; used in every error message about the stage
    kind: str  # key of STAGE_MODULES
    config: EngineConfig
    rings: dict[str, str]  # role -> shared-memory name, see gateway.RING_ROLES
    rank: int = 0
    model: ModelInfo | None = None  # given to every stage started after the worker
    ring_timeout_s: float = 1.0  # how often a blocked stage re-checks its peers


ReadyFn = Callable[[dict], None]

_encoder = msgspec.msgpack.Encoder()


def pack(tag: bytes, obj: msgspec.Struct) -> bytes:
    """One tag byte + msgpack: rings that carry several untagged message types use this."""
    return tag + _encoder.encode(obj)


class Unpacker:
    """Decodes ``pack`` output back into the struct type its tag names."""

    def __init__(self, types: dict[bytes, type]) -> None:
        self.decoders = {t[0]: msgspec.msgpack.Decoder(cls) for t, cls in types.items()}

    def __call__(self, buf) -> msgspec.Struct:
        mv = memoryview(buf)
        dec = self.decoders.get(mv[0])
        if dec is None:
            raise ValueError(f"unknown message tag {mv[0]!r}")
        return dec.decode(mv[1:])


def _die_with_parent() -> None:
    # The gateway is the only supervisor: a stage must not outlive it (e.g. gateway
    # SIGKILLed by the OOM killer), or it would hold the KV memory forever.
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass
    if os.getppid() == 1:
        os._exit(EXIT_ERROR)


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
    def ready(info: dict) -> None:
        ctrl.send(("ready", info))

    code = 0
    try:
        from pipeline.ipc.errors import PeerDied  # noqa: PLC0415
        try:
            importlib.import_module(STAGE_MODULES[spec.kind]).run(spec, ready)
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
        print(f"[{spec.name}] failed: {msg}", file=sys.stderr, flush=True)
        code = EXIT_ERROR
    finally:
        try:
            ctrl.close()
        except OSError:
            pass
    sys.stderr.flush()
    sys.stdout.flush()
    os._exit(code)


def log(spec: StageSpec, msg: str) -> None:
    print(f"[{spec.name}] {msg}", file=sys.stderr, flush=True)


# ---- gateway side: starting and watching stage processes ----
class StartupError(RuntimeError):
    """A stage could not start (bad model path, bad config, too little memory...)."""


@dataclass(slots=True)
class Stage:
    spec: StageSpec
    process: BaseProcess
    ctrl: Connection
    info: dict = field(default_factory=dict)


def spawn_stage(ctx, spec: StageSpec) -> Stage:
    """Start one stage process (``ctx``: the 'spawn' multiprocessing context)."""
    parent, child = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=stage_process, name=f"pipeline-{spec.name}",
                       args=(msgspec.msgpack.encode(spec), child), daemon=False)
    proc.start()
    child.close()
    return Stage(spec, proc, parent)


def wait_ready(stages: list[Stage], timeout_s: float) -> dict:
    """Wait for each stage's ready report (merged infos), or raise StartupError naming it."""
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
            stage = pending.get(obj) or by_sentinel.get(obj)
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
