"""Prefill/decode roles with a KV disk tier, engine side, in process: a prefill and a decode
Scheduler, each with the ``CompositeConnector`` (its role's connector and a real
TierConnector over a DiskTier, the TierMover driven by hand) and a FakeWorker whose KV
fingerprints live in the numpy pool the mover loads into. A stand-in for the two cache
messagers copies the prefill pool's blocks into the decode pool along each TransferPlan's
pairs and turns KVFinish into KVReady; the "router" turns a KVReservation into the prefill
request. So a block loaded into the wrong place, a block the prefill side skipped that the
decode side lacks, or a request run before its load landed fails inside a worker; the
block-table audit runs after every message.
"""
from __future__ import annotations

import os
import time
from collections import deque
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pipeline.cache.kv_tier.mover import TierMover
from pipeline.cache.kv_tier.store import DiskTier
from pipeline.config import EngineConfig
from pipeline.engine.core import EngineCore, LocalExecutor
from pipeline.engine.fake_worker import FakeWorker
from pipeline.engine.kv_connector.composite import CompositeConnector, with_tier
from pipeline.engine.kv_connector.decode import DecodeConnector
from pipeline.engine.kv_connector.prefill import PrefillConnector
from pipeline.engine.kv_connector.tier import TierConnector
from pipeline.engine.kv_connector.tier_index import tier_hash_key
from pipeline.engine.new_request import make_requests
from pipeline.engine.request import RequestStatus
from pipeline.engine.scheduler import Scheduler
from pipeline.messages import EngineOutput, EngineRequest, ids_to_bytes
from pipeline.messages.kv import (
    KVFinish,
    KVReady,
    KVTransferParams,
    TransferPlan,
    TransferReport,
    bytes_to_pairs,
)
from pipeline.messages.kv_layout import KVLayout
from pipeline.messages.kv_tier import TierPlan
from pipeline.sampling_params import SamplingParams

BS, NB, MAX_LEN, VOCAB = 4, 32, 64, 50
LISTEN = "tcp://127.0.0.1:5999"
TIMEOUT = 5.0
# One layer whose K rows are a block's BS fingerprints (uint64): 4 tokens x 4 x float16 = 32 bytes.
LAY = KVLayout(num_layers=1, num_blocks=NB, block_size=BS, num_kv_heads=1, head_dim=4,
               dtype="float16", model_hash="fake worker")


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


class Side:
    """One instance: its engine core, worker, pool and tier mover; what it sends to its
    cache messager queues in ``plans`` until ``Pair.pump_plans`` delivers it."""

    def __init__(self, role: str, root: str | None, clock: Clock) -> None:
        self.reports: deque[Any] = deque()
        self.pool = LAY.pool(np.zeros(LAY.total_bytes, np.uint8))
        self.worker = FakeWorker(NB, BS, MAX_LEN, VOCAB, [], check_kv=True)
        self.worker.kv = self.pool[0, 0].reshape(-1).view(np.uint64)  # type: ignore[assignment]
        cfg = EngineConfig.of(role=role, kv_listen=LISTEN if role == "decode" else "",
                              kv_transfer_timeout=TIMEOUT, max_num_seqs=4,
                              max_num_batched_tokens=64, enable_prefix_caching=True)
        self.sched = Scheduler(cfg, NB, BS, MAX_LEN,
                               tier_hash_key(root) if root else role.encode(), clock=clock,
                               connector=with_tier(root, LAY) if root else None)
        conn = self.sched.connector
        self.tier: TierConnector | None = None
        self.part = conn
        if root is not None:
            assert isinstance(conn, CompositeConnector)
            self.tier, self.part = conn.tier, conn.part
            self.disk = DiskTier(root, 1 << 20, LAY)
            self.mover = TierMover(self.disk, self.pool, lambda _t: None, self.reports.append)
        if isinstance(self.part, PrefillConnector):
            self.part.proven[LISTEN] = None  # a transfer to LISTEN was reported ok before
        self.plans: deque[Any] = deque()
        self.outs: list[EngineOutput] = []
        self.core = EngineCore(self.sched, LocalExecutor(self.worker), self.outs.extend,
                               send_kv=self._send)

    def _send(self, msg: Any) -> None:
        self.plans.append(msg)

    def chain(self, prompt: list[int]) -> list[bytes]:
        """The prompt's block hashes here (its tier files' names)."""
        er = EngineRequest("probe", ids_to_bytes(prompt), SamplingParams(), time.time(), [])
        (r,) = make_requests(er, set(), BS, NB, None)
        self.sched.kv.hash_new_blocks(r)
        return r.block_hashes

    def tokens(self, rid: str) -> list[int]:
        return [t for o in self.outs if o.req_id == rid for t in o.new_token_ids]

    def land(self) -> None:
        while self.reports:
            assert self.sched.check_invariants() == []
            self.core.on_kv_message(self.reports.popleft())

    def close(self) -> None:
        if self.tier is not None:
            self.disk.close()


