"""Engine scheduler with the deterministic FakeWorker: admission, chunking, caching, preemption.

The FakeWorker simulates the paged KV cache (check_kv=True), so a wrong prefix hit or a block
reused while owned fails inside the worker, and the block-table invariant is audited after
every step.
"""
from __future__ import annotations

import time

import pytest

from pipeline.config import EngineConfig
from pipeline.engine.fake_worker import FakeWorker
from pipeline.engine.request import RequestStatus
from pipeline.engine.scheduler import Scheduler
from pipeline.messages import EngineOutput, EngineRequest, ids_to_bytes
from pipeline.sampling_params import SamplingParams

EOS = 0


class Engine:
    """Scheduler + FakeWorker driven step by step, recording what a client would see."""

    def __init__(self, num_blocks=64, block_size=4, max_model_len=128, max_num_seqs=8,
                 budget=64, threshold=0, policy="newest", caching=True, vocab=48) -> None:
        cfg = EngineConfig.of(max_num_seqs=max_num_seqs, max_num_batched_tokens=budget,
                           long_prefill_token_threshold=threshold, preemption_policy=policy,
                           enable_prefix_caching=caching)
        self.sched = Scheduler(cfg, num_blocks, block_size, max_model_len, hash_key=b"test")
        self.worker = FakeWorker(num_blocks, block_size, max_model_len, vocab, [EOS],
                                 check_kv=True)
        self.tokens: dict[str, list[int]] = {}
        self.finish: dict[str, str] = {}
        self.last: dict[str, EngineOutput] = {}
        self.steps = 0

    def add(self, rid, prompt, priority=0, salt=None, **sp) -> None:
        sp.setdefault("max_tokens", 8)
        self.sched.add_request(EngineRequest(rid, ids_to_bytes(prompt), SamplingParams(**sp),
                                             time.time(), [EOS], priority, salt))
        self.tokens[rid] = []

    def record(self, outs: list[EngineOutput]) -> None:
        for o in outs:
            assert o.req_id not in self.finish, f"{o.req_id} got output after it finished"
            self.tokens[o.req_id] += o.new_token_ids
            self.last[o.req_id] = o
            if o.finish_reason is not None:
                self.finish[o.req_id] = o.finish_reason

    def check(self) -> None:
        assert self.sched.check_invariants() == []

    def step(self):
        so = self.sched.schedule()
        out = self.worker.execute(so)
        self.record(self.sched.update_from_output(so, out))
        self.steps += 1
        self.check()
        return so

    def run(self, max_steps=2000) -> None:
        while self.sched.has_unfinished_requests():
            self.step()
            assert self.steps < max_steps, "engine did not converge"


def reference(worker: FakeWorker, prompt, max_model_len=128, **sp_kw):
    """What an unconstrained run produces: the worker's token function plus the stop rules."""
    sp = SamplingParams(**{"max_tokens": 8, **sp_kw})
    toks, out = list(prompt), []
    while True:
        t = worker.next_token(toks)
        toks.append(t)
        out.append(t)
        n = len(out)
        if n >= sp.min_tokens and ((not sp.ignore_eos and t == EOS) or t in sp.stop_token_ids):
            return out, "stop"
        if n >= sp.max_tokens or len(toks) >= max_model_len:
            return out, "length"


def test_rejects_requests_that_can_never_fit():
    # The limits of max_model_len are the validator's (test_validate.py); the engine alone
    # knows whether a request could ever fit in its KV cache.
    e = Engine(num_blocks=4, block_size=4, max_model_len=32)
    with pytest.raises(ValueError, match=r"num_blocks=4"):
        e.add("b", list(range(1, 15)), max_tokens=8)  # 21 KV slots > 16
    e.add("d", [1, 2, 3])
    with pytest.raises(ValueError, match="already in the engine"):
        e.add("d", [1, 2, 3])
    e.add("e", list(range(1, 14)), max_tokens=4)  # exactly 16 KV slots: admitted
    e.run()
    assert set(e.finish) == {"d", "e"}


