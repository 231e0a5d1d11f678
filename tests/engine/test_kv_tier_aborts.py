"""The KV disk tier's engine side under aborts (issue 26): the real TierConnector and
TierMover over a DiskTier, the mover driven by hand so a report lands exactly when a test says.
The FakeWorker's KV fingerprints live in the numpy pool the mover saves and loads, so a block
loaded into the wrong place, or used before its load landed, fails inside the worker; the
block-table audit runs around every report.
"""
from __future__ import annotations

import os
import shutil
import tempfile
import time
from collections import deque
from typing import Any

import numpy as np
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from pipeline.cache.kv_tier.mover import TierMover
from pipeline.cache.kv_tier.store import DiskTier
from pipeline.config import EngineConfig
from pipeline.engine.core import EngineCore, LocalExecutor
from pipeline.engine.fake_worker import FakeWorker
from pipeline.engine.kv_connector.tier import TierConnector
from pipeline.engine.kv_connector.tier_index import tier_hash_key
from pipeline.engine.request import RequestStatus
from pipeline.engine.scheduler import Scheduler
from pipeline.messages import EngineOutput, EngineRequest, ids_to_bytes
from pipeline.messages.kv_layout import KVLayout
from pipeline.messages.kv_tier import TierReport
from pipeline.sampling_params import SamplingParams

BS, NB, MAX_LEN, VOCAB = 4, 16, 64, 50
# One layer whose K rows are a block's BS fingerprints (uint64): 4 tokens x 4 x float16 = 32 bytes.
LAY = KVLayout(num_layers=1, num_blocks=NB, block_size=BS, num_kv_heads=1, head_dim=4,
               dtype="float16", model_hash="fake worker")


class Rig:
    """An engine with a TierConnector; its messages to the mover queue in ``plans`` and the
    mover's reports in ``reports`` until a test delivers them."""

    def __init__(self, root: str) -> None:
        self.pool = LAY.pool(np.zeros(LAY.total_bytes, np.uint8))
        self.worker = FakeWorker(NB, BS, MAX_LEN, VOCAB, [], check_kv=True)
        self.worker.kv = self.pool[0, 0].reshape(-1).view(np.uint64)  # type: ignore[assignment]
        cfg = EngineConfig.of(max_num_seqs=4, max_num_batched_tokens=64, enable_prefix_caching=True)
        self.sched = Scheduler(cfg, NB, BS, MAX_LEN, tier_hash_key(root),
                               connector=lambda s: TierConnector(s, root, LAY))
        conn = self.sched.connector
        assert isinstance(conn, TierConnector)
        self.conn = conn
        self.plans: deque[Any] = deque()
        self.reports: deque[TierReport] = deque()
        self.tier = DiskTier(root, 1 << 20, LAY)
        self.mover = TierMover(self.tier, self.pool, lambda _t: None, self.reports.append)
        self.outs: list[EngineOutput] = []
        self.core = EngineCore(self.sched, LocalExecutor(self.worker), self.outs.extend,
                               send_kv=self._send)

    def _send(self, plan: Any) -> None:
        self.plans.append(plan)

    def add(self, rid: str, prompt: list[int], max_tokens: int = 4) -> None:
        self.core.add_request(EngineRequest(rid, ids_to_bytes(prompt), SamplingParams(
            max_tokens=max_tokens, ignore_eos=True), time.time(), []))

    def mover_takes(self) -> None:
        """The mover takes every plan sent: loads done and reported, saves queued."""
        while self.plans:
            self.mover.take(self.plans.popleft())

    def land(self) -> None:
        """The engine takes every report (audited before each)."""
        while self.reports:
            assert self.sched.check_invariants() == []
            self.core.on_kv_message(self.reports.popleft())

    def settle(self, max_rounds: int = 10_000) -> None:
        """Run until no request, plan, save or report is left (bounded: a stall fails)."""
        for _ in range(max_rounds):
            self.mover_takes()
            self.mover.drain()
            self.land()
            stepped = self.core.step() if self.core.has_work() else False
            if not (stepped or self.plans or self.reports or self.sched.requests):
                return
        raise AssertionError(f"stalled: {list(self.sched.requests)} left")

    def tokens(self, rid: str, since: int = 0) -> list[int]:
        return [t for o in self.outs[since:] if o.req_id == rid for t in o.new_token_ids]

    def assert_idle(self) -> None:
        c = self.conn
        assert self.sched.check_invariants() == [] and not self.sched.requests
        assert not (c.loading or c.orphans or c.saving or c.loading_keys or c.resumed)
        assert all(b.ref_cnt == 0 for b in self.sched.kv.pool.blocks)
        assert self.sched.kv.pool.num_free_blocks == NB


def reference(prompt: list[int], n: int) -> list[int]:
    worker, toks = FakeWorker(vocab_size=VOCAB), list(prompt)
    for _ in range(n):
        toks.append(worker.next_token(toks))
    return toks[len(prompt):]


