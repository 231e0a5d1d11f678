"""Bench: a ModelRunner driven by hand-built step diffs, no engine: admission with every block
reserved, one token per decode step, finishing. The worker-level figures of `bench worker`
and `bench tp` come from these steps alone. Owns the request ids and block ids it handed out.
"""
from __future__ import annotations

from pipeline.messages import CachedRequestData, NewRequestData, SchedulerOutput, ids_to_bytes
from pipeline.sampling_params import SamplingParams


class Steps:
    """Hand-built step diffs: all blocks reserved at admission, one token per decode step."""

    def __init__(self, runner) -> None:
        self.runner = runner
        self.step_id = 0
        self.next_block = 0

    def _run(self, new, cached, sched, finished=()):
        self.step_id += 1
        return self.runner.execute(SchedulerOutput(
            self.step_id, new, cached, sched, sum(sched.values()), list(finished), []))

    def admit(self, prompts: list[list[int]], extra_tokens: int, tag: str):
        bs = self.runner.block_size
        new, sched = [], {}
        for i, p in enumerate(prompts):
            nb = -(-(len(p) + extra_tokens) // bs)
            blocks = list(range(self.next_block, self.next_block + nb))
            self.next_block += nb
            rid = f"{tag}{i}"
            new.append(NewRequestData(rid, ids_to_bytes(p), len(p),
                                      SamplingParams(temperature=0.0, max_tokens=extra_tokens + 1),
                                      blocks, 0))
            sched[rid] = len(p)
        return self._run(new, [], sched), list(sched)

    def decode(self, req_ids: list[str], computed: int) -> None:
        cached = [CachedRequestData(r, [], computed) for r in req_ids]
        self._run([], cached, {r: 1 for r in req_ids})

    def finish(self, req_ids: list[str]) -> None:
        self._run([], [], {}, req_ids)
        self.next_block = 0