def test_outputs_match_reference_and_each_request_ends_once():
    e = Engine(num_blocks=64, budget=16)
    prompts = {f"r{i}": [1 + i, 2, 3, 4, 5 + i, 6, 7][: 3 + i % 5] for i in range(10)}
    kws = {rid: dict(max_tokens=5 + i, min_tokens=i % 3, ignore_eos=i % 4 == 0,
                     stop_token_ids=[7] if i % 2 else []) for i, rid in enumerate(prompts)}
    for rid, p in prompts.items():
        e.add(rid, p, **kws[rid])
    e.run()
    for rid, p in prompts.items():
        toks, reason = reference(e.worker, p, **kws[rid])
        assert e.tokens[rid] == toks and e.finish[rid] == reason
    assert e.sched.stats().generation_tokens == sum(map(len, e.tokens.values()))


def test_decodes_first_and_long_prefill_is_chunked():
    e = Engine(num_blocks=64, budget=16, threshold=0)
    e.add("short", [1, 2, 3], max_tokens=20, ignore_eos=True)
    e.step()
    e.add("long", list(range(1, 60)), max_tokens=2, ignore_eos=True)
    so = e.step()
    # The decode is scheduled first; the new prompt shares the step, so the default
    # threshold (16 // 4) caps its chunk.
    assert list(so.num_scheduled_tokens.items()) == [("short", 1), ("long", 4)]
    assert so.new_reqs[0].req_id == "long" and so.cached_reqs[0].req_id == "short"
    e.run()
    assert e.tokens["long"] == reference(e.worker, list(range(1, 60)), max_tokens=2,
                                         ignore_eos=True)[0]
    # Alone, a prompt gets the whole budget with the default threshold.
    e2 = Engine(num_blocks=64, budget=16)
    e2.add("alone", list(range(1, 40)))
    assert e2.step().num_scheduled_tokens == {"alone": 16}
    # An explicit threshold always caps.
    e3 = Engine(num_blocks=64, budget=16, threshold=5)
    e3.add("alone", list(range(1, 40)))
    assert e3.step().num_scheduled_tokens == {"alone": 5}


def test_max_num_seqs_and_fcfs_then_priority():
    e = Engine(max_num_seqs=2)
    for i in range(4):
        e.add(f"r{i}", [1, 2, 3 + i], max_tokens=3, ignore_eos=True)
    so = e.step()
    assert [n.req_id for n in so.new_reqs] == ["r0", "r1"]
    e.run()
    p = Engine(max_num_seqs=1)
    p.add("low", [1, 2], priority=5, ignore_eos=True, max_tokens=2)
    p.add("high", [1, 3], priority=-1, ignore_eos=True, max_tokens=2)
    assert [n.req_id for n in p.step().new_reqs] == ["high"]
    p.run()


def test_prefix_cache_hit_reported_and_whole_prompt_recomputes_last_token():
    e = Engine(num_blocks=32, block_size=4)
    shared = list(range(1, 13))  # three full blocks
    e.add("first", shared + [20, 21], max_tokens=2, ignore_eos=True)
    e.run()
    e.add("second", shared + [30], max_tokens=2, ignore_eos=True)
    so = e.step()
    assert so.new_reqs[0].num_computed_tokens == 12 and so.num_scheduled_tokens["second"] == 1
    e.add("same", shared, max_tokens=2, ignore_eos=True)
    so = e.step()
    # The whole prompt is cached, yet its last block is recomputed to get logits.
    assert so.new_reqs[0].num_computed_tokens == 8 and so.num_scheduled_tokens["same"] == 4
    e.run()
    assert e.last["second"].num_cached_tokens == 12 and e.last["first"].num_cached_tokens == 0
    assert e.tokens["second"] == reference(e.worker, shared + [30], max_tokens=2,
                                           ignore_eos=True)[0]
    assert 0 < e.sched.stats().prefix_cache_hit_rate < 1