class Pair:
    """A decode side and a prefill side, the router and both messagers between them."""

    def __init__(self, root_p: str | None, root_d: str | None) -> None:
        self.clock = Clock()
        self.pre = Side("prefill", root_p, self.clock)
        self.dec = Side("decode", root_d, self.clock)
        self.routed: set[str] = set()
        self.prompts: dict[str, list[int]] = {}
        self.shipped: dict[str, int] = {}  # request id -> blocks the prefill side shipped
        self.cached: dict[str, int] = {}  # request id -> the decode side's cached tokens

    def add(self, rid: str, prompt: list[int], max_tokens: int = 4) -> None:
        self.prompts[rid] = prompt
        self.dec.core.add_request(EngineRequest(
            rid, ids_to_bytes(prompt), SamplingParams(max_tokens=max_tokens, ignore_eos=True),
            time.time(), [], kv_transfer=KVTransferParams(role="decode")))

    def route(self) -> None:
        """The router: each new KVReservation becomes the prefill request."""
        for o in self.dec.outs:
            kv = o.kv
            if kv is None or o.req_id in self.routed:
                continue
            self.routed.add(o.req_id)
            self.cached[o.req_id] = kv.num_cached_tokens
            params = KVTransferParams(role="prefill", peer=LISTEN, remote_req_id=kv.engine_req_id,
                                      remote_block_ids=kv.block_ids,
                                      remote_num_cached_tokens=kv.num_cached_tokens)
            self.pre.core.add_request(EngineRequest(
                o.req_id, ids_to_bytes(self.prompts[o.req_id]), SamplingParams(max_tokens=1),
                time.time(), [], kv_transfer=params))

    def pump_plans(self, side: Side, take_tier: bool = True) -> None:
        """That side's cache messager takes what was sent (tier loads done, saves queued)."""
        keep: deque[Any] = deque()
        while side.plans:
            msg = side.plans.popleft()
            if isinstance(msg, TierPlan):
                if take_tier:
                    side.mover.take(msg)
                else:
                    keep.append(msg)
            elif isinstance(msg, TransferPlan):  # the step ran: its blocks hold their KV
                dec_kv, pre_kv = self.dec.worker.kv, self.pre.worker.kv
                assert dec_kv is not None and pre_kv is not None
                for s in msg.sends:
                    pairs = bytes_to_pairs(s.pairs)
                    self.shipped[s.req_id] = self.shipped.get(s.req_id, 0) + len(pairs)
                    for local, remote in pairs.tolist():
                        dec_kv[remote * BS:(remote + 1) * BS] = pre_kv[local * BS:(local + 1) * BS]
                side.core.on_kv_message(TransferReport(msg.step_id, {}))
            else:
                assert isinstance(msg, KVFinish)
                self.dec.core.on_kv_message(KVReady(msg.remote_req_id, msg.token, msg.error))
            assert side.sched.check_invariants() == []
        side.plans = keep

    def settle(self, max_rounds: int = 2000) -> None:
        """Run both sides until nothing is left (bounded: a stall fails)."""
        for _ in range(max_rounds):
            busy = False
            for side in (self.dec, self.pre):
                self.pump_plans(side)
                if side.tier is not None:
                    side.mover.drain()
                    side.land()
                side.core.poll()
                self.route()
                if side.core.has_work():
                    busy = side.core.step() or busy
                busy = busy or bool(side.plans or side.reports or side.sched.requests)
            if not busy:
                return
        raise AssertionError(f"stalled: {list(self.dec.sched.requests)}, {list(self.pre.sched.requests)}")

    def close(self) -> None:
        self.pre.close()
        self.dec.close()


def reference(prompt: list[int], n: int) -> list[int]:
    worker, toks = FakeWorker(vocab_size=VOCAB), list(prompt)
    for _ in range(n):
        toks.append(worker.next_token(toks))
    return toks[len(prompt):]