A = list(range(1, 18))  # 17 tokens: 4 full blocks, all 4 loadable
B = list(range(30, 43))  # 13 tokens: 3 loadable


def seeded(root: str) -> None:
    """A and B on disk (a first instance computed and saved them)."""
    rig = Rig(root)
    rig.add("a", A)
    rig.add("b", B)
    rig.settle()
    assert rig.tokens("a") == reference(A, 4) and rig.tokens("b") == reference(B, 4)
    rig.assert_idle()
    assert rig.conn.num_saved_blocks >= 4 + 3
    rig.tier.close()


def test_abort_while_a_load_is_in_flight(tmp_path) -> None:
    for mover_first in (False, True):  # the load read before the abort, or after it
        root = str(tmp_path / str(mover_first))
        seeded(root)
        rig = Rig(root)  # a restart: the pool is empty, A is on disk
        rig.add("a2", A)
        rig.add("w", A)  # the same chain: waits while a2's load is in flight
        rig.core.step()
        a2, w = rig.sched.requests["a2"], rig.sched.requests["w"]
        # 4 blocks loading, and the 5th for the token it computes once they are in.
        assert a2.status == RequestStatus.WAITING_FOR_KV and len(a2.blocks) == 5
        assert len(rig.conn.loading["a2"].blocks) == 4
        assert w.status == RequestStatus.WAITING and not w.blocks
        assert len(rig.plans) == 1 and rig.sched.check_invariants() == []
        if mover_first:
            rig.mover_takes()
        rig.core.abort(["a2"])
        assert rig.outs[-1].req_id == "a2" and rig.outs[-1].finish_reason == "abort"
        # The 4 blocks being loaded stay held (the mover may be writing into them until its
        # report); its 5th block is freed with it.
        assert rig.conn.orphans and rig.sched.kv.pool.num_free_blocks == NB - 4
        assert rig.sched.check_invariants() == []
        rig.core.step()  # w still waits: a2's keys are being loaded
        assert w.status == RequestStatus.WAITING and not w.blocks
        rig.mover_takes()
        rig.land()
        assert rig.sched.check_invariants() == [] and not rig.conn.orphans
        rig.settle()
        assert rig.tokens("w") == reference(A, 4)
        # w loaded the chain itself once the orphan's load was done with.
        assert rig.conn.num_loaded_tokens == 16 and rig.conn.num_failed_blocks == 0
        rig.assert_idle()
        rig.tier.close()


def test_an_id_whose_aborted_load_is_in_flight_is_refused_until_it_lands(tmp_path) -> None:
    root = str(tmp_path)
    seeded(root)
    rig = Rig(root)
    rig.add("x", A)
    rig.core.step()
    rig.core.abort(["x"])  # its load's report is still to come
    n = len(rig.outs)
    rig.add("x", B)  # the same id again, another chain on disk
    # Its report would be taken for the orphan's (and a second abort would lose the first
    # orphan's blocks): refused while the messager may still write into them.
    (err,) = rig.outs[n:]
    assert err.req_id == "x" and err.finish_reason == "error" and "x" in (err.error or "")
    assert "x" not in rig.sched.requests and rig.sched.check_invariants() == []
    rig.mover_takes()
    rig.land()
    rig.add("x", B)  # landed: the id is free again
    rig.settle()
    assert rig.tokens("x", n + 1) == reference(B, 4)
    rig.assert_idle()
    rig.tier.close()


X = list(range(1, 34))  # 33 tokens: 8 loadable blocks, 9 for the prompt
Y = list(range(34, 50)) + list(range(1, 18))  # another chain as long


def test_loads_never_take_the_pool_from_the_rest_of_their_prompts(tmp_path) -> None:
    """Two requests whose loaded blocks alone fill the pool (8 + 8 of 16), each with one
    token to compute after: admission takes the blocks of a load's whole prompt, so the
    second waits in the queue instead of holding 8 blocks that leave the first none."""
    root = str(tmp_path)
    rig = Rig(root)
    rig.add("x", X)
    rig.settle()
    rig.add("y", Y)
    rig.settle()
    # 9 full blocks a chain (prompt and output), cached 8 at once by one step: more than
    # the quarter of the pool held for saves, the rest deferred, none skipped.
    assert rig.conn.num_saved_blocks == 18 and rig.conn.num_save_skipped == 0
    rig.assert_idle()
    rig.tier.close()
    rig = Rig(root)  # a restart: both chains on disk, the pool empty
    rig.add("x", X)
    rig.add("y", Y)
    rig.core.step()
    x, y = rig.sched.requests["x"], rig.sched.requests["y"]
    assert x.status == RequestStatus.WAITING_FOR_KV and len(x.blocks) == 9
    assert y.status == RequestStatus.WAITING and not y.blocks
    rig.settle()
    assert rig.tokens("x") == reference(X, 4) and rig.tokens("y") == reference(Y, 4)
    assert rig.conn.num_loaded_tokens == 2 * 32 and rig.conn.num_failed_blocks == 0
    rig.assert_idle()
    rig.tier.close()


