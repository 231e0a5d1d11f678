"""Hypothesis-driven engine workloads under a tiny KV pool (FakeWorker, no model).

Random arrivals, aborts (client and stop-string), stop tokens, EOS, min_tokens, priorities,
tenants and shared prefixes, with the engine synchronous, pipelined (step N+1 is scheduled
before step N's result is back, so in-flight requests get preempted and aborted, seed 001)
or async (pipelined, and requests in flight are scheduled ahead on the tokens their steps in
flight sample: tokens computed ahead of an end are dropped). Properties: every request ends
exactly once, its tokens are exactly what an unconstrained run produces (a prefix of it when
aborted), the block-table invariant holds after every step, and the engine never hangs.
"""
from __future__ import annotations

import time

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pipeline.config import EngineConfig
from pipeline.engine.fake_worker import FakeWorker
from pipeline.engine.scheduler import Scheduler
from pipeline.messages import EngineRequest, ids_to_bytes
from pipeline.sampling_params import SamplingParams

EOS = 0
MAX_MODEL_LEN = 48
PREFIXES = ([], [1, 2, 3, 4, 5, 6, 7, 8], [1, 2, 3, 4, 9, 9])


@st.composite
def request_specs(draw):
    prompt = draw(st.sampled_from(PREFIXES)) + draw(st.lists(st.integers(1, 31), max_size=12))
    max_tokens = draw(st.integers(1, 20))
    return {
        "prompt": prompt or [1],
        "sp": SamplingParams(max_tokens=max_tokens, min_tokens=draw(st.integers(0, max_tokens)),
                             ignore_eos=draw(st.booleans()),
                             stop_token_ids=draw(st.lists(st.integers(1, 31), max_size=2))),
        "arrive": draw(st.integers(0, 12)),
        "abort": draw(st.none() | st.tuples(st.integers(0, 40), st.sampled_from(["abort", "stop"]))),
        "priority": draw(st.integers(0, 2)),
        "salt": draw(st.sampled_from([None, None, "tenant"])),
    }


def expected(worker: FakeWorker, prompt: list[int], sp: SamplingParams,
             max_len: int = MAX_MODEL_LEN) -> tuple[list[int], str]:
    """What a request must get: the fake worker's tokens until a stop or the length limit."""
    toks, out = list(prompt), []
    while True:
        t = worker.next_token(toks)
        toks.append(t)
        out.append(t)
        if len(out) >= sp.min_tokens and ((not sp.ignore_eos and t == EOS) or t in sp.stop_token_ids):
            return out, "stop"
        if len(out) >= sp.max_tokens or len(toks) >= max_len:
            return out, "length"


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(specs=st.lists(request_specs(), min_size=1, max_size=10),
       num_blocks=st.integers(6, 20), block_size=st.sampled_from([2, 4]),
       max_num_seqs=st.integers(1, 6), budget=st.integers(3, 24),
       threshold=st.sampled_from([0, 3, 8]), policy=st.sampled_from(["newest", "lowest_priority"]),
       caching=st.booleans(), mode=st.sampled_from(["sync", "pipelined", "async"]))
def test_random_workload(specs, num_blocks, block_size, max_num_seqs, budget, threshold, policy,
                         caching, mode):
    pipelined = mode != "sync"
    cfg = EngineConfig.of(max_num_seqs=max_num_seqs, max_num_batched_tokens=budget,
                       long_prefill_token_threshold=threshold, preemption_policy=policy,
                       enable_prefix_caching=caching)
    sched = Scheduler(cfg, num_blocks, block_size, MAX_MODEL_LEN, hash_key=b"h",
                      async_scheduling=mode == "async")
    worker = FakeWorker(num_blocks, block_size, MAX_MODEL_LEN, 32, [EOS], check_kv=True)
    tokens: dict[str, list[int]] = {}
    finish: dict[str, str] = {}
    accepted: dict[str, dict] = {}

    def record(outs) -> None:
        for o in outs:
            assert o.req_id not in finish, f"{o.req_id}: output after its end"
            tokens[o.req_id] += o.new_token_ids
            if o.finish_reason is not None:
                finish[o.req_id] = o.finish_reason

    in_flight = None
    step = 0
    while True:
        for i, spec in enumerate(specs):
            if spec["arrive"] == step:
                rid = f"r{i}"
                need = -(-(len(spec["prompt"]) + spec["sp"].max_tokens - 1) // block_size)
                req = EngineRequest(rid, ids_to_bytes(spec["prompt"]), spec["sp"], time.time(),
                                    [EOS], spec["priority"], spec["salt"])
                if need > num_blocks:
                    try:
                        sched.add_request(req)
                    except ValueError as exc:
                        assert "num_blocks" in str(exc)
                    else:
                        raise AssertionError("a request larger than the pool was accepted")
                    continue
                sched.add_request(req)
                tokens[rid] = []
                accepted[rid] = spec
            if spec["abort"] is not None and spec["abort"][0] == step:
                record(sched.abort_requests([f"r{i}"], spec["abort"][1]))
        if step > 12 and not sched.has_unfinished_requests():
            if in_flight is not None:  # every result still out is stale by now
                record(sched.update_from_output(*in_flight))
                assert sched.check_invariants() == []
            break
        so = sched.schedule()
        out = worker.execute(so)
        if pipelined:
            if in_flight is not None:
                record(sched.update_from_output(*in_flight))
            in_flight = (so, out)
        else:
            record(sched.update_from_output(so, out))
        assert sched.check_invariants() == []
        step += 1
        assert step < 3000, "engine hung"

    assert set(finish) == set(accepted), "every accepted request ends exactly once"
    for rid, spec in accepted.items():
        want, reason = expected(worker, spec["prompt"], spec["sp"])
        if finish[rid] == reason and tokens[rid] == want:
            continue
        # Otherwise it was aborted (client or stop string) before its natural end.
        assert spec["abort"] is not None and finish[rid] == spec["abort"][1], rid
        assert tokens[rid] == want[:len(tokens[rid])], rid
    stats = sched.stats()
    assert stats.running == stats.waiting == stats.kv_blocks_used == 0
