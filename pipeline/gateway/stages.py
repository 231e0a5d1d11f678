"""Gateway: the instance it runs, brought up and torn down (the base of ``Gateway``).

Start-up: the checkpoint is checked, stale shared memory of dead instances is swept, every
stage process is spawned at once (the workers first), the rings are created while they import
their code, and each stage is told to start as soon as it has what it needs
(``runtime.process``: the rings; for NEEDS_MODEL, worker rank 0's ModelInfo). Tear-down:
the stages are stopped (``runtime.lifecycle``), the rings unmapped, and everything of the
instance in /dev/shm unlinked, segments a killed stage left included.

Owns: the instance (its name prefix), every ring and the layer signal (it creates and unlinks
them), the Stage records, and the worker's ModelInfo once rank 0 reported it.
"""
from __future__ import annotations

import multiprocessing as mp
import os
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgspec

from pipeline.config import EngineConfig
from pipeline.ipc.broadcast import BroadcastRing
from pipeline.ipc.instance import Instance, owner_alive, unlink_instance
from pipeline.ipc.layer_signal import LayerSignal
from pipeline.ipc.ring import Doorbell, Ring
from pipeline.ipc.sweep import sweep_stale
from pipeline.models.config import load_model_config
from pipeline.runtime.lifecycle import Stage, free_tcp_port, send_start, spawn_stage, stop_stages, wait_ready
from pipeline.runtime.process import NEEDS_MODEL
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
from pipeline.worker.tp_rendezvous import probe_master_ports

if TYPE_CHECKING:
    import psutil

KV_SOCKET_DIR = "/dev/shm"
STOP_GRACE_S = 3.0  # a stopped stage exits at once; one that does not in this time is killed


def sweep_kv_sockets(run_dir: Path) -> None:
    """Remove the ipc sockets decode instances left behind when killed (`<id>`: a dead
    instance, by the owner record ``ipc.sweep`` judges /dev/shm entries by)."""
    for path in run_dir.glob("pipeline-*.kv"):
        iid = path.name[len("pipeline-"):-len(".kv")]
        if owner_alive(iid) is not True and path.is_socket() and path.stat().st_uid == os.geteuid():
            path.unlink(missing_ok=True)


