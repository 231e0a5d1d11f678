"""Engine stage, a second KV tier (``--kv-offload-dir``): prefix blocks kept in files that
outlive the pool and the process, loaded back instead of computed again.

Owns / State: the loads in flight (per request: its blocks and keys; ``orphans``: the blocks of
a load whose request ended, held until the messager is done writing them), the saves in
flight (blocks it holds a reference on until the messager has read them) and those deferred,
the plans not sent yet, the last lookup and the counters. The files are the cache messager's
(``cache.kv_tier``); here only a ``stat`` per key says which exist (``TierIndex``).

- Saves (write-through): every block the prefix cache takes (``on_cached``: its KV computed)
  is held by one more reference and sent to the messager, which writes it unless its file
  exists; the reference drops when the messager reports the block read. Saving at compute
  time rather than at eviction means a block is on disk by the time the pool evicts it, with
  no step ever waiting for a write, and a restart or a second instance finds it; on a 2-core
  CPU the write costs the messager ~45 us per block (docs/kv_tier.md). At most
  MAX_SAVING_SHARE of the pool is held so; blocks cached beyond it wait unheld
  (``deferred``) and are taken as saves finish, unless the pool evicted them first.
- Loads: at admission, the request's chain keys beyond the pool's hit are looked up; its
  blocks are taken (``update_state_after_alloc``) and it waits outside the batch
  (WAITING_FOR_KV) until the messager reports how many leading blocks arrived intact; those
  count as computed (and enter the prefix cache), the rest are computed again. A request whose
  next key is being loaded for another one waits for it to land (then it is a pool hit), so
  32 requests sharing a prefix read it once. A request aborted while its load is in flight
  leaves its blocks held (``orphans``) until the report; its id is refused until then, as the
  report names the load by request id.
- Preemption recomputes nothing the tier holds: a preempted request's full blocks were saved
  when computed, so its re-admission is a pool hit or a tier load (docs/kv_tier.md: the rule).
- A load for another connector (``landed``: a decode-role reservation, ``composite``) lands
  the same way, then goes to that callback instead of back to the queue: that connector holds
  (and counts) the request, the tier only its load.
"""
from __future__ import annotations

import time
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from pipeline.engine.block_pool import KVBlock
from pipeline.engine.kv_connector.base import KVConnector
from pipeline.engine.kv_connector.tier_index import TierIndex
from pipeline.engine.request import Request, RequestStatus
from pipeline.messages import EngineOutput, EngineRequest
from pipeline.messages.kv_layout import KVLayout
from pipeline.messages.kv_tier import TierLoad, TierPlan, TierReport, bytes_ids, ids_bytes

if TYPE_CHECKING:
    from pipeline.engine.scheduler import Scheduler

# Keys one TierPlan carries at most (~23 bytes each): far below the kv_plans ring's messages.
MAX_PLAN_KEYS = 16384
LOOKUP_TTL_S = 1.0  # how long a request's lookup stands while it waits for admission
# Blocks held for saves at most, as a share of the pool: past it a newly cached block waits
# (``deferred``, no reference held) for a save to finish, and one the pool evicts meanwhile
# is not saved (counted): a slow or full disk costs the tier hits, never the batch its blocks.
MAX_SAVING_SHARE = 0.25

# What a load for another connector calls once it landed (the request's computed tokens and
# cached blocks updated): that connector's outputs.
Landed = Callable[[Request, int], list[EngineOutput]]


@dataclass(slots=True)
class _Load:
    req: Request
    blocks: list[KVBlock]
    keys: list[bytes]
    landed: Landed | None = None
    t0: float = field(default_factory=time.monotonic)


