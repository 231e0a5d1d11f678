"""The KV connector's hooks carry a second KV tier (issue 26 builds the real one): a tier kept
in a dict, written here by hand against the hooks, saves each block as the prefix cache takes
it and loads hits beyond the pool's own back into freshly allocated blocks while the batch
runs. The FakeWorker checks every KV slot's fingerprint before it samples, so a block loaded
into the wrong place, or a request resumed before its load landed, fails inside the worker.
"""
from __future__ import annotations

import time

from pipeline.config import EngineConfig
from pipeline.engine.block_pool import KVBlock
from pipeline.engine.core import EngineCore, LocalExecutor
from pipeline.engine.fake_worker import FakeWorker
from pipeline.engine.kv_connector.base import KVConnector
from pipeline.engine.request import Request, RequestStatus
from pipeline.engine.scheduler import Scheduler
from pipeline.messages import EngineOutput, EngineRequest, ids_to_bytes
from pipeline.sampling_params import SamplingParams

BS, BLOCKS, MAX_LEN, VOCAB = 4, 16, 64, 50


class DictTier(KVConnector):
    role = "tier"
    saves_cached = True

    def __init__(self, sched: Scheduler, worker: FakeWorker, store: dict[bytes, list[int]]) -> None:
        super().__init__(sched)
        self.worker, self.store = worker, store
        self.loading: dict[str, tuple[Request, int]] = {}

    def on_cached(self, block: KVBlock) -> None:
        assert block.block_hash is not None and self.worker.kv is not None
        lo = block.block_id * BS
        self.store[block.block_hash] = self.worker.kv[lo:lo + BS]

    def get_num_new_matched_tokens(self, req: Request, num_computed: int) -> int:
        n = 0
        for h in req.block_hashes[num_computed // BS:]:
            if h not in self.store:
                break
            n += BS
        return n

    def update_state_after_alloc(self, req: Request, blocks: list[KVBlock], num_external: int) -> None:
        assert req.status == RequestStatus.WAITING_FOR_KV
        self.loading[req.req_id] = (req, num_external)

    def land(self) -> None:
        """The loads complete: the blocks' KV written, the requests handed back."""
        kv = self.worker.kv
        assert kv is not None
        for req, n_ext in self.loading.values():
            first = req.num_computed_tokens // BS
            for i in range(first, first + n_ext // BS):
                b = req.blocks[i].block_id
                kv[b * BS:(b + 1) * BS] = self.store[req.block_hashes[i]]
            req.num_computed_tokens += n_ext
            self.sched.kv.cache_computed_blocks(req)
            self.sched.resume(req)
        self.loading.clear()

    @property
    def num_held(self) -> int:
        return len(self.loading)

    def may_hold_blocks(self, req: Request) -> bool:
        return req.status in (RequestStatus.RUNNING, RequestStatus.WAITING_FOR_KV)


def rig():
    worker = FakeWorker(BLOCKS, BS, MAX_LEN, VOCAB, [], check_kv=True)
    store: dict[bytes, list[int]] = {}
    cfg = EngineConfig.of(max_num_seqs=4, max_num_batched_tokens=64, enable_prefix_caching=True)
    sched = Scheduler(cfg, BLOCKS, BS, MAX_LEN, hash_key=b"t",
                      connector=lambda s: DictTier(s, worker, store))
    outs: list[EngineOutput] = []
    core = EngineCore(sched, LocalExecutor(worker), outs.extend)
    return sched, worker, store, core, outs


def add(core: EngineCore, rid: str, prompt: list[int], max_tokens: int = 4) -> None:
    core.add_request(EngineRequest(rid, ids_to_bytes(prompt), SamplingParams(
        max_tokens=max_tokens, ignore_eos=True), time.time(), []))


def tokens(outs: list[EngineOutput], rid: str) -> list[int]:
    return [t for o in outs if o.req_id == rid for t in o.new_token_ids]


def reference(worker: FakeWorker, prompt: list[int], n: int) -> list[int]:
    toks = list(prompt)
    for _ in range(n):
        toks.append(worker.next_token(toks))
    return toks[len(prompt):]


def test_cached_blocks_are_saved_and_loaded_back_while_the_batch_runs():
    sched, worker, store, core, outs = rig()
    conn = sched.connector
    assert isinstance(conn, DictTier)
    a = list(range(1, 18))  # 17 tokens: 4 full blocks
    add(core, "a", a)
    core.run_until_done()
    assert tokens(outs, "a") == reference(worker, a, 4) and len(store) >= 4
    # Other prompts take the whole pool: a's cached blocks are evicted (the tier has them).
    for k in range(3):
        add(core, f"x{k}", [20 + k] * 17)
    core.run_until_done()
    assert sched.kv.pool.num_evictions >= 4 and len(store) >= 4
    # a again, beside a running request: its blocks come from the tier, not from a prefill.
    add(core, "b", [40] * 9, max_tokens=8)
    core.step()  # b runs
    add(core, "a2", a)
    computed_before = sched.results.num_computed_tokens
    core.step()
    a2 = sched.requests["a2"]
    assert a2.status == RequestStatus.WAITING_FOR_KV and a2.num_cached_tokens == 16
    assert sched.running == [sched.requests["b"]]  # the load delays nothing running
    assert sched.results.num_computed_tokens == computed_before + 1  # b's decode token alone
    assert sched.has_unfinished_requests()  # b still runs
    conn.land()
    core.run_until_done()
    assert tokens(outs, "a2") == reference(worker, a, 4)
    assert tokens(outs, "b") == reference(worker, [40] * 9, 8)
    assert sched.check_invariants() == [] and not sched.requests
    assert sched.kv.pool.num_free_blocks == BLOCKS


def test_a_request_held_for_its_load_is_no_work_for_a_step_until_it_lands():
    sched, worker, store, core, outs = rig()
    conn = sched.connector
    assert isinstance(conn, DictTier)
    a = list(range(1, 10))  # 2 full blocks
    add(core, "a", a)
    core.run_until_done()
    for k in range(4):
        add(core, f"x{k}", [20 + k] * 13)
    core.run_until_done()
    assert sched.kv.pool.num_evictions >= 2 and len(store) >= 2
    add(core, "a2", a, max_tokens=2)
    core.step()
    assert conn.num_held == 1 and not sched.has_unfinished_requests() and not core.has_work()
    assert sched.check_invariants() == []
    conn.land()
    core.run_until_done()
    assert tokens(outs, "a2") == reference(worker, a, 2)
    assert sched.check_invariants() == [] and sched.kv.pool.num_free_blocks == BLOCKS