class GatewayStages:
    def __init__(self, config: EngineConfig, log: Callable[[str], None]) -> None:
        self.config = config
        self.log = log
        self.stages: list[Stage] = []
        self.model: ModelInfo | None = None
        self.instance: Instance | None = None
        self.rings: dict[str, Channel] = {}
        self._ps: dict[int, psutil.Process] = {}  # cpu_percent needs the same handle
        self._names: dict[str, str] = {}  # ring role -> shared-memory name, told to every stage

    def _start_stages(self, timeout_s: float) -> ModelInfo:
        """Bring the instance up; on any failure it is torn down (``close``) and re-raised."""
        # A bad path or an unsupported checkpoint fails here, before any process starts.
        mc = load_model_config(self.config.model_config.model)
        # The worker's max_model_len is at most this (it refuses more than the checkpoint's).
        limits = message_limits(self.config, self.config.model_config.max_model_len or mc.max_position_embeddings,
                                mc.hidden_size)
        removed = sweep_stale()
        if removed:
            self.log(f"removed {len(removed)} stale shared-memory entries of dead instances")
        self.instance = Instance(self.config.instance_id)
        if self.config.kv_transfer_config.role == "decode" and not self.config.kv_transfer_config.kv_listen:
            # Same host only: where prefill instances' cache messagers reach ours. Without
            # XDG_RUNTIME_DIR (a system unit) beside the KV segments in /dev/shm, which every
            # instance that can take our KV shares: not /tmp, private to a unit (PrivateTmp=).
            # The socket's mode follows the umask (a peer needs write permission to connect).
            run_dir = Path(os.environ.get("XDG_RUNTIME_DIR") or KV_SOCKET_DIR)
            sweep_kv_sockets(run_dir)
            self.config = self.config.replace(
                kv_listen=f"ipc://{run_dir}/pipeline-{self.config.instance_id}.kv")
        try:
            # Every stage at once, the workers first, before the rings exist: each imports its
            # code (the workers: torch and the model) while the rings are made and the others
            # come up, then waits for ("start", model) (runtime.process): once the rings exist,
            # and for those built from the worker's ModelInfo (NEEDS_MODEL) once rank 0 sent it.
            self._names = self._ring_names()
            pd = self.config.kv_transfer_config.role != "mixed"
            tier = bool(self.config.cache_config.kv_offload_dir)
            kinds = ["engine", "tokenizer", "output"] + (["messager"] if pd or tier else [])
            if self.config.parallel_config.tensor_parallel_size > 1 and not self.config.parallel_config.master_port:
                # One host: the ranks meet on loopback at a port free now.
                self.config = self.config.replace(master_port=free_tcp_port())
            probe_master_ports(self.config.parallel_config)  # a port in use: named now, not in 120 s
            for r in range(self.config.parallel_config.ranks_per_node):  # node 0's ranks; other nodes run theirs
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
        return self.model

    def _ring_names(self) -> dict[str, str]:
        """role -> shared-memory name of every ring (and the layer signal) of this instance."""
        assert self.instance is not None
        return {r: self.instance.name(r) for r in ring_names(self.config.kv_transfer_config.role,
                                                             bool(self.config.cache_config.kv_offload_dir))}

    def _create_rings(self, limits: dict[str, int], num_layers: int) -> None:
        assert self.instance is not None
        bells = {c: Doorbell.create(self.instance, f"bell.{c}") for c in SHARED_DOORBELLS}
        self.doorbells = list(bells.values())
        for role, (producer, consumer) in ring_roles(self.config.kv_transfer_config.role,
                                                     bool(self.config.cache_config.kv_offload_dir)).items():
            mine = "gateway" in (producer, consumer)
            self.rings[role] = Channel(Ring.create(
                self.instance, role, capacity(limits[role]), doorbell=bells.get(consumer),
                role="writer" if producer == "gateway" else "reader", claim=mine), role)
        self.steps = BroadcastRing.create(self.instance, STEPS_ROLE, capacity(limits[STEPS_ROLE]),
                                          self.config.parallel_config.ranks_per_node)
        made = {r: ch.ring.name for r, ch in self.rings.items()} | {STEPS_ROLE: self.steps.name}
        if LAYERS_ROLE in self._names:
            # Worker rank 0 publishes each layer's "KV written" on it; the cache messager
            # blocks on it (the gateway owns it so it is unlinked with the instance).
            # Every rank's layers when the ranks share one KV segment (worker/kv_cache.py).
            self.layer_signal = LayerSignal.create(self.instance, LAYERS_ROLE,
                                                   num_layers * self.config.parallel_config.tensor_parallel_size)
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
        stop_stages(self.stages, STOP_GRACE_S)
        self._release(unmap=True)

    def _release(self, unmap: bool) -> None:
        """After the stages stopped: unmap the rings (``unmap``: only when no thread of the
        owner can still touch one) and unlink everything of the instance."""
        # Unlinking below is what frees the memory; a mapping dies with the process anyway.
        if unmap:
            for ring in [*(ch.ring for ch in self.rings.values()), getattr(self, "steps", None),
                         getattr(self, "layer_signal", None), *getattr(self, "doorbells", [])]:
                if ring is not None:
                    ring.close()
        if self.config.kv_transfer_config.kv_listen.startswith("ipc://"):  # a killed messager leaves its socket
            Path(self.config.kv_transfer_config.kv_listen[len("ipc://"):]).unlink(missing_ok=True)
        if self.instance is not None:
            self.instance.cleanup()
            # Segments a stage created itself (the worker's KV cache) and could not unlink
            # because it was killed belong to this instance too.
            unlink_instance(self.instance.id)
            self.instance = None
