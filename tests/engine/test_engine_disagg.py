"""Engine side of prefill/decode disaggregation, in process (no stage processes, no rings).

A decode Scheduler and a prefill Scheduler, each with a FakeWorker that simulates its paged
KV cache (``check_kv=True``: before sampling, every slot of the sequence must hold the
fingerprint of its own prefix). A stand-in for the two cache messagers copies the prefill
worker's KV slots into the decode worker's along each TransferPlan's (local, remote) pairs
when it processes the plan, which may be long after the step (so a block recycled before its
report, a pair pointing at the wrong block, a skipped block the decode side lacked or a
partial block not sent again would all fail inside the decode worker), and turns KVFinish
into KVReady. It writes every pair, also after the decode side aborted or timed the
reservation out (as a real prefill still sending does), and asserts that the block written is
still the reservation's or in its quarantine, never one handed to another request. The
"router" glue turns a KVReservation into the prefill request.
"""
from __future__ import annotations

import time
from collections import deque

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline.config import EngineConfig
from pipeline.engine.fake_worker import FakeWorker
from pipeline.engine.request import RequestStatus
from pipeline.engine.scheduler import Scheduler
from pipeline.messages import EngineOutput, EngineRequest, ids_to_bytes
from pipeline.messages.kv import (
    FALLBACK_ERROR,
    KVFinish,
    KVReady,
    KVTransferParams,
    TransferPlan,
    TransferReport,
    bytes_to_pairs,
)
from pipeline.sampling_params import SamplingParams

EOS = 0
VOCAB = 48
MAX_LEN = 128
LISTEN = "tcp://127.0.0.1:5999"
TIMEOUT = 5.0


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def make(role, num_blocks=48, bs=4, budget=64, seqs=8, caching=True, threshold=0, fallback="none",
         proven=True):
    cfg = EngineConfig.of(role=role, kv_listen=LISTEN if role == "decode" else "", pd_fallback=fallback,
                       kv_transfer_timeout=TIMEOUT, max_num_seqs=seqs,
                       max_num_batched_tokens=budget, long_prefill_token_threshold=threshold,
                       enable_prefix_caching=caching)
    clock = Clock()
    sched = Scheduler(cfg, num_blocks, bs, MAX_LEN, hash_key=role.encode(), clock=clock)
    if role == "prefill" and proven:  # a transfer to LISTEN was reported ok before
        sched.connector.proven[LISTEN] = None
    return sched, FakeWorker(num_blocks, bs, MAX_LEN, VOCAB, [EOS], check_kv=True), clock


def request(rid, prompt, kv=None, **sp) -> EngineRequest:
    sp.setdefault("max_tokens", 6)
    return EngineRequest(rid, ids_to_bytes(prompt), SamplingParams(**sp), time.time(), [EOS],
                         kv_transfer=kv)


def decode_req(rid, prompt, **sp) -> EngineRequest:
    return request(rid, prompt, KVTransferParams(role="decode"), **sp)


def prefill_req(rid, prompt, remote_blocks, cached=0, remote_id=None) -> EngineRequest:
    kv = KVTransferParams(role="prefill", peer=LISTEN, remote_req_id=remote_id or rid,
                          remote_block_ids=list(remote_blocks), remote_num_cached_tokens=cached)
    return request(rid, prompt, kv, max_tokens=1)


def reference(worker: FakeWorker, prompt, max_tokens=6, ignore_eos=False) -> list[int]:
    toks, out = list(prompt), []
    while len(out) < max_tokens and len(toks) < MAX_LEN:
        t = worker.next_token(toks)
        toks.append(t)
        out.append(t)
        if t == EOS and not ignore_eos:
            break
    return out


def fingerprints(prompt) -> list[int]:
    from pipeline.engine.fake_worker import _mix
    h, fps = 0, []
    for t in prompt:
        h = _mix(h, t)
        fps.append(h)
    return fps