def assert_idle(side: Side) -> None:
    assert side.sched.check_invariants() == [] and not side.sched.requests
    if side.tier is not None:
        t = side.tier
        assert not (t.loading or t.orphans or t.saving or t.loading_keys or t.resumed or t.num_lent)
    assert all(b.ref_cnt == 0 for b in side.sched.kv.pool.blocks)


P = list(range(1, 13))  # a 3-block prefix the prompts share


def prompts(round_: int) -> dict[str, list[int]]:
    return {f"r{round_}-{s}": P + [20 + 10 * round_ + s] * (2 + s) for s in range(3)}


def run(pair: Pair, reqs: dict[str, list[int]]) -> None:
    for rid, prompt in reqs.items():
        pair.add(rid, prompt)
    pair.settle()
    for rid, prompt in reqs.items():
        assert pair.dec.tokens(rid) == reference(prompt, 4), rid
    assert_idle(pair.dec)
    assert_idle(pair.pre)


def test_both_sides_load_from_the_tier_and_the_prefill_side_skips_what_decode_loaded(tmp_path):
    root = str(tmp_path)
    pair = Pair(root, root)  # one host: both instances on one directory
    run(pair, prompts(0))
    assert pair.pre.tier is not None and pair.pre.tier.num_saved_blocks >= 3
    pair.close()
    # A restart of both: the pools are empty, the prefix is on disk.
    pair = Pair(root, root)
    reqs = prompts(1)
    run(pair, reqs)
    pre_t, dec_t = pair.pre.tier, pair.dec.tier
    assert pre_t is not None and dec_t is not None
    # The first request's reservation loaded P (3 blocks), the others hit the decode pool.
    assert dec_t.num_loaded_tokens == 12 and dec_t.num_failed_blocks == 0
    first = next(iter(reqs))
    assert pair.cached[first] == 12 and all(pair.cached[r] >= 12 for r in reqs)
    # The prefill side loaded P too, computed only the rest, and shipped only the blocks
    # past the decode side's cached ones.
    assert pre_t.num_loaded_tokens == 12 and pre_t.num_failed_blocks == 0
    for rid, prompt in reqs.items():
        assert pair.shipped[rid] == -(-len(prompt) // BS) - pair.cached[rid] // BS, rid
    assert pair.pre.sched.results.num_computed_tokens < sum(len(p) for p in reqs.values())
    pair.close()


def test_a_failed_load_on_the_decode_side_is_shipped_by_the_prefill_side(tmp_path):
    root_d, root_p = str(tmp_path / "d"), str(tmp_path / "p")
    pair = Pair(None, root_d)  # the decode side saves the prompts it receives
    run(pair, {"seed": P + [7]})
    pair.close()
    pair = Pair(root_p, root_d)  # decode restarted; the prefill side's tier is empty
    # The prefix's second block is corrupt: the reservation loads the first only.
    path = os.path.join(pair.dec.disk.dir, pair.dec.chain(P)[1].hex())
    with open(path, "r+b") as f:
        f.seek(-1, os.SEEK_END)
        last = f.read(1)[0]
        f.seek(-1, os.SEEK_END)
        f.write(bytes([last ^ 0xFF]))
    run(pair, {"x": P + [9]})
    dec_t = pair.dec.tier
    assert dec_t is not None and dec_t.num_loaded_tokens == 4 and dec_t.num_failed_blocks == 2
    assert pair.cached["x"] == 4 and pair.shipped["x"] == 3  # 13 tokens: 4 blocks, 1 loaded
    pair.close()


def seeded(root: str) -> None:
    pair = Pair(root, None)
    run(pair, {"seed": P + [7]})
    pair.close()


@pytest.mark.parametrize("mover_first", [False, True])
def test_abort_mid_load_on_a_prefill_instance(tmp_path, mover_first):
    root = str(tmp_path)
    seeded(root)
    pair = Pair(root, None)  # a restart of the prefill side: P on disk, its pool empty
    pre = pair.pre
    assert pre.tier is not None
    pair.add("a", P + [8])
    pair.dec.core.poll()
    pair.route()
    pre.core.step()  # admits it: its 3 blocks load, it waits outside the batch
    a = pre.sched.requests["a"]
    assert a.status == RequestStatus.WAITING_FOR_KV and "a" in pre.tier.loading
    assert not pre.sched.has_unfinished_requests()  # held: no work for a step
    (plan,) = pre.plans
    assert isinstance(plan, TierPlan) and len(plan.loads) == 1
    if mover_first:
        pair.pump_plans(pre)  # the mover read the blocks; its report is still to come
    pre.core.abort(["a"])
    assert pre.outs[-1].req_id == "a" and pre.outs[-1].finish_reason == "abort"
    # The blocks being loaded stay held until the report; the decode side learns at once.
    assert "a" in pre.tier.orphans and pre.sched.kv.pool.num_free_blocks == NB - 3
    assert pre.sched.check_invariants() == []
    finishes = [m for m in pre.plans if isinstance(m, KVFinish)]
    assert [(f.req_id, f.token) for f in finishes] == [("a", -1)] and finishes[0].error
    n = len(pre.outs)
    pre.core.add_request(EngineRequest("a", ids_to_bytes(P), SamplingParams(max_tokens=1),
                                       time.time(), []))
    assert pre.outs[n].finish_reason == "error" and "still in the engine" in (pre.outs[n].error or "")
    pair.settle()
    (out,) = [o for o in pair.dec.outs if o.req_id == "a" and o.finish_reason]
    assert out.finish_reason == "error" and out.error_code == "kv_transfer_failed"
    assert not pre.tier.orphans and pre.tier.num_loaded_tokens == 0  # landed as an orphan
    assert_idle(pre)
    assert_idle(pair.dec)
    pair.close()


def seeded_decode(root: str) -> None:
    pair = Pair(None, root)
    run(pair, {"seed": P + [7]})
    pair.close()


def loading_reservation(pair: Pair, rid: str) -> None:
    """``rid``'s reservation made, its 3 prefix blocks loading: no KVReservation yet."""
    dec = pair.dec
    pair.add(rid, P + [8])
    dec.core.poll()
    assert dec.tier is not None and rid in dec.tier.loading
    assert isinstance(dec.part, DecodeConnector) and rid in dec.part.reservations.loading
    assert [o for o in dec.outs if o.kv is not None] == []  # the prefill side is not asked yet
    r = dec.sched.requests[rid]
    assert r.status == RequestStatus.WAITING_FOR_KV and len(r.blocks) == 4  # 13 + 1 tokens
    assert dec.sched.stats().kv_reserved_blocks == 4 and dec.sched.check_invariants() == []


@pytest.mark.parametrize("how", ["abort", "timeout"])
def test_a_decode_reservation_ending_mid_load(tmp_path, how):
    root = str(tmp_path)
    seeded_decode(root)
    pair = Pair(None, root)
    dec = pair.dec
    assert dec.tier is not None
    loading_reservation(pair, "a")
    if how == "abort":
        dec.core.abort(["a"])
    else:
        pair.clock.t += TIMEOUT
        dec.core.poll()
    (out,) = [o for o in dec.outs if o.req_id == "a"]
    assert out.finish_reason == ("abort" if how == "abort" else "error")
    if how == "timeout":
        assert out.error_code == "kv_transfer_timeout" and "KV tier" in (out.error or "")
    # No peer ever knew its blocks: nothing quarantined; those being loaded stay held.
    assert isinstance(dec.part, DecodeConnector) and not dec.part.reservations.quarantine
    assert "a" in dec.tier.orphans and dec.sched.kv.pool.num_free_blocks == NB - 3
    assert dec.sched.check_invariants() == [] and not dec.part.reservations
    pair.settle()  # the report lands: the orphan's blocks are free; no KVReservation went out
    assert not pair.routed and not pair.pre.sched.requests
    assert_idle(dec)
    # The same id again: its load lands, then its reservation goes out.
    run(pair, {"a": P + [8]})
    assert pair.cached["a"] == 12
    pair.close()


def test_composite_routes_each_hook_to_its_owner_and_sums_the_accounting(tmp_path):
    root = str(tmp_path)
    seeded_decode(root)
    pair = Pair(None, root)
    dec = pair.dec
    conn = dec.sched.connector
    assert isinstance(conn, CompositeConnector) and conn.role == "decode" and not conn.allows_async
    assert dec.sched.kv.pool.on_cached == conn.on_cached  # saves: the tier's
    loading_reservation(pair, "a")
    # A plain request on the decode instance: the loading reservation is held once (by the
    # decode part, not again by the tier), so the plain one is still work for a step.
    dec.core.add_request(EngineRequest("plain", ids_to_bytes([40, 41, 42]),
                                       SamplingParams(max_tokens=2, ignore_eos=True), time.time(), []))
    assert conn.num_held == 1 and dec.sched.has_unfinished_requests()
    stats = conn.stats()
    assert stats["kv_tier_loading_requests"] == 1 and stats["kv_reserved_blocks"] == 4
    # Requests are checked by the role (a prefill request on a decode instance) and the tier.
    n = len(dec.outs)
    dec.core.add_request(EngineRequest("p", ids_to_bytes(P), SamplingParams(max_tokens=1),
                                       time.time(), [], kv_transfer=KVTransferParams(
                                           role="prefill", peer=LISTEN, remote_req_id="p",
                                           remote_block_ids=[0, 1, 2])))
    assert "on an engine of role 'decode'" in (dec.outs[n].error or "")
    dec.core.abort(["a"])
    held = conn.held_block_ids()
    assert sum(held.values()) == 3 and conn.check() == []  # the orphan's, held by the tier
    n = len(dec.outs)
    dec.core.add_request(EngineRequest("a", ids_to_bytes(P), SamplingParams(max_tokens=1),
                                       time.time(), [], kv_transfer=KVTransferParams(role="decode")))
    assert "still in the engine" in (dec.outs[n].error or "")
    pair.settle()
    assert dec.tokens("plain") == reference([40, 41, 42], 2)
    assert_idle(dec)
    pair.close()


_op = st.one_of(
    st.tuples(st.just("add"), st.integers(0, 2), st.integers(1, 9)),
    st.tuples(st.just("abort"), st.integers(0, 7)),
    st.tuples(st.just("corrupt"), st.integers(0, 63)),
    st.tuples(st.just("tick")),
    st.tuples(st.sampled_from(["poll", "step_d", "step_p", "take_d", "take_p", "save", "report"])))


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                 HealthCheck.function_scoped_fixture])
@given(st.lists(_op, max_size=40))
def test_block_accounting_under_random_interleavings(tmp_path_factory, ops) -> None:
    """Requests added and aborted (both halves, as the router does), tier files corrupted,
    time passing (reservations and sends time out), steps, tier plans and reports delivered
    in any order on both sides of a restarted pair with P on disk: both block tables are
    sound after every operation, every request that ends well gets the worker's tokens, and
    in the end every block is free."""
    root = str(tmp_path_factory.mktemp("pdtier"))
    seeded(root)
    seeded_decode(root)
    pair = Pair(root, root)
    dec, pre = pair.dec, pair.pre
    added: list[str] = []
    for op in ops:
        if op[0] == "add":
            rid = f"q{len(added)}"
            added.append(rid)
            pair.add(rid, P[:4 * (1 + op[1])] + [60 + len(added)] * op[2])
        elif op[0] == "abort" and added:
            rid = added[op[1] % len(added)]
            for side in (dec, pre):
                if rid in side.sched.requests:
                    side.core.abort([rid])
        elif op[0] == "corrupt":
            files = sorted(f for f in os.listdir(dec.disk.dir) if not f.startswith("."))
            if files:
                with open(os.path.join(dec.disk.dir, files[op[1] % len(files)]), "r+b") as f:
                    f.seek(-1, os.SEEK_END)
                    last = f.read(1)[0]
                    f.seek(-1, os.SEEK_END)
                    f.write(bytes([last ^ 0xFF]))
        elif op[0] == "tick":
            pair.clock.t += 2.0
        elif op[0] == "poll":
            dec.core.poll()
            pre.core.poll()
            pair.route()
        elif op[0] in ("step_d", "step_p"):
            side = dec if op[0] == "step_d" else pre
            side.core.poll()  # a send past its deadline stops before the step
            if side.core.has_work():
                side.core.step()
            # Transfers go out with their step (a late write could land in blocks whose
            # quarantine ended); the tier's plans wait for "take".
            pair.pump_plans(side, take_tier=False)
        elif op[0] in ("take_d", "take_p"):
            pair.pump_plans(dec if op[0] == "take_d" else pre)
        elif op[0] == "save":
            for side in (dec, pre):
                if side.mover.saves:
                    side.mover.save_batch()
        else:
            for side in (dec, pre):
                if side.reports:
                    side.core.on_kv_message(side.reports.popleft())
        pair.route()
        assert dec.sched.check_invariants() == [] and pre.sched.check_invariants() == []
    pair.settle()
    for rid in added:
        finals = [o for o in dec.outs if o.req_id == rid and o.finish_reason]
        if finals and finals[-1].finish_reason == "length":
            assert dec.tokens(rid) == reference(pair.prompts[rid], 4), rid
    assert_idle(dec)
    assert_idle(pre)
    pair.close()