def test_output_caching_second_turn_hits_past_the_prompt():
    e = Engine(num_blocks=64, block_size=4)
    prompt = [5, 6, 7, 8, 9, 10]
    e.add("turn1", prompt, max_tokens=11, ignore_eos=True)
    e.run()
    answer = e.tokens["turn1"]
    turn2 = prompt + answer + [11, 12]  # 19 tokens; 16 had KV computed in turn 1
    e.add("turn2", turn2, max_tokens=2, ignore_eos=True)
    so = e.step()
    assert so.new_reqs[0].num_computed_tokens == 16 > len(prompt)
    e.run()
    assert e.last["turn2"].num_cached_tokens == 16
    assert e.tokens["turn2"] == reference(e.worker, turn2, max_tokens=2, ignore_eos=True)[0]


def test_cache_salt_isolates_tenants():
    e = Engine(num_blocks=64, block_size=4)
    p = list(range(1, 18))
    e.add("a", p, salt="tenant-a", max_tokens=1)
    e.run()
    e.add("b", p, salt="tenant-b", max_tokens=1)
    e.add("nosalt", p, max_tokens=1)
    e.run()
    e.add("a2", p, salt="tenant-a", max_tokens=1)
    e.run()
    assert e.last["b"].num_cached_tokens == 0 and e.last["nosalt"].num_cached_tokens == 0
    assert e.last["a2"].num_cached_tokens == 16


def test_preemption_by_recompute_gives_identical_outputs():
    big = Engine(num_blocks=256, budget=32, max_num_seqs=16)
    small = Engine(num_blocks=14, budget=32, max_num_seqs=16)
    for e in (big, small):
        for i in range(12):
            e.add(f"r{i}", [i + 1, 2, 3, 4, 5], max_tokens=24, ignore_eos=True)
        e.run()
    assert small.sched.num_preemptions > 0 and big.sched.num_preemptions == 0
    assert small.sched.stats().num_preemptions == small.sched.num_preemptions
    assert small.tokens == big.tokens and small.finish == big.finish


def test_admission_order_keeps_growing_across_preemptions():
    """The "newest admitted" victim needs one admission order for the engine's life: a
    preemption resets the reserve, never the order (a reset made a re-admitted request look
    oldest and the same pair preempt each other forever)."""
    e = Engine(num_blocks=14, budget=32, max_num_seqs=16)
    for i in range(12):
        e.add(f"r{i}", [i + 1, 2, 3, 4, 5], max_tokens=24, ignore_eos=True)
    seen = 0
    while e.sched.has_unfinished_requests():
        e.step()
        running = e.sched.running
        assert [r.admit_seq for r in running] == sorted(r.admit_seq for r in running)
        assert e.sched.admission.seq >= seen
        seen = e.sched.admission.seq
        assert e.steps < 2000, "engine did not converge"
    assert e.sched.num_preemptions > 0 and seen > 12  # re-admissions counted on


def test_lowest_priority_policy_preempts_the_least_important():
    e = Engine(num_blocks=6, budget=32, policy="lowest_priority")
    e.add("vip", [1, 2, 3, 4], priority=0, max_tokens=12, ignore_eos=True)
    e.add("batch", [5, 6, 7, 8], priority=9, max_tokens=12, ignore_eos=True)
    e.add("mid", [9, 10, 11, 12], priority=3, max_tokens=12, ignore_eos=True)
    victims = []
    while e.sched.has_unfinished_requests():
        victims += e.step().preempted_req_ids
    assert victims and victims[0] == "batch"
    assert e.tokens["vip"] == reference(e.worker, [1, 2, 3, 4], max_tokens=12, ignore_eos=True)[0]


def test_abort_frees_blocks_in_any_state():
    e = Engine(num_blocks=8, max_num_seqs=1)
    e.add("run", [1, 2, 3, 4, 5], max_tokens=20, ignore_eos=True)
    e.add("wait", [1, 2, 3], max_tokens=5)
    e.step()
    assert e.sched.kv.pool.num_used_blocks == 2
    outs = e.sched.abort_requests(["run", "wait", "unknown"])
    assert [(o.req_id, o.finish_reason) for o in outs] == [("run", "abort"), ("wait", "abort")]
    assert e.sched.kv.pool.num_used_blocks == 0 and not e.sched.has_unfinished_requests()
    assert e.sched.abort_requests(["run"]) == []  # the final output went out once
    so = e.sched.schedule()
    assert so.finished_req_ids == ["run"]  # the worker held only "run"
    e.check()
    e.add("stopstr", [7, 8], max_tokens=9, ignore_eos=True)
    e.step()
    assert e.sched.abort_requests(["stopstr"], reason="stop")[0].finish_reason == "stop"