def write_kv(worker: FakeWorker, prompt, block_ids, start_block=0) -> None:
    """What a prefill instance's transfer leaves in the decode worker's cache."""
    bs, fps = worker.block_size, fingerprints(prompt)
    for p in range(start_block * bs, len(prompt)):
        worker.kv[block_ids[p // bs] * bs + p % bs] = fps[p]  # type: ignore[index]


def step(sched: Scheduler, worker: FakeWorker):
    so = sched.schedule()
    conn = sched.connector  # None: a mixed instance
    outs = conn.take_outputs() if conn else []
    plan = conn.take_plan() if conn else None
    outs += sched.update_from_output(so, worker.execute(so))
    assert sched.check_invariants() == []
    return so, plan, outs


def run_plain(sched, worker, rid, prompt, **sp) -> None:
    sched.add_request(request(rid, prompt, **sp))
    while sched.has_unfinished_requests():
        step(sched, worker)


def all_free(sched: Scheduler) -> bool:
    return sched.kv.pool.num_free_blocks == sched.kv.pool.num_blocks


# -- decode role -----------------------------------------------------------------------------
def test_reservation_with_prefix_hit_then_kv_ready_decodes_with_its_blocks():
    d, dw, _ = make("decode")
    base = [5, 6, 7, 8, 9, 10, 11, 12, 13]
    run_plain(d, dw, "warm", base, max_tokens=1)  # caches blocks 0-1 of the prompt below
    cached = {b.block_id for b in d.kv.pool.cached.values()}
    prompt = base[:8] + [20, 21, 22, 23, 24, 25]  # 14 tokens: 4 blocks, 2 of them hits
    d.add_request(decode_req("r", prompt, max_tokens=4, ignore_eos=True))
    assert not d.has_unfinished_requests()  # a reservation is no work for a step
    assert d.stats().waiting == 1
    outs = d.connector.poll()
    assert len(outs) == 1
    o = outs[0]
    kv = o.kv
    assert kv is not None and o.req_id == "r" and o.new_token_ids == [] and o.finish_reason is None
    assert kv.engine_req_id == "r" and kv.endpoint == LISTEN and kv.timeout_s == TIMEOUT
    assert kv.num_cached_tokens == 8 == o.num_cached_tokens and o.num_prompt_tokens == 14
    assert len(kv.block_ids) == 4 and set(kv.block_ids[:2]) <= cached
    req = d.requests["r"]
    assert [b.block_id for b in req.blocks] == kv.block_ids  # 14 + 1 tokens fit in 4 blocks
    s = d.stats()
    assert (s.kv_reserved_requests, s.kv_reserved_blocks, s.waiting) == (1, 4, 0)
    assert d.check_invariants() == []
    assert d.connector.poll() == []  # reserved once

    write_kv(dw, prompt, kv.block_ids, start_block=2)  # the prefill instance's transfer
    ref = reference(dw, prompt, 4, ignore_eos=True)
    outs = d.connector.on_kv_ready(KVReady("r", ref[0]))
    assert [(o.req_id, o.new_token_ids, o.finish_reason) for o in outs] == [("r", [ref[0]], None)]
    assert d.has_unfinished_requests() and d.stats().kv_reserved_requests == 0
    assert d.check_invariants() == []
    so, _, outs = step(d, dw)
    assert len(so.new_reqs) == 1
    nr = so.new_reqs[0]
    assert nr.block_ids == kv.block_ids and nr.num_computed_tokens == 14
    assert so.num_scheduled_tokens == {"r": 1}
    toks = [ref[0]] + [t for o in outs for t in o.new_token_ids]
    while d.has_unfinished_requests():
        toks += [t for o in step(d, dw)[2] for t in o.new_token_ids]
    assert toks == ref
    # The received prompt went into the decode side's prefix cache.
    d.add_request(request("again", prompt, max_tokens=1))
    so, _, _ = step(d, dw)
    assert so.new_reqs[0].num_computed_tokens == 12
    assert all_free(d) and d.check_invariants() == []


def test_prompt_filling_its_blocks_reserves_the_first_decode_slot():
    d, dw, _ = make("decode")
    prompt = list(range(1, 9))  # 8 tokens: 2 full blocks; the first decode token needs a third
    d.add_request(decode_req("r", prompt, max_tokens=3, ignore_eos=True))
    kv = d.connector.poll()[0].kv
    assert kv is not None and len(kv.block_ids) == 2 and len(d.requests["r"].blocks) == 3
    write_kv(dw, prompt, kv.block_ids)
    d.connector.on_kv_ready(KVReady("r", 7))
    free = d.kv.pool.num_free_blocks
    so, _, _ = step(d, dw)
    assert so.new_reqs[0].block_ids == [b.block_id for b in d.requests["r"].blocks]
    assert d.kv.pool.num_free_blocks == free  # no block taken at admission
    # max_tokens=1: the prefill's token ends it, no extra slot.
    d.add_request(decode_req("one", prompt, max_tokens=1))
    out = d.connector.poll()[0]
    assert out.kv is not None and len(d.requests["one"].blocks) == 2
    write_kv(dw, prompt, out.kv.block_ids)
    (fin,) = d.connector.on_kv_ready(KVReady("one", 9))
    assert fin.new_token_ids == [9] and fin.finish_reason == "length"
    assert "one" not in d.requests


def test_kv_ready_error_and_unknown_ids():
    d, _, _ = make("decode")
    d.add_request(decode_req("r", list(range(1, 11))))
    d.connector.poll()
    assert d.connector.on_kv_ready(KVReady("nobody", 3)) == []
    (o,) = d.connector.on_kv_ready(KVReady("r", error="decode instance unreachable"))
    assert o.finish_reason == "error" and o.error_code == "kv_transfer_failed"
    assert "decode instance unreachable" in (o.error or "")
    assert d.connector.on_kv_ready(KVReady("r", 3)) == []  # finished: ignored
    assert d.connector.num_kv_ready_ignored == 2 and d.stats().kv_transfers_failed == 1
    assert all_free(d) and not d.requests and d.check_invariants() == []


def quarantined(sched: Scheduler) -> set[int]:
    return {b.block_id for blocks, _ in sched.connector.reservations.quarantine.values() for b in blocks}


def test_reservations_time_out_queued_or_reserved_and_quarantine_until_their_deadline():
    d, _, clock = make("decode", num_blocks=6)
    d.add_request(decode_req("a", list(range(1, 17))))  # 4 prompt blocks + the decode slot, of 6
    clock.t += 1.0
    d.add_request(decode_req("b", list(range(1, 13))))  # 4 blocks: must queue behind a
    outs = d.connector.poll()
    assert [o.req_id for o in outs] == ["a"] and outs[0].kv is not None
    a_blocks = outs[0].kv.block_ids
    assert d.connector.next_deadline() == pytest.approx(1000.0 + TIMEOUT)
    assert d.stats().waiting == 1 and d.stats().kv_reserved_requests == 1
    clock.t = 1000.0 + TIMEOUT - 0.01
    assert d.connector.poll() == []
    clock.t = 1000.0 + TIMEOUT
    (o,) = d.connector.poll()  # a is answered at once...
    assert o.req_id == "a" and o.finish_reason == "error" and o.error_code == "kv_transfer_timeout"
    assert "--kv-transfer-timeout 5 s" in (o.error or "") and "did not arrive" in (o.error or "")
    # ...but a prefill instance may still be writing its prompt blocks: b cannot have them.
    assert quarantined(d) == set(a_blocks) and d.kv.pool.num_free_blocks == 2
    s = d.stats()
    assert (s.kv_reserved_requests, s.kv_reserved_blocks, s.kv_blocks_used, s.waiting) == (0, 4, 4, 1)
    assert d.connector.next_deadline() == pytest.approx(1001.0 + TIMEOUT)  # b's, before the quarantine's
    assert d.check_invariants() == []
    with pytest.raises(ValueError, match="still in the engine"):
        d.add_request(decode_req("a", [1, 2, 3]))  # its late KVReady must not free a new "a"
    assert d.connector.on_kv_ready(KVReady("a", 3)) == []  # the prefill side is done: a's blocks are free
    assert d.connector.num_kv_ready_ignored == 0 and not d.connector.reservations.quarantine
    (rb,) = d.connector.poll()
    assert rb.req_id == "b" and rb.kv is not None and rb.kv.timeout_s == pytest.approx(1.0)
    assert set(rb.kv.block_ids) <= set(a_blocks) | {b.block_id for b in d.kv.pool.blocks}
    # queued past its deadline: never got blocks, nothing to quarantine
    d.add_request(decode_req("c", list(range(1, 13))))
    clock.t += TIMEOUT + 1
    outs = d.connector.poll()
    assert {o.req_id: o.error_code for o in outs} == {"b": "kv_transfer_timeout",
                                                      "c": "kv_transfer_timeout"}
    assert "no KV blocks could be reserved" in (next(o for o in outs if o.req_id == "c").error or "")
    assert quarantined(d) == set(rb.kv.block_ids) and not d.requests
    assert d.stats().kv_reservation_timeouts == 3 and d.stats().kv_reserved_blocks == 3
    # No KVReady for b: its blocks come back at the quarantine's deadline.
    assert d.connector.next_deadline() == pytest.approx(clock.t + TIMEOUT)
    clock.t += TIMEOUT - 0.01
    assert d.connector.poll() == [] and quarantined(d) == set(rb.kv.block_ids)
    clock.t += 0.01
    assert d.connector.poll() == [] and not d.connector.reservations.quarantine
    assert d.connector.reservations.num_quarantine_expired == 1 and d.connector.next_deadline() is None
    assert d.stats().kv_reserved_blocks == 0
    assert all_free(d) and d.check_invariants() == []
    assert d.connector.on_kv_ready(KVReady("b", 3)) == [] and d.connector.num_kv_ready_ignored == 1  # too late: ignored


def test_abort_of_a_reservation_answers_at_once_and_quarantines_its_writable_blocks():
    d, dw, _ = make("decode", num_blocks=10)
    base = [5, 6, 7, 8, 9, 10, 11, 12, 13]
    run_plain(d, dw, "warm", base, max_tokens=1)  # caches blocks 0-1 of the prompt below
    prompt = base[:8] + [20, 21, 22, 23]  # 12 tokens: 3 blocks, 2 of them hits, + the decode slot
    d.add_request(decode_req("a", prompt))
    d.add_request(decode_req("b", list(range(30, 60))))  # 8 blocks: queued
    (ra,) = d.connector.poll()
    kv = ra.kv
    assert kv is not None and kv.num_cached_tokens == 8 and len(d.requests["a"].blocks) == 4
    assert d.requests["a"].status == RequestStatus.WAITING_FOR_KV
    outs = d.abort_requests(["a", "b"])
    assert [(o.req_id, o.finish_reason) for o in outs] == [("a", "abort"), ("b", "abort")]
    assert not d.connector.reservations and not d.requests
    # The peer skips the 2 hit blocks and never writes the decode slot: only block 2 is held.
    assert quarantined(d) == {kv.block_ids[2]}
    assert d.kv.pool.num_free_blocks == 9 and d.stats().kv_reserved_blocks == 1
    assert all(d.kv.pool.blocks[b].block_hash is not None for b in kv.block_ids[:2])  # still cached
    assert d.connector.next_deadline() == pytest.approx(1000.0 + TIMEOUT)
    assert d.check_invariants() == []
    # The peer's "done" (here the error of the prefill request aborted with it) frees it.
    assert d.connector.on_kv_ready(KVReady("a", error="aborted by the client")) == []
    assert all_free(d) and d.check_invariants() == [] and d.connector.next_deadline() is None
    assert d.connector.on_kv_ready(KVReady("a", 1)) == [] and d.connector.num_kv_ready_ignored == 1
    assert d.stats().kv_transfers_failed == 0  # a's failure was its abort, not the transfer
    d.add_request(decode_req("a", prompt))  # the id is free again


def test_quarantined_blocks_are_never_handed_out():
    d, dw, _ = make("decode", num_blocks=12)
    d.add_request(decode_req("a", list(range(1, 17))))  # 4 prompt blocks + the decode slot
    (ra,) = d.connector.poll()
    assert ra.kv is not None
    q = set(ra.kv.block_ids)
    d.abort_requests(["a"])
    assert quarantined(d) == q and d.kv.pool.num_free_blocks == 8
    # Fill the 8 free blocks with two reservations; a third and a plain request must wait.
    for rid, first in (("y1", 20), ("y2", 40), ("y3", 60)):
        d.add_request(decode_req(rid, list(range(first, first + 16)), max_tokens=1))
    got = d.connector.poll()
    assert [o.req_id for o in got] == ["y1", "y2"]
    held = {b.block_id for rid in ("y1", "y2") for b in d.requests[rid].blocks}
    assert len(held) == 8 and not held & q and d.kv.pool.num_free_blocks == 0
    s = d.stats()
    assert (s.kv_blocks_free, s.kv_blocks_used, s.kv_reserved_blocks) == (0, 12, 12)
    d.add_request(request("x", [1, 2, 3], max_tokens=1))
    so, _, _ = step(d, dw)
    assert so.new_reqs == [] and d.connector.poll() == []  # nothing to hand out: q is not free
    assert d.check_invariants() == []
    d.connector.on_kv_ready(KVReady("a", 5))
    (o,) = d.connector.poll()  # y3 gets exactly the released blocks
    assert o.req_id == "y3" and o.kv is not None and set(o.kv.block_ids) == q
    assert not quarantined(d) and d.check_invariants() == []


def test_audit_accepts_the_quarantine_but_catches_a_leak():
    d, _, _ = make("decode", num_blocks=8)
    d.add_request(decode_req("a", list(range(1, 10))))
    d.connector.poll()
    d.abort_requests(["a"])
    assert quarantined(d) and d.check_invariants() == []
    d.connector.reservations.quarantine.clear()  # forgotten without being freed: a leak
    errs = d.check_invariants()
    assert any("leaked" in e for e in errs) and any("quarantined blocks counted" in e for e in errs)


def test_reservations_leave_the_running_requests_their_reserve():
    d, dw, _ = make("decode", num_blocks=16, budget=64)
    for rid in ("run1", "run2"):
        d.add_request(request(rid, list(range(1, 14)), max_tokens=2, ignore_eos=True))
    step(d, dw)  # 4 blocks each; the reserve for 2 running requests: 1 block
    d.add_request(decode_req("r", list(range(40, 71))))  # 31 + 1 tokens: all 8 free blocks
    assert d.connector.poll() == [] and d.stats().waiting == 1
    step(d, dw)
    assert d.stats().waiting == 1  # schedule() tried too
    assert not d.has_unfinished_requests()
    assert d.connector.poll()[0].kv is not None  # nothing running: no reserve


# -- prefill role ----------------------------------------------------------------------------
def plan_pairs(plan: TransferPlan | None, rid: str) -> list[tuple[int, int]]:
    if plan is None:
        return []
    return [tuple(p) for s in plan.sends if s.req_id == rid for p in bytes_to_pairs(s.pairs).tolist()]


def test_prefill_plans_follow_chunks_and_skip_remote_hits():
    p, pw, _ = make("prefill", budget=6, threshold=6)
    prompt = list(range(1, 23))  # 22 tokens: 6 blocks
    remote = [100 + i for i in range(6)]
    p.add_request(prefill_req("r", prompt, remote, cached=4))
    plans = []
    while p.has_unfinished_requests():
        plans.append(step(p, pw)[1])
    # chunks end at 6, 12, 18, 22: blocks touched 0-1, 1-2, 3-4, 4-5; block 0 is the remote hit
    sent = [[r - 100 for _, r in plan_pairs(pl, "r")] for pl in plans]
    assert sent == [[1], [1, 2], [3, 4], [4, 5]]
    assert all(s.peer == LISTEN and s.remote_req_id == "r" for pl in plans if pl for s in pl.sends)
    assert not p.requests  # max_tokens=1: done, but its blocks are leased
    assert p.stats().kv_transfer_leased_blocks == 5 and not all_free(p)
    fin = p.connector.take_kv_finishes()
    assert fin == [KVFinish("r", LISTEN, "r", reference(pw, prompt, 1)[0])]
    for pl in plans:
        assert p.connector.on_transfer_report(TransferReport(pl.step_id, {})) == []
        assert p.check_invariants() == []
    assert all_free(p) and p.stats().kv_transfer_leased_blocks == 0


def test_prefill_sends_its_own_prefix_hits_and_leases_hold_blocks_until_the_report():
    p, pw, _ = make("prefill", num_blocks=8)
    shared = list(range(1, 13))
    run_plain(p, pw, "warm", shared + [50], max_tokens=1)  # caches 3 blocks
    prompt = shared + [60, 61]
    p.add_request(prefill_req("r", prompt, [10, 11, 12, 13]))
    so, plan, outs = step(p, pw)
    assert so.new_reqs[0].num_computed_tokens == 12  # own prefix hit
    pairs = plan_pairs(plan, "r")
    assert [r for _, r in pairs] == [10, 11, 12, 13]  # the hits are sent: the decode side lacks them
    assert outs[0].finish_reason == "length" and "r" not in p.requests
    leased = {loc for loc, _ in pairs}
    free = {b.block_id for b in p.kv.pool.free_queue}
    assert not leased & free  # finished, but not recyclable before the report
    # Fill the pool: nothing leased is handed out.
    p.add_request(request("other", list(range(70, 86)), max_tokens=1))
    so, _, _ = step(p, pw)
    assert not leased & set(so.new_reqs[0].block_ids)
    assert plan is not None
    p.connector.on_transfer_report(TransferReport(plan.step_id, {}))
    assert all_free(p) and p.check_invariants() == []
    # The prompt's full blocks stay in the prefill side's prefix cache after the lease.
    assert len(p.kv.pool.cached) >= 3


def test_failed_report_fails_a_live_request_once():
    p, pw, _ = make("prefill", budget=8, threshold=8)
    prompt = list(range(1, 31))  # 4 chunks
    p.add_request(prefill_req("r", prompt, list(range(8))))
    _, plan1, _ = step(p, pw)
    _, plan2, _ = step(p, pw)
    assert plan1 is not None and plan2 is not None
    (o,) = p.connector.on_transfer_report(TransferReport(plan1.step_id, {"r": "peer reset"}))
    assert o.finish_reason == "error" and o.error_code == "kv_transfer_failed"
    assert "peer reset" in (o.error or "")
    (f,) = p.connector.take_kv_finishes()
    assert f.req_id == "r" and f.token == -1 and "peer reset" in f.error
    assert p.connector.on_transfer_report(TransferReport(plan2.step_id, {"r": "peer reset"})) == []
    assert p.connector.take_kv_finishes() == []
    assert p.stats().kv_transfers_failed == 2
    step(p, pw)  # the worker drops it
    assert all_free(p) and p.check_invariants() == []


def test_failed_report_after_the_first_token_ends_nothing_more_on_the_prefill_side():
    """The other order of test_failed_report_fails_a_live_request_once (no fallback): the
    first token is out before the failed report. The request ended with it (its KVFinish
    carries the token: the decode side learns of the failed write from its own messager);
    the late report only releases the lease and counts the failure."""
    p, pw, _ = make("prefill", budget=8, threshold=8)
    prompt = list(range(1, 31))  # 4 chunks
    p.add_request(prefill_req("r", prompt, list(range(8))))
    plans, outs = [], []
    while p.has_unfinished_requests():
        _, plan, o = step(p, pw)
        plans.append(plan)
        outs += o
    (o,) = outs
    assert len(o.new_token_ids) == 1 and o.finish_reason == "length" and o.error is None
    assert p.connector.take_kv_finishes() == [KVFinish("r", LISTEN, "r", o.new_token_ids[0])]
    for plan in plans:
        assert plan is not None
        assert p.connector.on_transfer_report(TransferReport(plan.step_id, {"r": "peer reset"})) == []
    assert p.connector.take_kv_finishes() == [] and p.stats().kv_transfers_failed == len(plans)
    assert all_free(p) and p.check_invariants() == []


def test_abort_before_first_token_sends_an_error_finish_and_drop_plan_fails():
    p, pw, _ = make("prefill", budget=8, threshold=8)
    p.add_request(prefill_req("a", list(range(1, 31)), list(range(8))))
    p.add_request(prefill_req("b", list(range(1, 31)), list(range(8, 16))))
    _, plan, _ = step(p, pw)
    assert plan is not None
    p.abort_requests(["a"])
    (f,) = p.connector.take_kv_finishes()
    assert f.req_id == "a" and f.error == "aborted by the client"
    so = p.schedule()
    plan2 = p.connector.take_plan()
    assert plan2 is not None and [s.req_id for s in plan2.sends] == ["b"]
    (o,) = p.connector.drop_plan(plan2, "plan too large")
    assert o.req_id == "b" and o.error_code == "kv_transfer_failed" and o.error == "plan too large"
    assert [f.error for f in p.connector.take_kv_finishes()] == ["plan too large"]
    p.update_from_output(so, pw.execute(so))  # stale result for b
    p.connector.on_transfer_report(TransferReport(plan.step_id, {}))
    assert all_free(p) and p.check_invariants() == []


def test_prefill_ends_after_its_first_token_whatever_its_max_tokens():
    p, pw, _ = make("prefill", num_blocks=8)
    prompt = list(range(1, 15))
    kv = KVTransferParams(role="prefill", peer=LISTEN, remote_req_id="d", remote_block_ids=[4, 5, 6, 7])
    # The client's own params (the router's since --pd-fallback): 100 tokens do not fit 8
    # blocks of 4, but a prefill without fallback needs the prompt's blocks only.
    p.add_request(request("r", prompt, kv, max_tokens=100, ignore_eos=True))
    _, plan, outs = step(p, pw)
    assert plan is not None and [o.finish_reason for o in outs] == ["length"]
    assert outs[0].new_token_ids == reference(pw, prompt, 1)
    assert p.connector.take_kv_finishes() == [KVFinish("r", LISTEN, "d", outs[0].new_token_ids[0])]
    assert p.abort_requests(["r"]) == [] and p.connector.take_kv_finishes() == []  # the decode side has its KV
    # Nor does a failed report of that step: the messager reports that in the finish it sends.
    assert p.connector.on_transfer_report(TransferReport(plan.step_id, {"r": "peer reset"})) == []
    assert p.connector.take_kv_finishes() == []
    assert all_free(p) and p.check_invariants() == []


@pytest.mark.parametrize("caching", [False, True])
def test_preempted_prefill_resends_from_the_remote_boundary(caching):
    p, pw, _ = make("prefill", num_blocks=10, budget=16, threshold=8, caching=caching)
    p.add_request(prefill_req("a", list(range(1, 31)), list(range(8)), cached=4))
    p.add_request(prefill_req("b", list(range(31, 61)), list(range(8, 16))))
    steps = []
    plans: list[TransferPlan] = []
    while p.has_unfinished_requests():
        so, plan, _ = step(p, pw)
        steps.append((so.preempted_req_ids, {rid: [r for _, r in plan_pairs(plan, rid)]
                                             for rid in ("a", "b")}))
        if plan is not None:
            plans.append(plan)
        if len(plans) > 1:  # reports come back one plan late
            p.connector.on_transfer_report(TransferReport(plans.pop(0).step_id, {}))
    for plan in plans:
        p.connector.on_transfer_report(TransferReport(plan.step_id, {}))
    k, victim = next((i, pre[0]) for i, (pre, _) in enumerate(steps) if pre)
    boundary = {"a": 1, "b": 8}[victim]  # a's decode side has block 0 already
    before = [r for _, sent in steps[:k] for r in sent[victim]]
    assert before and before[0] == boundary
    resent = next(sent[victim] for _, sent in steps[k:] if sent[victim])
    assert resent[0] == boundary  # from the start again, not from where it was
    for rid, blocks in (("a", range(1, 8)), ("b", range(8, 16))):
        assert {r for _, sent in steps for r in sent[rid]} == set(blocks)
    assert all_free(p) and p.check_invariants() == []


# -- prefill role, --pd-fallback local -------------------------------------------------------
def send_req(rid, prompt, remote, cached=0, **sp) -> EngineRequest:
    """A prefill-role request as the router sends it: the client's own sampling params."""
    kv = KVTransferParams(role="prefill", peer=LISTEN, remote_req_id="d-" + rid,
                          remote_block_ids=list(remote), remote_num_cached_tokens=cached)
    return request(rid, prompt, kv, **sp)


PROMPT18 = list(range(1, 19))  # 3 steps of 8 tokens, 5 blocks of 4


def three_steps(p: Scheduler, pw: FakeWorker) -> tuple[list[TransferPlan], list[EngineOutput]]:
    plans, outs = [], []
    for _ in range(3):
        _, plan, o = step(p, pw)
        assert plan is not None
        plans.append(plan)
        outs += o
    return plans, outs


def test_local_parks_the_first_token_until_every_report_then_ends_it():
    p, pw, _ = make("prefill", budget=8, threshold=8, fallback="local")
    p.add_request(send_req("r", PROMPT18, range(5), max_tokens=6, ignore_eos=True))
    plans, outs = three_steps(p, pw)
    first = reference(pw, PROMPT18, 1)
    assert [(o.new_token_ids, o.finish_reason) for o in outs] == [(first, None)]  # at once
    r = p.requests["r"]
    assert list(p.connector.parked) == ["r"] and r.status == RequestStatus.PARKED and p.connector.sends["r"].pending == 3
    assert not p.has_unfinished_requests() and p.stats().running == 0
    assert p.connector.take_kv_finishes() == []  # the decode side learns nothing before the reports
    assert p.check_invariants() == []  # parked, holding its blocks
    assert p.connector.on_transfer_report(TransferReport(plans[2].step_id, {})) == []
    assert p.connector.on_transfer_report(TransferReport(plans[0].step_id, {})) == []
    (o,) = p.connector.on_transfer_report(TransferReport(plans[1].step_id, {}))
    assert o.new_token_ids == [] and o.finish_reason == "length" and o.error is None
    assert p.connector.take_kv_finishes() == [KVFinish("r", LISTEN, "d-r", first[0])]
    assert not p.connector.parked and not p.requests and p.connector.num_kv_fallbacks == 0
    assert all_free(p) and p.check_invariants() == []


def drain_outputs(p: Scheduler, pw: FakeWorker) -> list[EngineOutput]:
    outs = []
    while p.has_unfinished_requests():
        _, plan, o = step(p, pw)
        assert plan is None  # a request that fell back sends nothing more
        outs += o
    return outs


def test_local_failure_after_the_first_token_decodes_it_like_a_mixed_run():
    p, pw, _ = make("prefill", budget=8, threshold=8, fallback="local")
    p.add_request(send_req("r", PROMPT18, range(5), max_tokens=6, ignore_eos=True))
    plans, outs = three_steps(p, pw)
    assert p.connector.on_transfer_report(TransferReport(plans[0].step_id, {})) == []
    assert p.connector.on_transfer_report(TransferReport(plans[1].step_id, {"r": "peer reset"})) == []
    assert p.connector.take_kv_finishes() == [KVFinish("r", LISTEN, "d-r", -1, FALLBACK_ERROR)]
    r = p.requests["r"]
    assert r.status == RequestStatus.RUNNING and "r" not in p.connector.sends and not p.connector.parked
    assert p.check_invariants() == []
    outs += drain_outputs(p, pw)
    # The same tokens as a mixed instance: the prompt's KV and the first token were kept.
    m, mw, _ = make("mixed")
    m.add_request(request("r", PROMPT18, max_tokens=6, ignore_eos=True))
    mixed = drain_outputs(m, mw)
    assert [t for o in outs for t in o.new_token_ids] == [t for o in mixed for t in o.new_token_ids]
    assert [t for o in outs for t in o.new_token_ids] == reference(pw, PROMPT18, 6, ignore_eos=True)
    assert [o.finish_reason for o in outs] == [None] * 5 + ["length"]
    # The last report changes nothing: the request is gone, its KVFinish went out.
    assert p.connector.on_transfer_report(TransferReport(plans[2].step_id, {"r": "peer reset"})) == []
    assert p.connector.take_kv_finishes() == [] and p.connector.num_kv_fallbacks == 1
    assert p.stats().kv_transfers_failed == 2
    assert all_free(p) and p.check_invariants() == []


@pytest.mark.parametrize("how", ["report", "drop_plan"])
def test_local_failure_before_the_first_token_falls_back_at_once(how):
    p, pw, _ = make("prefill", budget=8, threshold=8, fallback="local")
    p.add_request(send_req("r", PROMPT18, range(5), max_tokens=6, ignore_eos=True))
    if how == "report":
        _, plan, outs = step(p, pw)
        assert plan is not None
        assert p.connector.on_transfer_report(TransferReport(plan.step_id, {"r": "unreachable"})) == []
    else:  # the plan could not even go to the messager
        so = p.schedule()
        plan = p.connector.take_plan()
        assert plan is not None
        assert p.connector.drop_plan(plan, "plan too large") == []
        outs = p.update_from_output(so, pw.execute(so))  # the step itself stands
        assert plan.step_id not in p.connector.transfers.leases
    assert p.connector.take_kv_finishes() == [KVFinish("r", LISTEN, "d-r", -1, FALLBACK_ERROR)]
    assert "r" not in p.connector.sends
    outs += drain_outputs(p, pw)  # never parked: decided before its first token
    assert [t for o in outs for t in o.new_token_ids] == reference(pw, PROMPT18, 6, ignore_eos=True)
    assert outs[-1].finish_reason == "length" and p.connector.take_kv_finishes() == []
    if how == "report":
        assert p.stats().kv_transfer_leased_blocks == 0
    assert all_free(p) and p.check_invariants() == []


def test_parked_requests_abort_and_stop_strings():
    p, pw, _ = make("prefill", fallback="local")
    for rid, prompt in (("a", [1, 2, 3, 4, 5]), ("b", [6, 7, 8, 9, 10]), ("c", [11, 12, 13, 14, 15])):
        p.add_request(send_req(rid, prompt, range(2), max_tokens=4, ignore_eos=True))
    _, plan, outs = step(p, pw)
    assert plan is not None and set(p.connector.parked) == {"a", "b", "c"}
    first = {o.req_id: o.new_token_ids[0] for o in outs}
    # A client abort ends it at once; the decode side learns why.
    (o,) = p.abort_requests(["a"])
    assert o.finish_reason == "abort"
    assert p.connector.take_kv_finishes() == [KVFinish("a", LISTEN, "d-a", -1, "aborted by the client")]
    # A stop string on the first token (the token processor): it ends so once settled.
    assert p.abort_requests(["b", "c"], "stop") == []
    assert set(p.connector.parked) == {"b", "c"} and p.check_invariants() == []
    outs = p.connector.on_transfer_report(TransferReport(plan.step_id, {"c": "peer reset"}))
    assert sorted((o.req_id, o.finish_reason, o.new_token_ids) for o in outs) == [
        ("b", "stop", []), ("c", "stop", [])]
    assert sorted(p.connector.take_kv_finishes(), key=lambda f: f.req_id) == [
        KVFinish("b", LISTEN, "d-b", first["b"]), KVFinish("c", LISTEN, "d-c", -1, FALLBACK_ERROR)]
    assert not p.requests and not p.connector.parked
    assert all_free(p) and p.check_invariants() == []


def test_local_fallback_only_for_what_fits_and_none_finishes_at_the_first_token():
    p, pw, _ = make("prefill", num_blocks=8, fallback="local")
    # 100 tokens do not fit 8 blocks of 4: sent, never decoded here, so it fails as with none.
    p.add_request(send_req("big", list(range(1, 10)), range(3), max_tokens=100, ignore_eos=True))
    assert not p.connector.sends["big"].fallback
    _, plan, (o,) = step(p, pw)
    assert o.finish_reason == "length" and not p.connector.parked  # not parked either: ends at once
    assert plan is not None and p.connector.on_transfer_report(TransferReport(plan.step_id, {"big": "x"})) == []
    p.add_request(send_req("r", PROMPT18, range(5), max_tokens=6))
    assert p.connector.sends["r"].fallback
    _, plan, _ = step(p, pw)
    assert plan is not None and p.requests["r"].status == RequestStatus.PARKED
    assert p.connector.on_transfer_report(TransferReport(plan.step_id, {"r": "x"})) == []
    assert p.requests["r"].status == RequestStatus.RUNNING  # decodes here
    # --pd-fallback none: the first failed report fails it (unchanged).
    n, nw, _ = make("prefill", budget=8, threshold=8)
    n.add_request(send_req("r", PROMPT18, range(5), max_tokens=6))
    _, plan, _ = step(n, nw)
    assert plan is not None and not n.connector.sends["r"].fallback
    (o,) = n.connector.on_transfer_report(TransferReport(plan.step_id, {"r": "x"}))
    assert o.error_code == "kv_transfer_failed"


def test_decode_side_fails_a_fallen_back_request_with_kv_fallback():
    d, _, _ = make("decode")
    d.add_request(decode_req("r", list(range(1, 11))))
    d.connector.poll()
    (o,) = d.connector.on_kv_ready(KVReady("r", error=FALLBACK_ERROR))
    assert o.finish_reason == "error" and o.error_code == "kv_fallback" and o.error == FALLBACK_ERROR
    assert d.stats().kv_transfers_failed == 0  # not a failure: the prefill instance answers
    assert all_free(d) and not d.requests and d.check_invariants() == []


def test_pd_fallback_flag_is_for_prefill_instances():
    EngineConfig.of(role="prefill", pd_fallback="local").check()
    for role in ("mixed", "decode"):
        with pytest.raises(ValueError, match="--pd-fallback is for --role prefill"):
            EngineConfig.of(role=role, pd_fallback="local").check()
    with pytest.raises(ValueError, match="--pd-fallback must be one of none, local"):
        EngineConfig.of(role="prefill", pd_fallback="remote").check()


def test_kv_transfer_requests_checked_against_the_role():
    p, _, _ = make("prefill")
    with pytest.raises(ValueError, match="remote_block_ids"):
        p.add_request(prefill_req("r", list(range(1, 10)), [1, 2]))
    with pytest.raises(ValueError, match="role"):
        p.add_request(decode_req("r", [1, 2, 3]))
    m, _, _ = make("mixed")
    with pytest.raises(ValueError, match="role"):
        m.add_request(decode_req("r", [1, 2, 3]))
    assert not p.requests and not m.requests


# -- both, end to end through a simulated messager, random interleavings ----------------------
class PD:
    """A decode and a prefill engine, their workers, and the messagers and router between."""

    def __init__(self, d_blocks=24, p_blocks=14, budget=12, caching=True, fallback="none") -> None:
        self.d, self.dw, self.clock = make("decode", num_blocks=d_blocks, budget=budget, seqs=4,
                                           caching=caching, threshold=budget // 2)
        self.p, self.pw, _ = make("prefill", num_blocks=p_blocks, budget=budget, seqs=4,
                                  caching=caching, threshold=budget // 2, fallback=fallback)
        self.plans_ring: deque = deque()  # prefill engine -> its messager, in order
        self.reports: deque[TransferReport] = deque()
        self.ready: deque[KVReady] = deque()
        self.bad: set[str] = set()  # prefill ids whose transfer failed
        self.lost: set[str] = set()  # reservations the router never forwards
        # Decode ids whose quarantine ended at its deadline: their prefill side counts as gone
        # (what the deadline assumes), so nothing more of theirs lands on the decode side.
        self.gone: set[str] = set()
        self.num_writes = 0
        self.prompts: dict[str, list[int]] = {}
        self.max_tokens: dict[str, int] = {}
        self.d_tokens: dict[str, list[int]] = {}
        self.d_final: dict[str, EngineOutput] = {}
        self.p_finishes: dict[str, int] = {}
        self.p_tokens: dict[str, list[int]] = {}  # the prefill side's outputs, by decode id
        self.p_final: dict[str, EngineOutput] = {}

    def check(self) -> None:
        assert self.d.check_invariants() == []
        assert self.p.check_invariants() == []

    def add(self, rid, prompt, max_tokens, lose=False) -> None:
        self.d.add_request(decode_req(rid, prompt, max_tokens=max_tokens))
        self.prompts[rid], self.max_tokens[rid] = prompt, max_tokens
        self.d_tokens[rid] = []
        if lose:
            self.lost.add(rid)

    def record_d(self, outs) -> None:
        for o in outs:
            assert o.req_id not in self.d_final, f"{o.req_id}: output after its final one"
            self.d_tokens[o.req_id] += o.new_token_ids
            if o.finish_reason is not None:
                self.d_final[o.req_id] = o
            if o.kv is not None and o.req_id not in self.lost:
                kv = o.kv
                # The router's prefill leg: the client's own params.
                kvt = KVTransferParams(role="prefill", peer=LISTEN, remote_req_id=kv.engine_req_id,
                                       remote_block_ids=kv.block_ids,
                                       remote_num_cached_tokens=kv.num_cached_tokens)
                self.p.add_request(request("p-" + o.req_id, self.prompts[o.req_id], kvt,
                                           max_tokens=self.max_tokens[o.req_id]))

    def record_p(self, outs) -> None:
        for o in outs:
            rid = o.req_id[2:]
            assert rid not in self.p_final, f"{o.req_id}: prefill output after its final one"
            self.p_tokens.setdefault(rid, []).extend(o.new_token_ids)
            if o.finish_reason is not None:
                self.p_final[rid] = o

    def take_finishes(self) -> None:
        for f in self.p.connector.take_kv_finishes():
            assert f.req_id not in self.p_finishes, f"second KVFinish for {f.req_id}"
            self.p_finishes[f.req_id] = f.token
            self.plans_ring.append(f)

    def d_poll(self) -> None:
        before = set(self.d.connector.reservations.quarantine)
        self.record_d(self.d.connector.poll())
        self.gone |= before - set(self.d.connector.reservations.quarantine)

    def writable(self, remote_id: str) -> set[int]:
        """The decode blocks a prefill may write for reservation ``remote_id``: its own while
        reserved, else those quarantined under its id."""
        res = self.d.connector.reservations
        req = res.reserved.get(remote_id)
        if req is not None:
            return {b.block_id for b in req.blocks}
        held = res.quarantine.get(remote_id)
        return {b.block_id for b in held[0]} if held is not None else set()

    def d_step(self) -> None:
        so = self.d.schedule()
        self.record_d(self.d.connector.take_outputs())
        self.record_d(self.d.update_from_output(so, self.dw.execute(so)))

    def p_step(self) -> None:
        so = self.p.schedule()
        plan = self.p.connector.take_plan()
        if plan is not None:
            self.plans_ring.append(plan)
        self.record_p(self.p.update_from_output(so, self.pw.execute(so)))
        self.take_finishes()

    def messager(self, fail: bool) -> None:
        item = self.plans_ring.popleft()
        if isinstance(item, TransferPlan):
            failed = {}
            bs = self.pw.block_size
            for s in item.sends:
                if fail or s.remote_req_id in self.gone:
                    failed[s.req_id] = "injected failure" if fail else "decode peer gone"
                    self.bad.add(s.req_id)
                    continue
                # Every pair lands (ipc writes straight into the decode pool): the block must
                # be the reservation's, never one freed and handed to another request.
                mine = self.writable(s.remote_req_id)
                for loc, rem in bytes_to_pairs(s.pairs).tolist():
                    assert rem in mine, (f"{s.req_id} writes decode block {rem}, which "
                                         f"{s.remote_req_id} no longer holds (its blocks: {mine})")
                    self.dw.kv[rem * bs:(rem + 1) * bs] = self.pw.kv[loc * bs:(loc + 1) * bs]  # type: ignore[index]
                    self.num_writes += 1
            self.reports.append(TransferReport(item.step_id, failed))
        else:
            err = item.error or ("transfer failed" if item.req_id in self.bad else "")
            self.ready.append(KVReady(item.remote_req_id, -1 if err else item.token, err))

    def p_report(self) -> None:
        self.record_p(self.p.connector.on_transfer_report(self.reports.popleft()))
        self.take_finishes()

    def d_ready(self) -> None:
        self.record_d(self.d.connector.on_kv_ready(self.ready.popleft()))

    def abort(self, rid: str) -> None:
        self.record_d(self.d.abort_requests([rid]))
        self.record_p(self.p.abort_requests(["p-" + rid]))
        self.take_finishes()

    def drain(self) -> None:
        """Run every party until nothing is left (lost reservations time out, then their
        quarantine). Time passes: reservations may hold the blocks a running request needs
        until they time out."""
        for _ in range(5000):
            busy = False
            self.clock.t += 0.01
            self.d_poll()
            if self.p.has_unfinished_requests():
                self.p_step()
                busy = True
            if self.plans_ring:
                self.messager(False)
                busy = True
            if self.reports:
                self.p_report()
                busy = True
            if self.ready:
                self.d_ready()
                busy = True
            if self.d.has_unfinished_requests():
                self.d_step()
                busy = True
            if not busy:
                if not self.d.connector.reservations and not self.d.connector.reservations.quarantine:
                    return
                self.clock.t += TIMEOUT + 1  # lost ones time out
            self.check()
        raise AssertionError("the pair did not converge")


def test_end_to_end_tokens_match_an_unsplit_run():
    pd = PD()
    prompts = {f"r{i}": [1 + (7 * i + j) % 40 for j in range(9 + 5 * i)] for i in range(5)}
    for rid, prompt in prompts.items():
        pd.add(rid, prompt, 5)
    pd.drain()
    # Prefix hits on both sides: the decode side has the prompt blocks it received.
    prompts["r5"] = prompts["r4"][:16] + [3, 4, 5]
    pd.add("r5", prompts["r5"], 5)
    pd.drain()
    assert pd.d_final["r5"].num_cached_tokens == 16 and pd.p.kv.num_hit_tokens >= 16
    for rid, prompt in prompts.items():
        assert pd.d_final[rid].finish_reason in ("stop", "length"), pd.d_final[rid]
        assert pd.d_tokens[rid] == reference(pd.dw, prompt, 5)
        assert pd.p_finishes["p-" + rid] == pd.d_tokens[rid][0]
    assert all_free(pd.d) and all_free(pd.p)


def test_end_to_end_fallback_answers_from_the_prefill_side():
    pd = PD(fallback="local")
    prompts = {f"r{i}": [1 + (7 * i + j) % 40 for j in range(9 + 5 * i)] for i in range(4)}
    pd.gone |= {"r1", "r3"}  # every send to these reservations fails: their peer is gone
    for rid, prompt in prompts.items():
        pd.add(rid, prompt, 5)
    pd.drain()
    for rid, prompt in prompts.items():
        want = reference(pd.pw, prompt, 5)
        if rid in ("r1", "r3"):
            assert pd.d_final[rid].error_code == "kv_fallback" and pd.d_tokens[rid] == []
            assert pd.p_final[rid].finish_reason in ("stop", "length")
            assert pd.p_tokens[rid] == want
        else:  # the prefill side ends after the first token, once its transfer is reported
            assert pd.d_tokens[rid] == want and pd.p_tokens[rid] == want[:1]
            assert pd.p_final[rid].finish_reason in ("stop", "length")
    assert pd.p.connector.num_kv_fallbacks == 2
    assert all_free(pd.d) and all_free(pd.p)


# Op kinds, repeated to weight them; "drain": everything in flight completes (later requests
# then hit both prefix caches).
KINDS = (["add"] * 6 + ["d_poll", "p_report", "d_ready"] * 3 + ["d_step", "p_step"] * 5
         + ["messager"] * 8 + ["clock"] * 2 + ["abort", "drain"])
PARAMS = {
    "add": st.tuples(st.integers(1, 30), st.integers(1, 12), st.integers(0, 2), st.booleans()),
    "messager": st.tuples(st.integers(0, 4)),  # 0: the step's transfer fails
    "clock": st.tuples(st.floats(0.0, 3.0)),
    "abort": st.tuples(st.integers(0, 50)),
}
OPS = st.sampled_from(KINDS).flatmap(
    lambda k: PARAMS[k].map(lambda args: (k, *args)) if k in PARAMS else st.just((k,)))


@settings(max_examples=250, deadline=None)
@given(st.lists(OPS, min_size=10, max_size=80), st.booleans(), st.sampled_from(["none", "local"]))
def test_random_interleavings_keep_block_accounting(ops, caching, fallback):
    """Block accounting on both sides after every op, and (in ``PD.messager``) no transfer
    ever lands in a decode block its reservation no longer holds, aborted or timed out.
    With --pd-fallback local a request whose transfer failed is answered by the prefill
    side, with the tokens of an unsplit run."""
    pd = PD(caching=caching, fallback=fallback)
    n = 0
    bases = [[1 + (5 * k + j) % 37 for j in range(32)] for k in range(3)]
    for op in ops:
        kind = op[0]
        if kind == "add":
            _, length, max_tokens, base, lose = op
            pd.add(f"r{n}", bases[base][:length], max_tokens, lose=lose and n % 3 == 0)
            n += 1
        elif kind == "messager":
            if pd.plans_ring:
                pd.messager(fail=op[1] == 0)
        elif kind == "clock":
            pd.clock.t += op[1]
        elif kind == "abort":
            if n:
                pd.abort(f"r{op[1] % n}")
        elif kind == "p_report":
            if pd.reports:
                pd.p_report()
        elif kind == "d_ready":
            if pd.ready:
                pd.d_ready()
        else:
            getattr(pd, kind)()
        pd.check()
    pd.drain()
    assert not pd.d.requests and not pd.p.requests
    assert all_free(pd.d) and all_free(pd.p), (pd.d.stats(), pd.p.stats())
    assert pd.p.stats().kv_transfer_leased_blocks == 0 and not pd.p.connector.transfers.leases
    assert not pd.d.connector.reservations.quarantine and pd.d.stats().kv_reserved_blocks == 0
    assert set(pd.d_final) == set(pd.prompts)
    for rid, o in pd.d_final.items():
        if o.finish_reason in ("stop", "length"):
            assert pd.d_tokens[rid] == reference(pd.dw, pd.prompts[rid], pd.max_tokens[rid])
        else:
            assert o.finish_reason in ("abort", "error")
            if o.finish_reason == "error":
                assert o.error_code in ("kv_transfer_failed", "kv_transfer_timeout", "kv_fallback"), o
            if o.error_code == "kv_fallback":
                assert fallback == "local"
                pf = pd.p_final[rid]  # the prefill side answers (unless aborted)
                if pf.finish_reason in ("stop", "length"):
                    assert pd.p_tokens[rid] == reference(pd.pw, pd.prompts[rid], pd.max_tokens[rid])
                else:
                    assert pf.finish_reason == "abort", pf
    fell_back = sum(o.error_code == "kv_fallback" for o in pd.d_final.values())
    assert fell_back <= pd.p.connector.num_kv_fallbacks


# -- the engine stage loop, in process: real rings, a FakeWorker thread, the test as the rest --
class StageRig:
    """The engine stage's EngineLoop over real shared-memory rings of an instance; this test
    holds the other end of each (tokenizer, token processor, gateway, cache messager) and a
    thread plays worker rank 0."""

    def __init__(self, inst, role: str, timeout: float = TIMEOUT) -> None:
        import threading

        from pipeline.engine.stage import EngineLoop
        from pipeline.ipc.broadcast import BroadcastRing
        from pipeline.ipc.ring import Doorbell, Ring
        from pipeline.messages.kv_layout import KVLayout
        from pipeline.runtime.ring_sizes import capacity
        from pipeline.runtime.rings import (
            SHARED_DOORBELLS,
            STEPS_ROLE,
            Channel,
            message_limits,
            ring_roles,
        )
        from pipeline.runtime.spec import ModelInfo, StageSpec

        cfg = EngineConfig.of(role=role, kv_listen=LISTEN if role == "decode" else "",
                           kv_transfer_timeout=timeout, max_num_seqs=4,
                           max_num_batched_tokens=16, block_size=4)
        limits = message_limits(cfg, MAX_LEN)
        self.bells = [Doorbell.create(inst, f"bell.{c}") for c in SHARED_DOORBELLS]
        bells = dict(zip(SHARED_DOORBELLS, self.bells))
        self.ch: dict[str, Channel] = {}
        for r, (prod, cons) in ring_roles(role).items():
            if "engine" in (prod, cons):
                self.ch[r] = Channel(Ring.create(inst, r, capacity(limits[r]), doorbell=bells.get(cons),
                                                 role="writer" if cons == "engine" else "reader",
                                                 claim=True), r)
        self.steps = BroadcastRing.create(inst, STEPS_ROLE, capacity(limits[STEPS_ROLE]), 1)
        names = {r: c.ring.name for r, c in self.ch.items()} | {STEPS_ROLE: self.steps.name}
        # The engine reads the block count and size; the rest is a one-layer cache's.
        kv = KVLayout(num_layers=1, num_blocks=32, block_size=4, num_kv_heads=1, head_dim=1,
                      dtype="float32")
        model = ModelInfo(max_model_len=MAX_LEN, vocab_size=VOCAB, eos_token_ids=[EOS], kv=kv)
        self.loop = EngineLoop(StageSpec(name="engine", kind="engine", config=cfg, rings=names,
                                         model=model))
        self.worker = FakeWorker(32, 4, MAX_LEN, VOCAB, [EOS], check_kv=True)
        self.worker_steps = Channel(BroadcastRing.attach(self.steps.name, 0), STEPS_ROLE)
        self.stop = threading.Event()
        self.error: list[BaseException] = []
        self.thread = threading.Thread(target=self._work, daemon=True)
        self.thread.start()

    def _work(self) -> None:
        try:
            while not self.stop.is_set():
                try:
                    so = self.worker_steps.recv(timeout=0.05)
                except TimeoutError:
                    continue
                self.ch["results"].send(self.worker.execute(so))
        except BaseException as exc:  # noqa: BLE001 - reported by the test
            self.error.append(exc)

    def send(self, role: str, msg) -> None:
        self.ch[role].send(msg)

    def drain(self, role: str) -> list:
        out = []
        while (m := self.ch[role].try_recv()) is not None:
            out.append(m)
        return out

    def outputs(self) -> list[EngineOutput]:
        return [o for batch in self.drain("outputs") for o in batch.outputs]

    def close(self) -> None:
        self.stop.set()
        self.thread.join(timeout=10)
        assert not self.error, self.error
        self.loop.close()
        for c in self.ch.values():
            c.close()
        self.worker_steps.close()
        self.steps.close()
        for b in self.bells:
            b.close()


@pytest.fixture
def rig(inst, request):
    role, timeout = request.param
    r = StageRig(inst, role, timeout)
    yield r
    r.close()


@pytest.mark.parametrize("rig", [("decode", TIMEOUT)], indirect=True)
def test_stage_decode_reserves_waits_and_decodes(rig):
    prompt = list(range(1, 12))
    rig.send("requests", decode_req("r", prompt, max_tokens=4, ignore_eos=True))
    rig.loop.run_once()
    (o,) = rig.outputs()
    assert o.kv is not None and o.kv.endpoint == LISTEN and len(o.kv.block_ids) == 3
    assert not rig.loop.sched.has_unfinished_requests()
    write_kv(rig.worker, prompt, o.kv.block_ids)
    ref = reference(rig.worker, prompt, 4, ignore_eos=True)
    rig.send("kv_ready", KVReady("r", ref[0]))
    toks: list[int] = []
    final = None
    for _ in range(20):
        rig.loop.run_once()
        for o in rig.outputs():
            toks += o.new_token_ids
            final = o if o.finish_reason else final
        if final:
            break
    assert toks == ref and final is not None and final.finish_reason == "length"
    rig.loop.run_once()  # idle: audits
    assert rig.loop.invariants_checked and all_free(rig.loop.sched)


@pytest.mark.parametrize("rig", [("decode", 0.3)], indirect=True)
def test_stage_wakes_for_the_reservation_and_quarantine_deadlines(rig):
    rig.send("requests", decode_req("r", list(range(1, 12))))
    t0 = time.monotonic()
    n = 0
    outs: list[EngineOutput] = []
    while not any(o.finish_reason for o in outs):
        rig.loop.run_once()
        n += 1
        outs += rig.outputs()
        assert n < 10, "the loop spun instead of waiting for the deadline"
    took = time.monotonic() - t0
    o = outs[-1]
    assert o.error_code == "kv_transfer_timeout" and "--kv-transfer-timeout 0.3 s" in (o.error or "")
    assert 0.3 <= took < 2.0
    sched = rig.loop.sched
    assert sched.stats().kv_reservation_timeouts == 1
    # No KVReady either: the prompt's 3 blocks stay quarantined for another 0.3 s, then the
    # loop wakes for that deadline too and frees them.
    assert sched.stats().kv_reserved_blocks == 3 and not all_free(sched)
    t1 = time.monotonic()
    n = 0
    while not all_free(sched):
        rig.loop.run_once()
        n += 1
        assert n < 10, "the loop spun instead of waiting for the quarantine's deadline"
    assert 0.25 <= time.monotonic() - t1 < 2.0  # measured from after the timeout's answer
    assert sched.stats().kv_reserved_blocks == 0
    assert rig.loop.invariants_checked and sched.check_invariants() == []  # audited when freed


@pytest.mark.parametrize("rig", [("prefill", TIMEOUT)], indirect=True)
def test_stage_prefill_sends_plan_then_finish_and_releases_on_report(rig):
    # The first request to a peer no transfer reached yet: its first token waits for the
    # report (a peer that refuses every transfer fails it here, naming why).
    prompt = list(range(1, 15))
    first = reference(rig.worker, prompt, 1)[0]
    rig.send("requests", prefill_req("r", prompt, [7, 8, 9, 10]))
    rig.loop.run_once()
    (plan,) = rig.drain("kv_plans")
    assert isinstance(plan, TransferPlan) and [r for _, r in plan_pairs(plan, "r")] == [7, 8, 9, 10]
    (o,) = rig.outputs()
    assert o.new_token_ids == [first] and o.finish_reason is None  # parked
    assert rig.loop.sched.stats().kv_transfer_leased_blocks == 4
    rig.send("kv_reports", TransferReport(plan.step_id, {}))
    rig.loop.run_once()
    assert rig.drain("kv_plans") == [KVFinish("r", LISTEN, "r", first)]
    (o,) = rig.outputs()
    assert o.finish_reason == "length"
    assert rig.loop.sched.stats().kv_transfer_leased_blocks == 0 and all_free(rig.loop.sched)
    # The peer is proven now: the next request's first token and KVFinish go at once.
    rig.send("requests", prefill_req("s", prompt, [11, 12, 13, 14]))
    rig.loop.run_once()
    plan, fin = rig.drain("kv_plans")
    assert isinstance(plan, TransferPlan) and fin == KVFinish("s", LISTEN, "s", first)
    (o,) = rig.outputs()
    assert o.finish_reason == "length"
    assert rig.loop.sched.stats().kv_transfer_leased_blocks == 4
    assert not rig.loop.sched.has_unfinished_requests()
    rig.send("kv_reports", TransferReport(plan.step_id, {}))
    rig.loop.run_once()
    assert rig.loop.sched.stats().kv_transfer_leased_blocks == 0 and all_free(rig.loop.sched)
    assert rig.loop.sched.check_invariants() == []


@pytest.mark.parametrize("rig", [("prefill", TIMEOUT)], indirect=True)
def test_stage_prefill_a_peer_that_refuses_fails_each_request_naming_why(rig):
    prompt = list(range(1, 15))
    for rid in ("r", "s"):  # the failure un-proves nothing it had: each waits for its report
        rig.send("requests", prefill_req(rid, prompt, [7, 8, 9, 10]))
        rig.loop.run_once()
        (plan,) = rig.drain("kv_plans")
        (o,) = rig.outputs()
        assert o.finish_reason is None and len(o.new_token_ids) == 1
        rig.send("kv_reports", TransferReport(plan.step_id, {rid: "KV layout mismatch: num_layers"}))
        rig.loop.run_once()
        (fin,) = rig.drain("kv_plans")
        assert fin.req_id == rid and fin.token == -1 and "num_layers" in fin.error
        (o,) = rig.outputs()
        assert o.finish_reason == "error" and o.error_code == "kv_transfer_failed"
        assert "num_layers" in o.error
        assert all_free(rig.loop.sched) and rig.loop.sched.check_invariants() == []


@pytest.mark.parametrize("rig", [("prefill", TIMEOUT)], indirect=True)
def test_stage_fails_a_plan_over_the_ring_limit(rig, monkeypatch):
    from pipeline.runtime.rings import Channel
    monkeypatch.setattr(Channel, "max_message_bytes", property(lambda self: 16))
    rig.send("requests", prefill_req("r", list(range(1, 15)), [7, 8, 9, 10]))
    rig.loop.run_once()
    (fin,) = rig.drain("kv_plans")
    assert isinstance(fin, KVFinish) and "over the kv_plans ring's limit of 16 bytes" in fin.error
    (o,) = rig.outputs()
    assert o.finish_reason == "error" and o.error_code == "kv_transfer_failed"
    assert rig.loop.sched.stats().kv_transfer_leased_blocks == 0


def test_prefill_stops_sending_when_the_decode_reservation_ends():
    """KVTransferParams.deadline_s: past it (less the margin) the decode side may have freed
    the blocks; the prefill fails the request instead of planning more sends into them."""
    p, pw, clock = make("prefill", budget=4, threshold=4)
    prompt = list(range(1, 23))
    er = prefill_req("r", prompt, [100 + i for i in range(6)])
    er.kv_transfer.deadline_s = 3.0
    p.add_request(er)
    plan = step(p, pw)[1]
    assert plan is not None  # the first chunk goes
    assert p.connector.next_deadline() == pytest.approx(clock() + 2.0)
    clock.t += 1.9
    assert p.connector.poll() == []
    clock.t += 0.2
    outs = p.connector.poll()
    assert [(o.req_id, o.finish_reason, o.error_code) for o in outs] == [("r", "error", "kv_transfer_timeout")]
    assert "reservation" in outs[0].error
    assert not p.has_unfinished_requests() and p.connector.take_plan() is None
    assert [f.error != "" for f in p.connector.take_kv_finishes()] == [True]  # the decode side is told
    assert p.connector.on_transfer_report(TransferReport(plan.step_id, {})) == []
    assert all_free(p) and p.check_invariants() == []
