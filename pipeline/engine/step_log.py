"""Engine stage: ``--step-log FILE``, one JSON line per step, to see where the time between
steps and before first tokens goes.

Each line (keys short, values in ms where timed):

- ``step``, ``t``: the step id and the wall clock (``time.time()``) when its result was applied;
- ``tokens``, ``prefill_tokens``, ``decode_reqs``, ``new_reqs``, ``preempted``: what it ran
  (a request with more than one token scheduled counts as prefill);
- ``running``, ``waiting``: the scheduler's queues after the update;
- ``sched_ms``: schedule() and the send to the workers; ``worker_ms``: the worker's execute()
  (forward + sampling); ``worker_wait_ms``: how long the worker waited for this step after
  sending its previous result (> 0: the worker idled, the engine was late);
  ``result_wait_ms``: how long the engine blocked for this result; ``update_ms``: applying it
  and emitting the outputs; ``outputs``: the EngineOutputs emitted.

Off by default: the file is opened once and line-buffered (a write per step, a few µs against
steps of milliseconds), so a stage stopped by a signal loses no line. Owns: the open file and
the schedule times of the steps in flight.
"""
from __future__ import annotations

import json
import time
from typing import IO

from pipeline.messages import ModelRunnerOutput, SchedulerOutput


class StepLog:
    def __init__(self, path: str) -> None:
        self.file: IO[str] = open(path, "a", buffering=1)
        self.sched_ms: dict[int, float] = {}

    def scheduled(self, sched: SchedulerOutput, t0: float) -> None:
        """After ``sched`` was scheduled (from ``t0``, perf_counter) and sent."""
        self.sched_ms[sched.step_id] = 1e3 * (time.perf_counter() - t0)

    def finished(self, sched: SchedulerOutput, result: ModelRunnerOutput, wait_s: float, update_s: float,
                 outputs: int, running: int, waiting: int) -> None:
        prefill = sched.num_prefill_tokens
        decode = sum(1 for n in sched.num_scheduled_tokens.values() if n == 1)
        rec = {"step": sched.step_id, "t": round(time.time(), 6), "tokens": sched.total_num_scheduled_tokens,
               "prefill_tokens": prefill, "decode_reqs": decode, "new_reqs": len(sched.new_reqs),
               "preempted": len(sched.preempted_req_ids), "running": running, "waiting": waiting,
               "sched_ms": round(self.sched_ms.pop(sched.step_id, 0.0), 3),
               "worker_ms": round(1e3 * result.execute_s, 3), "worker_wait_ms": round(1e3 * result.wait_s, 3),
               "result_wait_ms": round(1e3 * wait_s, 3), "update_ms": round(1e3 * update_s, 3),
               "outputs": outputs}
        self.file.write(json.dumps(rec, separators=(",", ":")) + "\n")

    def close(self) -> None:
        self.file.close()
