"""EngineCore schedules ahead (async scheduling) only behind short steps: behind a step with a
long prefill it waits for the result, so requests that arrive while that step runs join the
very next step (a burst of prompts fills two steps, not three), and behind decode steps it
still sends step N+1 before N's result (engine.inflight.EngineSteps.behind_long)."""
from __future__ import annotations

import time
from typing import Any

from pipeline.config import EngineConfig
from pipeline.engine.core import EngineCore, LocalExecutor
from pipeline.engine.fake_worker import FakeWorker
from pipeline.engine.scheduler import Scheduler
from pipeline.messages import EngineRequest, ModelRunnerOutput, SchedulerOutput, ids_to_bytes
from pipeline.sampling_params import SamplingParams

EOS, VOCAB, MAX_LEN, BLOCK = 0, 24, 64, 4


class Recording(LocalExecutor):
    """LocalExecutor that logs submits and results, and runs ``during`` while a step runs
    (requests arriving meanwhile)."""

    def __init__(self, worker: Any) -> None:
        super().__init__(worker)
        self.events: list[tuple[str, int]] = []
        self.steps: list[SchedulerOutput] = []
        self.during: list[Any] = []

    def submit(self, sched: SchedulerOutput) -> None:
        self.events.append(("submit", sched.step_id))
        self.steps.append(sched)
        super().submit(sched)

    def result(self) -> ModelRunnerOutput:
        self.events.append(("result", self.pending[0].step_id))
        while self.during:
            self.during.pop(0)()
        return super().result()


def _rig(budget: int = 64):
    cfg = EngineConfig.of(max_num_seqs=8, max_num_batched_tokens=budget, enable_prefix_caching=False)
    sched = Scheduler(cfg, 64, BLOCK, MAX_LEN, async_scheduling=True)
    ex = Recording(FakeWorker(64, BLOCK, MAX_LEN, VOCAB, [EOS], check_kv=True))
    outs: list = []
    return sched, ex, EngineCore(sched, ex, outs.extend)


def _add(sched: Scheduler, rid: str, n: int, max_tokens: int = 6) -> None:
    prompt = [1 + (i % (VOCAB - 1)) for i in range(n)]
    sched.add_request(EngineRequest(rid, ids_to_bytes(prompt), SamplingParams(max_tokens=max_tokens, ignore_eos=True),
                                    time.time(), [EOS]))


def test_requests_arriving_during_a_long_prefill_join_the_next_step():
    sched, ex, core = _rig()
    assert sched.long_prefill_token_threshold == 16  # a quarter of the budget
    _add(sched, "a", 40)  # alone: the whole prompt in one step, 40 > 16 tokens
    ex.during.append(lambda: _add(sched, "b", 12))  # arrives while step 1 runs
    core.step()  # sends step 1 and returns: the stage takes in what is queued meanwhile
    assert ex.events == [("submit", 1)]
    core.step()  # schedules nothing ahead of step 1: waits for it
    assert ex.events == [("submit", 1), ("result", 1)]
    core.step()
    assert ex.steps[1].num_scheduled_tokens == {"a": 1, "b": 12}  # b in the very next step
    while core.has_work():
        core.step()
    assert sched.stats().running == sched.stats().waiting == 0


def test_decode_steps_still_run_ahead():
    sched, ex, core = _rig()
    _add(sched, "a", 8, max_tokens=8)  # 8 <= 16: not a long prefill
    while core.has_work():
        core.step()
    # Some step was sent before the result of the one before it.
    sent_before = [i for i, (kind, sid) in enumerate(ex.events)
                   if kind == "submit" and ("result", sid - 1) in ex.events[i + 1:]]
    assert sent_before, ex.events