def test_seed001_preempted_in_flight_caches_nothing():
    """A request preempted between its step's sampling and output caching caches nothing.

    The engine schedules step N+1 before step N's result is back (a pipelined engine). "A" is
    in flight in a decode step that fills its block when "C" needs that block: A is preempted
    and C writes its own KV there. A's late result must neither cache A's hash on C's block
    nor emit A's token (it is recomputed on resume and emitted exactly once).
    """
    e = Engine(num_blocks=3, block_size=4, budget=16, threshold=4)
    s, w = e.sched, e.worker
    e.add("C", list(range(20, 32)), max_tokens=1)
    so1 = s.schedule(); r1 = w.execute(so1)
    e.add("A", [1, 2, 3], max_tokens=6, ignore_eos=True)
    so2 = s.schedule(); r2 = w.execute(so2)
    assert [n.req_id for n in so2.new_reqs] == ["A"]
    e.record(s.update_from_output(so1, r1))
    so3 = s.schedule(); r3 = w.execute(so3)
    e.record(s.update_from_output(so2, r2))
    so4 = s.schedule(); r4 = w.execute(so4)
    assert so4.num_scheduled_tokens == {"A": 1}  # A's decode fills its first block
    a = s.requests["A"]
    a_block, a_hash = a.blocks[0], a.block_hashes[0]
    e.record(s.update_from_output(so3, r3))
    so5 = s.schedule()
    assert so5.preempted_req_ids == ["A"] and a.status == RequestStatus.PREEMPTED
    r5 = w.execute(so5)  # C writes its KV into A's old block
    assert a_block in s.requests["C"].blocks
    outs = s.update_from_output(so4, r4)  # A's stale result arrives
    assert all(o.req_id != "A" for o in outs) and s.stats().stale_results_dropped == 1
    assert a_hash not in s.kv.pool.cached and a_block.block_hash != a_hash
    e.record(outs)
    e.record(s.update_from_output(so5, r5))
    e.check()
    e.run()
    assert e.tokens["A"] == reference(w, [1, 2, 3], max_tokens=6, ignore_eos=True)[0]
    assert e.finish == {"A": "length", "C": "length"}


def test_seed001_aborted_in_flight_caches_nothing():
    e = Engine(num_blocks=8, block_size=4)
    s, w = e.sched, e.worker
    e.add("A", [1, 2, 3], max_tokens=6, ignore_eos=True)
    e.step()
    so = s.schedule(); r = w.execute(so)  # this decode fills A's first block
    h = s.requests["A"].block_hashes[0]
    assert [o.finish_reason for o in s.abort_requests(["A"])] == ["abort"]
    assert s.update_from_output(so, r) == []
    assert h not in s.kv.pool.cached and s.kv.pool.num_used_blocks == 0
    e.check()


def test_invariant_audit_names_the_requests_involved(caplog):
    e = Engine(num_blocks=16)
    e.add("a", [1, 2, 3, 4, 5], max_tokens=4)
    e.add("b", [6, 7, 8], max_tokens=4)
    e.step()
    a, b = e.sched.requests["a"], e.sched.requests["b"]
    b.blocks.append(a.blocks[-1])  # an uncached block now owned twice
    errs = e.sched.check_invariants()
    assert any("owned by several requests: ['a', 'b']" in x for x in errs)
    assert "KV block table invariant violated" in caplog.text
    b.blocks.pop()
    a.blocks[0].ref_cnt += 1  # a leaked reference
    assert any("ref_cnt 2 but owners ['a']" in x for x in e.sched.check_invariants())
    a.blocks[0].ref_cnt -= 1
    assert e.sched.check_invariants() == []


