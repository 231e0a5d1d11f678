"""The engine stage's loop in the mixed role (async scheduling), in process over real rings: the
EngineLoop of test_engine_disagg's StageRig, a FakeWorker thread as worker rank 0, this test as
the tokenizer and the token processor.

Each loop iteration leaves one step in flight (the worker runs it while the engine takes the
previous result), never more than two; the outputs are the synchronous reference, a token
computed ahead of an EOS is dropped, a client abort while steps are out ends the request with
nothing after it, and the step counters count the steps that ran tokens.
"""
from __future__ import annotations

import pytest
from test_engine_disagg import EOS, TIMEOUT, StageRig, all_free, reference, request

from pipeline.engine.inflight import MAX_STEPS_IN_FLIGHT
from pipeline.messages import AbortRequest, EngineOutput


@pytest.fixture
def rig(inst):
    r = StageRig(inst, "mixed", TIMEOUT)
    yield r
    r.close()


def run_until(rig, done, max_iters: int = 500) -> tuple[list[EngineOutput], int]:
    """Loop iterations until ``done(outputs so far)``; the most steps left in flight by one."""
    outs: list[EngineOutput] = []
    most = 0
    for _ in range(max_iters):
        rig.loop.run_once()
        assert len(rig.loop.inflight) <= MAX_STEPS_IN_FLIGHT
        most = max(most, len(rig.loop.inflight))
        outs += rig.outputs()
        if done(outs):
            return outs, most
    raise AssertionError("the engine loop did not finish")


def tokens(outs: list[EngineOutput], rid: str) -> list[int]:
    return [t for o in outs if o.req_id == rid for t in o.new_token_ids]


def test_stage_runs_steps_ahead_with_the_reference_outputs(rig):
    loop = rig.loop
    assert loop.async_scheduling and loop.sched.async_scheduling
    ran: list[int] = []  # tokens of each step the worker ran
    execute = rig.worker.execute

    def counting(so):
        ran.append(so.total_num_scheduled_tokens)
        return execute(so)

    rig.worker.execute = counting  # the worker thread looks it up per step
    prompts = {f"r{i}": [3 + i, 5, 7, 9, 11 + i][: 2 + i % 4] for i in range(4)}
    for rid, p in prompts.items():
        rig.send("requests", request(rid, p, max_tokens=12, ignore_eos=True))
    # One whose greedy output hits EOS: the step run ahead of its result is dropped.
    eos_prompt = next(p for p in ([k, k + 1] for k in range(1, 200))
                      if len(r := reference(rig.worker, p, 12)) >= 2 and r[-1] == EOS)
    rig.send("requests", request("eos", eos_prompt, max_tokens=12))
    want = {rid: reference(rig.worker, p, 12, ignore_eos=True) for rid, p in prompts.items()}
    want["eos"] = reference(rig.worker, eos_prompt, 12)
    outs, most = run_until(rig, lambda o: sum(x.finish_reason is not None for x in o) == 5)
    assert most == 1  # a step was left in flight across iterations
    for rid, w in want.items():
        assert tokens(outs, rid) == w, rid
    assert [o.finish_reason for o in outs if o.req_id == "eos"][-1] == "stop"
    sched = loop.sched
    while loop.inflight:  # the last step out: stale results only
        loop.run_once()
    assert rig.outputs() == [] and sched.stats().stale_results_dropped >= 1
    assert sched.stats().generation_tokens == sum(map(len, want.values()))
    loop.run_once()  # idle: audits
    assert loop.invariants_checked and all_free(sched) and sched.check_invariants() == []
    t = loop.times
    assert t.steps == sum(n > 0 for n in ran) and len(ran) == rig.worker.num_steps
    assert t.step_s > 0 and t.worker_s == 0.0  # the FakeWorker reports no execute time


def test_stage_abort_with_steps_in_flight_ends_it_with_nothing_after(rig):
    rig.send("requests", request("a", [4, 5, 6], max_tokens=40, ignore_eos=True))
    outs, _ = run_until(rig, lambda o: len(tokens(o, "a")) >= 3)
    assert len(rig.loop.inflight) == 1  # a step of "a" is out
    rig.send("requests", AbortRequest(["a"]))
    more, _ = run_until(rig, lambda o: any(x.finish_reason for x in o))
    outs += more
    assert outs[-1].finish_reason == "abort" and outs[-1].new_token_ids == []
    n = len(tokens(outs, "a"))
    while rig.loop.inflight:
        rig.loop.run_once()
    assert rig.outputs() == [] and len(tokens(outs, "a")) == n
    assert tokens(outs, "a") == reference(rig.worker, [4, 5, 6], 40, ignore_eos=True)[:n]
    rig.loop.run_once()
    assert all_free(rig.loop.sched) and rig.loop.sched.check_invariants() == []


def test_stage_takes_a_burst_a_slice_per_iteration_and_answers_every_request(rig):
    from pipeline.engine.stage import MAX_REQUESTS_PER_ITERATION as cap
    n = cap + cap // 2 + 3
    for i in range(n):
        rig.send("requests", request(f"b{i}", [3 + i % 50, 7], max_tokens=2, ignore_eos=True))
    loop = rig.loop
    loop.run_once()
    # One slice taken, and a step already out for the worker, with the rest still queued.
    assert len(loop.sched.requests) == cap and len(loop.inflight) == 1
    outs, _ = run_until(rig, lambda o: sum(x.finish_reason is not None for x in o) == n, 2000)
    finals = [o.req_id for o in outs if o.finish_reason is not None]
    assert sorted(finals) == sorted(f"b{i}" for i in range(n))  # exactly one each
    assert all(o.finish_reason == "length" for o in outs if o.finish_reason is not None)
    while loop.inflight:
        loop.run_once()
    loop.run_once()
    assert all_free(loop.sched) and loop.sched.check_invariants() == []