_PREFIXES = [[1 + 10 * p + i for i in range(8)] for p in range(3)]  # 2 blocks each
_SEEDED: list[str] = []  # a directory of those prefixes' chains, made once


def _prompt(p: int, s: int, n: int) -> list[int]:
    return _PREFIXES[p] + [100 + s] * n


def _seeded_copy(dst: str) -> None:
    """``dst``: a copy of a tier holding every prefix with both suffixes (5 blocks a chain)."""
    if not _SEEDED:
        root = tempfile.mkdtemp(prefix="kv-tier-seed-")
        rig = Rig(root)
        for p in range(3):
            for s in range(2):
                rig.add(f"s{p}{s}", _prompt(p, s, 9), 6)
        rig.settle()
        rig.tier.close()
        _SEEDED.append(root)
    shutil.copytree(_SEEDED[0], dst, dirs_exist_ok=True)


def teardown_module() -> None:
    for d in _SEEDED:
        shutil.rmtree(d, ignore_errors=True)


_op = st.one_of(
    st.tuples(st.sampled_from(["add", "readd"]), st.integers(0, 2), st.integers(0, 2),
              st.integers(1, 9), st.integers(1, 6)),
    st.tuples(st.just("abort"), st.integers(0, 7)),
    st.tuples(st.just("corrupt"), st.integers(0, 63)),
    st.tuples(st.sampled_from(["step", "step", "take", "save", "report"])))


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(_op, max_size=50))
# An id aborted during its load, added again and aborted during its second load, before the
# first report: the case the TierConnector refuses (the second orphan would replace the first).
@example([("add", 0, 0, 9, 4), ("step",), ("abort", 1), ("readd", 1, 0, 9, 4), ("step",),
          ("abort", 1), ("take",), ("report",), ("report",)])
def test_block_accounting_under_random_interleavings(ops) -> None:
    """Adds (of chains on disk), aborts (ids reused after one), files corrupted, steps, and
    the mover taking plans, writing saves and reporting, in any order: the block table is
    sound after every one, every request not aborted gets the worker's tokens from the KV it
    was given, and in the end every block is free."""
    with tempfile.TemporaryDirectory() as root:
        _seeded_copy(root)
        rig = Rig(root)  # a restart on the seeded directory: an empty pool
        # (id, prompt, max_tokens, first output index, whether it was aborted or refused)
        runs: list[list[Any]] = []
        aborted: list[str] = []
        for op in ops:
            if op[0] in ("add", "readd"):
                _, p, s, n, max_tokens = op
                rid = aborted.pop() if op[0] == "readd" and aborted else f"q{len(runs)}"
                prompt = _prompt(p, s, n)
                runs.append([rid, prompt, max_tokens, len(rig.outs), False])
                rig.add(rid, prompt, max_tokens)
                if rig.outs[runs[-1][3]:]:  # refused at once: an id still in the engine
                    assert rig.outs[-1].finish_reason == "error"
                    runs[-1][4] = True
            elif op[0] == "abort":
                live = sorted(rig.sched.requests)
                loading = sorted(rig.conn.loading)  # aborts there half the time: orphans
                if loading and op[1] % 2:
                    live = loading
                if live:
                    rid = live[op[1] % len(live)]
                    rig.core.abort([rid])
                    aborted.append(rid)
                    next(r for r in reversed(runs) if r[0] == rid)[4] = True
            elif op[0] == "corrupt":
                files = sorted(os.listdir(rig.tier.dir))
                if files:  # a flipped payload byte: its load fails, the rest is recomputed
                    with open(os.path.join(rig.tier.dir, files[op[1] % len(files)]), "r+b") as f:
                        f.seek(-1, os.SEEK_END)
                        last = f.read(1)[0]
                        f.seek(-1, os.SEEK_END)
                        f.write(bytes([last ^ 0xFF]))
            elif op[0] == "step":
                if rig.core.has_work():
                    rig.core.step()
            elif op[0] == "take":
                if rig.plans:
                    rig.mover.take(rig.plans.popleft())
            elif op[0] == "save":
                if rig.mover.saves:
                    rig.mover.save_batch()
            elif rig.reports:
                rig.core.on_kv_message(rig.reports.popleft())
            assert rig.sched.check_invariants() == []
        rig.settle()
        for rid, prompt, max_tokens, since, gone in runs:
            if not gone:
                assert rig.tokens(rid, since) == reference(prompt, max_tokens), rid
        rig.assert_idle()
        rig.tier.close()