def test_admission_reserve_resets_on_preemption_and_decays():
    e = Engine(num_blocks=10, budget=32)
    for i in range(6):
        e.add(f"r{i}", [i + 1, 2, 3], max_tokens=20, ignore_eos=True)
    reserves, preempted = [], []
    while e.sched.has_unfinished_requests():
        preempted.append(bool(e.step().preempted_req_ids))
        reserves.append(e.sched.stats().reserve_blocks_per_running)
    assert any(preempted)
    for was_preempted, before, after in zip(preempted[1:], reserves, reserves[1:]):
        assert after == 1.0 if was_preempted else after <= before


def test_preempted_request_resumes_before_later_arrivals():
    e = Engine(num_blocks=6, budget=32)
    e.add("A", [1, 2, 3, 4], max_tokens=12, ignore_eos=True)
    e.add("B", [5, 6, 7, 8], max_tokens=12, ignore_eos=True)
    while not e.step().preempted_req_ids:
        pass
    assert e.sched.requests["B"].status == RequestStatus.PREEMPTED  # the newest admitted
    e.add("C", [9, 10, 11], max_tokens=2, ignore_eos=True)
    admitted = []
    while e.sched.has_unfinished_requests():
        admitted += [n.req_id for n in e.step().new_reqs]
    assert admitted.index("B") < admitted.index("C")
    # On resume B prefilled prompt + generated tokens; none was emitted twice or skipped.
    assert e.tokens["B"] == reference(e.worker, [5, 6, 7, 8], max_tokens=12, ignore_eos=True)[0]


@pytest.mark.parametrize("reason, finish, error", [
    ("abort", "abort", "aborted by the client"),
    ("timeout", "abort", "aborted: timeout"),  # any other reason is an abort that names it
    ("stop", "stop", None),
    ("error", "error", None),
])
def test_abort_outputs_one_shape_whatever_the_reason(reason, finish, error):
    e = Engine()
    e.add("w", [1, 2, 3])
    e.add("r", [4, 5, 6])
    e.step()  # both running now
    e.add("q", [7, 8])  # waiting
    outs = e.sched.abort_requests(["w", "q", "ghost"], reason)
    assert [(o.req_id, o.finish_reason, o.error) for o in outs] == [("w", finish, error), ("q", finish, error)]
    e.run()
    assert list(e.finish) == ["r"] and e.sched.stats().kv_blocks_used == 0


def test_abort_message_names_who_aborted():
    e = Engine()
    e.add("a", [1, 2, 3])
    [o] = e.sched.abort_requests(["a"], "abort", "aborted: the server shut down")
    assert (o.finish_reason, o.error) == ("abort", "aborted: the server shut down")


def test_a_step_carries_no_more_new_requests_than_its_ring_can():
    """Requests that share a long cached prompt are admitted one token each: the step must
    still not carry more of their token ids (and params) than the step ring takes."""
    import msgspec

    from pipeline.engine.admission import NEW_REQUESTS_BYTES_PER_STEP
    prompt = [(i * 7) % 40 + 1 for i in range(300_000)]  # 1.2 MB as int32
    e = Engine(num_blocks=20_000, block_size=16, max_model_len=400_000, max_num_seqs=32, budget=16384)
    e.add("warm", prompt, max_tokens=1)
    e.run()
    for i in range(20):
        e.add(f"r{i}", prompt, max_tokens=1)
    admitted = []
    while e.sched.has_unfinished_requests():
        so = e.sched.schedule()
        size = len(msgspec.msgpack.encode(so))
        assert size <= 16 << 20  # the step ring's smallest largest message (runtime/rings.py, RINGS)
        assert size <= NEW_REQUESTS_BYTES_PER_STEP + 4096 or len(so.new_reqs) == 1
        admitted.append(len(so.new_reqs))
        e.record(e.sched.update_from_output(so, e.worker.execute(so)))
    assert sum(admitted) == 20 and max(admitted) < 20
