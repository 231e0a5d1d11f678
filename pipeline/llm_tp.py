"""``pipeline.LLM(..., tensor_parallel_size=N)``: the in-process engine's worker over N ranks.

Rank 0 is a ModelRunner in this process, as without tensor parallelism; ranks 1..N-1 are
worker stage processes (``worker.stage``, started and stopped as the gateway does it:
``runtime.lifecycle``), which take
each step from a broadcast ring this object writes before rank 0 runs it. Rank 0's reader
slot of the ring is drained here (the stage reads its slot by rank), so the ring has one
layout for every caller. Same interface as ModelRunner (``num_blocks``, ``execute``,
``close``...), so LLM and its Scheduler see one worker.

A script that builds the LLM at import time (no ``if __name__ == "__main__":``) is re-run by
each rank process (the spawn start method imports the main module): that child fails at once
naming the guard (``refuse_spawn_reimport``), and rank 0, waiting for the ranks to join,
watches their processes (``_watch``), so the parent fails at once too, naming the dead rank.

Owns: the ranks' processes, the ring and the instance that names them (the KV segments of
every rank carry its id; a killed LLM's are swept at the next start: their owner is dead).
"""
from __future__ import annotations

import multiprocessing as mp
from multiprocessing.connection import wait as wait_sentinels
from typing import Any

from pipeline.config import EngineConfig
from pipeline.ipc.broadcast import BroadcastRing
from pipeline.ipc.instance import Instance, unlink_instance
from pipeline.messages import ModelRunnerOutput, SchedulerOutput
from pipeline.runtime.lifecycle import (
    Stage,
    describe_exit,
    free_tcp_port,
    last_words,
    reap,
    signal_stop,
    spawn_stage,
    wait_ready,
)
from pipeline.runtime.ring_sizes import capacity
from pipeline.runtime.rings import STEPS_ROLE, Channel, message_limits
from pipeline.runtime.spec import StageSpec
from pipeline.worker.model_runner import ModelRunner
from pipeline.worker.rank_model import TP_TIMEOUT_S

GUARD_HINT = ("pipeline.LLM(tensor_parallel_size=N) starts N - 1 rank processes, and each "
              "imports your main script again (multiprocessing's 'spawn'): create the LLM under "
              "`if __name__ == \"__main__\":`")


def refuse_spawn_reimport() -> None:
    """RuntimeError when this process is a spawned child still importing the parent's main
    module (multiprocessing sets ``_inheriting`` for exactly that phase)."""
    if getattr(mp.current_process(), "_inheriting", False):
        raise RuntimeError(f"this is a rank process importing your main script: {GUARD_HINT}")


class LocalTPWorkers:
    def __init__(self, config: EngineConfig) -> None:
        refuse_spawn_reimport()
        if config.parallel_config.nnodes != 1:
            raise ValueError("pipeline.LLM runs every rank on this host: --nnodes must be 1 "
                             "(serve node 0 with `pipeline serve` to span hosts)")
        self.config = config = config.replace(master_port=config.parallel_config.master_port
                                                       or free_tcp_port())
        self.instance = Instance(config.instance_id)
        self.ranks: list[Stage] = []
        self.runner: ModelRunner | None = None
        try:
            limit = message_limits(config, config.model_config.max_model_len or 1 << 20)[STEPS_ROLE]
            ring = BroadcastRing.create(self.instance, STEPS_ROLE, capacity(limit),
                                        config.parallel_config.tensor_parallel_size, claim=True)
            self.steps = Channel(ring, STEPS_ROLE)
            self._mine = BroadcastRing.attach(ring.name, 0)
            ctx = mp.get_context("spawn")
            self.ranks = [spawn_stage(ctx, StageSpec(name=f"worker{r}", kind="worker", config=config,
                                                     rings={STEPS_ROLE: ring.name}, rank=r))
                          for r in range(1, config.parallel_config.tensor_parallel_size)]
            self.runner = ModelRunner(config, 0)
            self.runner.watch_peers = self._watch
            self.runner.load()  # joins the group with the ranks as they load
            wait_ready(self.ranks, TP_TIMEOUT_S)
        except BaseException:
            self.close()
            raise

    def _watch(self, timeout_s: float) -> None:
        """While rank 0 waits for the others to join: fail as soon as one is dead."""
        wait_sentinels([s.process.sentinel for s in self.ranks], timeout_s)
        for s in self.ranks:
            if not s.process.is_alive():
                why = last_words(s)
                raise RuntimeError(
                    f"tensor parallel: {s.spec.name} exited while the ranks were joining "
                    f"({describe_exit(s.process.exitcode)})"
                    + (f": {why}" if why else f": it died before it ran (its error is above "
                                               f"on stderr); if that is the spawn re-import, "
                                               f"{GUARD_HINT}"))

    def __getattr__(self, name: str) -> Any:  # num_blocks, block_size, vocab_size, ...
        runner = self.__dict__.get("runner")
        if runner is None:
            raise AttributeError(name)
        return getattr(runner, name)

    def execute(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        assert self.runner is not None, "closed"
        for s in self.ranks:
            if not s.process.is_alive():
                why = last_words(s)
                raise RuntimeError(f"tensor parallel: {s.spec.name} died: "
                                   f"{describe_exit(s.process.exitcode)}" + (f" ({why})" if why else ""))
        self.steps.send(sched)
        self._mine.try_recv()  # rank 0 is this process: its copy is the object itself
        return self.runner.execute(sched)

    def close(self) -> None:
        # The ranks stop while rank 0 leaves the process group, not one after the other.
        signal_stop(self.ranks)
        if self.runner is not None:
            self.runner.close()
            self.runner = None
        reap(self.ranks, 5.0)
        self.ranks = []
        for ring in (getattr(self, "_mine", None), getattr(self, "steps", None)):
            if ring is not None:
                ring.close()
        self.instance.cleanup()
        unlink_instance(self.instance.id)