class TierConnector(KVConnector):
    role = "tier"
    saves_cached = True
    allows_async = True  # loads and saves follow confirmed state; nothing runs ahead of them

    def __init__(self, sched: Scheduler, root: str, layout: KVLayout) -> None:
        super().__init__(sched)
        self.index = TierIndex(root, layout)
        self.bs = sched.block_size
        self.loading: dict[str, _Load] = {}
        self.orphans: dict[str, _Load] = {}
        self.loading_keys: dict[bytes, str] = {}  # key -> the request loading it
        self.saving: dict[int, KVBlock] = {}  # block id -> block (one reference held)
        self.deferred: deque[tuple[KVBlock, bytes]] = deque()  # cached past max_saving, no reference
        self.resumed: set[str] = set()  # loaded, waiting for admission with their blocks
        self._loads: list[TierLoad] = []
        self._save_ids: list[int] = []
        self._save_keys: list[bytes] = []
        self._looked: tuple[str, int, int, int, float] | None = None  # the last lookup
        self._landing = False  # a load's blocks entering the cache: on disk already
        self.num_hit_tokens = self.num_loaded_tokens = self.num_failed_blocks = 0
        self.num_load_bytes = self.num_saved_blocks = self.num_save_bytes = 0
        self.load_seconds = self.save_seconds = self.load_wait_seconds = 0.0
        self.num_load_waits = self.num_save_skipped = 0
        self.num_lent = 0  # loads in flight whose request another connector holds
        self.max_saving = max(1, int(MAX_SAVING_SHARE * sched.kv.pool.num_blocks))

    def check_request(self, er: EngineRequest, req_ids: set[str], num_prompt: int) -> None:
        self.check_ids(req_ids)
        super().check_request(er, req_ids, num_prompt)

    def check_ids(self, req_ids: set[str]) -> None:
        for rid in req_ids:
            if rid in self.orphans:  # its load's report must free only that load's blocks
                raise ValueError(f"request id {rid!r} is still in the engine: the KV tier load "
                                 f"of its aborted request is in flight")

    # -- saves -----------------------------------------------------------------------------
    def on_cached(self, block: KVBlock) -> None:
        if self._landing or block.block_id in self.saving:
            return
        assert block.block_hash is not None
        if len(self.saving) >= self.max_saving:
            # One prefill step caches up to its token budget's blocks at once (128 on a
            # 2048-token step): skipping them would leave holes in the chains, every later
            # block unreachable. They wait instead, holding nothing.
            self.deferred.append((block, block.block_hash))
            if len(self.deferred) > self.sched.kv.pool.num_blocks:  # stale entries, bounded
                self.deferred.popleft()
                self.num_save_skipped += 1
            return
        self._save(block)

    def _save(self, block: KVBlock) -> None:
        assert block.block_hash is not None
        self.sched.kv.pool.touch([block])  # the messager reads it: no step may reuse it
        self.saving[block.block_id] = block
        self._save_ids.append(block.block_id)
        self._save_keys.append(block.block_hash)

    # -- loads -----------------------------------------------------------------------------
    def get_num_new_matched_tokens(self, req: Request, num_computed: int) -> int:
        i0 = num_computed // self.bs
        limit = min(len(req.block_hashes), (req.num_tokens - 1) // self.bs)
        if i0 >= limit:
            return 0
        keys = req.block_hashes[i0:limit]
        if keys[0] in self.loading_keys:
            return -1
        # A queue head that cannot be admitted is asked again every step: its stats once a
        # LOOKUP_TTL_S (a file gone since is a failed load, one added a later hit).
        now = time.monotonic()
        memo = self._looked
        if memo is not None and memo[:3] == (req.req_id, i0, limit) and now - memo[4] < LOOKUP_TTL_S:
            n = memo[3]
        else:
            n = self.index.lookup(keys)
            self._looked = (req.req_id, i0, limit, n, now)
        for i in range(n):  # another request's load covers the rest: take only up to it
            if keys[i] in self.loading_keys:
                n = i
                break
        return n * self.bs

    def update_state_after_alloc(self, req: Request, blocks: list[KVBlock], num_external: int,
                                 landed: Landed | None = None) -> None:
        """``landed``: the load is another connector's (it holds the request): called once
        the load is in, instead of handing the request back to the queue."""
        n = num_external // self.bs
        i0 = req.num_computed_tokens // self.bs
        keys = req.block_hashes[i0:i0 + n]
        assert len(blocks) == n == len(keys), (len(blocks), n, len(keys))
        self.loading[req.req_id] = _Load(req, list(blocks), list(keys), landed)
        self.num_lent += landed is not None
        for k in keys:
            self.loading_keys[k] = req.req_id
        self._loads.append(TierLoad(req.req_id, ids_bytes([b.block_id for b in blocks]), list(keys)))
        self.num_hit_tokens += num_external

    # -- to and from the cache messager ----------------------------------------------------
    def take_kv_finishes(self) -> list[Any]:
        """The TierPlans owed to the messager: loads first, each plan within MAX_PLAN_KEYS."""
        plans: list[Any] = []
        loads, self._loads = self._loads, []
        while loads:
            batch: list[TierLoad] = []
            n = 0
            while loads and (not batch or n + len(loads[0].keys) <= MAX_PLAN_KEYS):
                n += len(loads[0].keys)
                batch.append(loads.pop(0))
            plans.append(TierPlan(batch, b"", []))
        ids, keys = self._save_ids, self._save_keys
        self._save_ids, self._save_keys = [], []
        for i in range(0, len(ids), MAX_PLAN_KEYS):
            plans.append(TierPlan([], ids_bytes(ids[i:i + MAX_PLAN_KEYS]), keys[i:i + MAX_PLAN_KEYS]))
        return plans

    def on_message(self, msg: Any) -> list[EngineOutput]:
        if not isinstance(msg, TierReport):
            return super().on_message(msg)
        pool = self.sched.kv.pool
        for bid in bytes_ids(msg.saved_block_ids):
            b = self.saving.pop(bid, None)
            if b is not None:
                pool.free_blocks([b])
        while self.deferred and len(self.saving) < self.max_saving:
            b, h = self.deferred.popleft()
            if b.block_hash != h:  # evicted before its turn (maybe cached again: saved then)
                self.num_save_skipped += 1
            elif b.block_id not in self.saving:
                self._save(b)
        self.num_saved_blocks += msg.num_written
        self.num_save_bytes += msg.bytes_written
        self.save_seconds += msg.save_seconds
        outs: list[EngineOutput] = []
        for ld in msg.loaded:
            outs += self._land(ld.req_id, ld.num_ok)
            self.num_load_bytes += ld.bytes
            self.load_seconds += ld.seconds
        return outs

    def _land(self, req_id: str, num_ok: int) -> list[EngineOutput]:
        orphan = self.orphans.pop(req_id, None)
        load = self.loading.pop(req_id, None) if orphan is None else orphan
        if load is None:
            return []
        for k in load.keys:
            if self.loading_keys.get(k) == req_id:
                del self.loading_keys[k]
        if orphan is not None:  # its request ended: the messager is done with the blocks
            self.sched.kv.pool.free_blocks(reversed(orphan.blocks))
            return []
        self.num_lent -= load.landed is not None
        req, n = load.req, len(load.blocks)
        num_ok = max(0, min(num_ok, n))
        self.num_failed_blocks += n - num_ok
        self.num_loaded_tokens += num_ok * self.bs
        self.num_hit_tokens -= (n - num_ok) * self.bs
        self.num_load_waits += 1
        self.load_wait_seconds += time.monotonic() - load.t0
        req.num_computed_tokens += num_ok * self.bs
        req.num_cached_tokens -= (n - num_ok) * self.bs
        self._landing = True
        try:
            self.sched.kv.cache_computed_blocks(req)
        finally:
            self._landing = False
        if load.landed is not None:
            return load.landed(req, num_ok)
        self.resumed.add(req_id)
        self.sched.resume(req)
        return []

    # -- leaving ---------------------------------------------------------------------------
    def detach(self, req: Request) -> bool:
        load = self.loading.pop(req.req_id, None)
        if load is None:
            return False
        # The messager may be writing into the blocks it loads: they stay held until its
        # report; the request's other blocks (its pool hit, the rest) are freed with it.
        targets = {b.block_id for b in load.blocks}
        self.num_lent -= load.landed is not None
        self.orphans[req.req_id] = load
        req.blocks = [b for b in req.blocks if b.block_id not in targets]
        req.num_cached_blocks = 0
        return True

    def request_finished(self, req: Request, why: str) -> None:
        self.resumed.discard(req.req_id)

    def on_preempt(self, req: Request) -> None:
        self.resumed.discard(req.req_id)

    # -- accounting ------------------------------------------------------------------------
    @property
    def num_held(self) -> int:
        """Its own loads' requests (another connector counts those it lent a load)."""
        return len(self.loading) - self.num_lent

    def may_hold_blocks(self, req: Request) -> bool:
        st = req.status
        return (st == RequestStatus.RUNNING or st == RequestStatus.WAITING_FOR_KV
                or (st == RequestStatus.WAITING and req.req_id in self.resumed))

    def held_block_ids(self) -> Counter[int]:
        # One reference per saving block (Counter(dict) would take its values as counts).
        held: Counter[int] = Counter(self.saving.keys())
        for load in self.orphans.values():
            held.update(b.block_id for b in load.blocks)
        return held

    def check(self) -> list[str]:
        errs = [f"loading request {rid} is {ld.req.status.name}" for rid, ld in self.loading.items()
                if ld.req.status != RequestStatus.WAITING_FOR_KV]
        errs += [f"saving block {bid} has ref_cnt 0" for bid, b in self.saving.items() if b.ref_cnt < 1]
        return errs

    def stats(self) -> dict[str, int | float]:
        return {"kv_tier_hit_tokens": self.num_hit_tokens,
                "kv_tier_loaded_tokens": self.num_loaded_tokens,
                "kv_tier_failed_blocks": self.num_failed_blocks,
                "kv_tier_load_bytes": self.num_load_bytes,
                "kv_tier_load_seconds": self.load_seconds,
                "kv_tier_load_waits": self.num_load_waits,
                "kv_tier_load_wait_seconds": self.load_wait_seconds,
                "kv_tier_saved_blocks": self.num_saved_blocks,
                "kv_tier_save_bytes": self.num_save_bytes,
                "kv_tier_save_seconds": self.save_seconds,
                "kv_tier_saving_blocks": len(self.saving),
                "kv_tier_deferred_blocks": len(self.deferred),
                "kv_tier_save_skipped": self.num_save_skipped,
                "kv_tier_loading_requests": len(self.loading)}
