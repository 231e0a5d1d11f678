"""Gateway: `pipeline serve --node-rank R` (R > 0), a host that lends its worker ranks to the
instance node 0 serves (tensor parallelism across hosts, docs/tensor_parallel.md).

It runs no gateway, rings or other stages: it starts this host's ``tensor_parallel_size /
nnodes`` worker ranks (global ranks ``R * n .. R * n + n - 1``), which join node 0's
torch.distributed group and take each step's plan from node 0's worker rank 0
(``worker.remote_plan``), and watches them. Exit codes: 0 when node 0 shut down cleanly (its
ranks stop) or on SIGTERM/SIGINT, 1 when a rank died or node 0 went away, 2 when a rank could
not start (mismatched flags, a group that did not form in time: the rank's error is printed).
Owns: the rank processes and the instance whose name their KV segments carry.
"""
from __future__ import annotations

import multiprocessing as mp
import signal
import sys
import threading
from multiprocessing.connection import wait as wait_sentinels

from pipeline.config import EngineConfig
from pipeline.ipc.instance import Instance, unlink_instance
from pipeline.ipc.prctl import name_process
from pipeline.ipc.sweep import sweep_stale
from pipeline.runtime.lifecycle import StartupError, describe_exit, last_words, spawn_stage, stop_stages, wait_ready
from pipeline.runtime.spec import StageSpec
from pipeline.worker.rank_model import TP_TIMEOUT_S


def log(msg: str) -> None:
    sys.stderr.write(f"[node] {msg}\n")
    sys.stderr.flush()


def run(config: EngineConfig) -> int:
    name_process("node")  # beside its pl-worker<rank> children
    sweep_stale()
    instance = Instance(config.instance_id)
    n = config.parallel_config.ranks_per_node
    first = config.parallel_config.node_rank * n
    ctx = mp.get_context("spawn")
    ranks = [spawn_stage(ctx, StageSpec(name=f"worker{r}", kind="worker", config=config, rings={},
                                        rank=r)) for r in range(first, first + n)]
    stop = threading.Event()
    old = {sig: signal.signal(sig, lambda *_: stop.set()) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        par = config.parallel_config
        log(f"node {par.node_rank} of {par.nnodes}: ranks {first}..{first + n - 1} joining "
            f"{par.master_addr}:{par.master_port}")
        try:
            wait_ready(ranks, TP_TIMEOUT_S + 600.0)
        except StartupError as exc:
            log(f"cannot start: {exc}")
            return 2
        log(f"ready: ranks {first}..{first + n - 1} serve node 0's steps")
        pending = {s.process.sentinel: s for s in ranks}
        while pending and not stop.is_set():
            for sentinel in wait_sentinels(list(pending), timeout=0.5):
                dead = pending.pop(sentinel)  # type: ignore[arg-type]
                dead.process.join()
                if dead.process.exitcode != 0:
                    why = last_words(dead)
                    log(f"rank {dead.spec.rank} died: {describe_exit(dead.process.exitcode)}"
                        + (f" ({why})" if why else ""))
                    return 1
        if stop.is_set():
            log("stopping on a signal")
        else:
            log("node 0 shut down; every rank stopped")
        return 0
    finally:
        for sig, handler in old.items():
            signal.signal(sig, handler)
        stop_stages(ranks, 5.0)
        instance.cleanup()
        unlink_instance(instance.id)
