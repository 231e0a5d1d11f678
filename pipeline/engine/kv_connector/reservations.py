"""Engine stage, decode role: the reservations of requests whose prompt's KV comes from a
prefill instance, and the quarantine of blocks a peer may still write. Held by the
``DecodeConnector``; takes or gives back blocks only through the KVCacheManager / BlockPool.

Owns / State:
- ``Reservations`` (decode role): requests waiting for their prompt's KV, each with a deadline
  (arrival at the engine + kv_transfer_timeout on an injectable monotonic clock): ``queued``
  (FCFS, no blocks yet) then ``reserved`` (holding blocks for the whole prompt plus the first
  decode token's slot, so a request whose KV arrived never needs a block to join the batch),
  both in arrival order, so deadlines are ordered too. With a KV tier, a request whose prompt
  blocks beyond the pool's hit are on disk holds its blocks in ``loading`` first, while they
  load, and is reserved (its KVReservation made) once they are in, counting them as cached:
  the prefill instance sends none of them. And the ``quarantine``: once a
  KVReservation went out, a prefill instance may be writing into its blocks (ipc: straight
  into this instance's KV segment; tcp: through this instance's cache messager) until it
  says "done" (a KVReady, ok or not: the prefill messager sends it after the request's last
  write, and ring / ZMQ order lets nothing of that request follow it). A reserved request
  that is aborted or times out is answered at once, but the blocks the peer may write (the
  KVReservation's, from its prefix-hit boundary on) stay held under its request id until
  that KVReady, or until a quarantine deadline (set aside + QUARANTINE_S, at most
  kv_transfer_timeout: the router aborts both halves at once, so a live prefill side answers
  its abort with that KVReady within a step; no KVReady by then means it is gone or never got
  the request, and the deadline only bounds writes already on their way). They are never handed out nor counted
  free; ``EngineStats.kv_reserved_blocks`` counts them with the reserved requests' blocks,
  so 0 still means "nothing held for a peer". A new request may not take a quarantined id
  (``Scheduler.add_request`` refuses it), so a late KVReady can free only its own blocks.
"""
from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Callable
from typing import TYPE_CHECKING

from pipeline.engine.block_pool import KVBlock
from pipeline.engine.kv_cache_manager import KVCacheManager
from pipeline.engine.request import Request, RequestStatus
from pipeline.messages import EngineOutput
from pipeline.messages.kv import KVReservation

if TYPE_CHECKING:
    from pipeline.engine.kv_connector.tier import Landed, TierConnector

logger = logging.getLogger(__name__)


# The longest a reservation's blocks stay held after it ended without a KVReady (see above).
QUARANTINE_S = 5.0


def reserve_tokens(req: Request) -> int:
    """KV slots a decode-role reservation holds: the prompt, plus the first decode token's
    (the KV of the token the prefill instance samples) unless that token is the last one."""
    return req.num_prompt_tokens + (1 if req.sampling_params.max_tokens > 1 else 0)


class Reservations:
    """Decode role: requests queued for blocks or holding them while their KV is on its way,
    and the blocks of reservations that ended before their KV did (the quarantine)."""

    def __init__(self, kv: KVCacheManager, timeout_s: float, clock: Callable[[], float]) -> None:
        self.kv = kv
        self.timeout_s = timeout_s
        self.clock = clock
        # Both in arrival order: reservations are made FCFS (never skipping the head).
        self.queued: dict[str, Request] = {}
        self.reserved: dict[str, Request] = {}
        self.loading: dict[str, Request] = {}  # holding blocks, their tier hits loading
        self.deadlines: dict[str, float] = {}
        # Request id -> (blocks a peer may still write, deadline); in the order set aside, so
        # deadlines are ordered too.
        self.quarantine: dict[str, tuple[list[KVBlock], float]] = {}
        self.num_quarantined_blocks = 0
        self.num_timeouts = 0
        self.num_quarantine_expired = 0  # released at their deadline, without a KVReady

    def __len__(self) -> int:
        """Live reservations (queued, loading or reserved); the quarantine holds no request."""
        return len(self.queued) + len(self.loading) + len(self.reserved)

    @property
    def num_reserved_blocks(self) -> int:
        """Blocks held for a peer: the reserved (and loading) requests' and the quarantined ones."""
        return (sum(len(r.blocks) for d in (self.reserved, self.loading) for r in d.values())
                + self.num_quarantined_blocks)

    def add(self, req: Request) -> None:
        req.status = RequestStatus.WAITING_FOR_KV
        self.deadlines[req.req_id] = self.clock() + self.timeout_s
        self.queued[req.req_id] = req

    def reserve(self, headroom: int, tier: TierConnector | None = None,
                landed: Landed | None = None) -> list[Request]:
        """Give queued requests, in arrival order, blocks for ``reserve_tokens`` (prefix-cache
        hits first) while ``headroom`` blocks stay free for the running requests' growth.
        Returns those that got them (``num_cached_tokens`` set to the hit). With a ``tier``,
        one whose next blocks are on disk loads them first (``loading``; ``landed`` then
        calls ``loaded``)."""
        kv, out = self.kv, []
        while self.queued:
            req = next(iter(self.queued.values()))
            computed, n_hit = kv.get_computed_blocks(req)
            n_ext = 0 if tier is None else tier.get_num_new_matched_tokens(req, n_hit)
            if n_ext < 0:
                break  # its next blocks are being loaded for another request: soon a pool hit
            n = reserve_tokens(req) - n_hit
            if kv.blocks_needed(req, n, computed) + headroom > kv.pool.num_free_blocks:
                break
            new = kv.allocate_slots(req, n, computed)
            if new is None:
                break
            del self.queued[req.req_id]
            kv.record_lookup(req.num_prompt_tokens, n_hit)
            req.num_cached_tokens = n_hit + n_ext  # the tier's report takes back what failed
            if n_ext:
                assert tier is not None and landed is not None
                self.loading[req.req_id] = req
                tier.update_state_after_alloc(req, new[:n_ext // kv.block_size], n_ext, landed)
                continue
            self.reserved[req.req_id] = req
            out.append(req)
        return out

    def loaded(self, req: Request) -> None:
        """``req``'s tier load is in (its intact blocks cached and counted in
        ``num_cached_tokens``): reserved now, in arrival order among the reserved."""
        del self.loading[req.req_id]
        res, deadlines = self.reserved, self.deadlines
        late = bool(res) and deadlines[next(reversed(res))] > deadlines[req.req_id]
        res[req.req_id] = req
        if late:  # a later arrival was reserved while this one loaded: keep deadline order
            self.reserved = dict(sorted(res.items(), key=lambda item: deadlines[item[0]]))

    def output(self, req: Request, endpoint: str) -> EngineOutput:
        """The reservation's output (what the router forwards to a prefill instance): the
        prompt's blocks, hits first, and where this instance's cache messager listens."""
        req.first_scheduled_time = now = time.time()
        n_prompt_blocks = -(-req.num_prompt_tokens // self.kv.block_size)
        return EngineOutput(
            req.out_id, [], num_prompt_tokens=req.num_prompt_tokens,
            num_cached_tokens=req.num_cached_tokens, first_scheduled_time=now, index=req.index,
            kv=KVReservation(engine_req_id=req.req_id,
                             block_ids=[b.block_id for b in req.blocks[:n_prompt_blocks]],
                             num_cached_tokens=req.num_cached_tokens, endpoint=endpoint,
                             timeout_s=max(0.0, self.deadlines[req.req_id] - self.clock())))

    def timeout_message(self, req: Request, loading: bool = False) -> str:
        t = f"--kv-transfer-timeout {self.timeout_s:g} s"
        if loading:
            return f"the prompt's KV blocks on the KV tier did not load within {t}"
        if req.req_id in self.quarantine:
            return f"the prompt's KV did not arrive from a prefill instance within {t}"
        return f"no KV blocks could be reserved for the prompt within {t}"

    def take(self, req_id: str) -> Request | None:
        """The reserved request ``req_id`` (its KV arrived), no longer a reservation; None if
        no such reservation (unknown, finished, timed out, or not reserved yet)."""
        req = self.reserved.pop(req_id, None)
        if req is not None:
            del self.deadlines[req_id]
        return req

    def discard(self, req: Request) -> None:
        """Forget ``req`` in any state (aborted). A reserved one's blocks that a peer may
        be writing go to the quarantine; the rest stay in ``req.blocks``, the caller's to free
        (a loading one's: no peer knows them; the tier holds those it loads into)."""
        if self.queued.pop(req.req_id, None) is not None or \
                self.loading.pop(req.req_id, None) is not None:
            del self.deadlines[req.req_id]
        elif self.reserved.pop(req.req_id, None) is not None:
            del self.deadlines[req.req_id]
            self._set_aside(req)

    def _set_aside(self, req: Request) -> None:
        """Quarantine the blocks of reserved ``req`` that its KVReservation lets a prefill
        instance write: from the prefix-hit boundary (the peer skips the hits) to the end of
        the prompt (the first decode token's slot is never written by a peer)."""
        bs = self.kv.block_size
        lo, hi = req.num_cached_tokens // bs, -(-req.num_prompt_tokens // bs)
        held = req.blocks[lo:hi]
        req.blocks = req.blocks[:lo] + req.blocks[hi:]
        if not held:
            return
        rid = req.req_id
        self.num_quarantined_blocks += len(held)
        prev = self.quarantine.pop(rid, None)
        if prev is not None:  # add_request refuses a quarantined id; should it happen, lose nothing
            logger.error("request id %r quarantined twice: both block sets held until the later "
                         "deadline", rid)
            held = prev[0] + held
        self.quarantine[rid] = (held, self.clock() + min(self.timeout_s, QUARANTINE_S))

    def release(self, req_id: str) -> bool:
        """The prefill side is done with ``req_id``'s blocks (its KVReady came): free the
        quarantined ones, tail first. False if none are quarantined under that id."""
        entry = self.quarantine.pop(req_id, None)
        if entry is None:
            return False
        self.kv.pool.free_blocks(reversed(entry[0]))
        self.num_quarantined_blocks -= len(entry[0])
        return True

    def release_expired(self) -> int:
        """Free the quarantined blocks past their deadline (no KVReady came: the prefill
        side is gone or never got the request). How many requests' blocks were freed."""
        now, n = self.clock(), 0
        while self.quarantine:
            rid, (blocks, deadline) = next(iter(self.quarantine.items()))
            if deadline > now:
                break  # in the order set aside: every later deadline is later still
            self.release(rid)
            n += 1
            logger.warning("request %r: no KVReady within --kv-transfer-timeout %g s after its "
                           "reservation ended; its %d quarantined KV blocks are free again",
                           rid, self.timeout_s, len(blocks))
        self.num_quarantine_expired += n
        return n

    def quarantined_block_ids(self) -> Counter[int]:
        """Block id -> references the quarantine holds (the audit's view)."""
        return Counter(b.block_id for blocks, _ in self.quarantine.values() for b in blocks)

    def next_deadline(self) -> float | None:
        """The earliest deadline (the clock's time) of a reservation or a quarantine entry,
        None without either."""
        firsts = [self.deadlines[next(iter(d))] for d in (self.queued, self.loading, self.reserved) if d]
        if self.quarantine:
            firsts.append(next(iter(self.quarantine.values()))[1])
        return min(firsts) if firsts else None

    def expired(self) -> list[Request]:
        """Remove and return the requests past their deadline (the caller frees their blocks
        and fails them; a reserved one's writable blocks went to the quarantine, a loading
        one's loading blocks are the tier's to hold)."""
        now, out = self.clock(), []
        for d in (self.queued, self.loading, self.reserved):
            while d:
                rid = next(iter(d))
                if self.deadlines[rid] > now:
                    break  # arrival order: every later deadline is later still
                out.append(d.pop(rid))
                del self.deadlines[rid]
                if d is self.reserved:
                    self._set_aside(out[-1])
        self.num_timeouts += len(out)
        return out

    def check(self) -> list[str]:
        errs = []
        for r in self.queued.values():
            if r.blocks or r.status != RequestStatus.WAITING_FOR_KV:
                errs.append(f"queued reservation {r.req_id} ({r.status.name}) holds "
                            f"{len(r.blocks)} blocks")
        for r in (*self.loading.values(), *self.reserved.values()):
            if r.status != RequestStatus.WAITING_FOR_KV or \
                    len(r.blocks) * self.kv.block_size < reserve_tokens(r):
                errs.append(f"reservation {r.req_id} ({r.status.name}) holds {len(r.blocks)} "
                            f"blocks for {reserve_tokens(r)} tokens")
        if set(self.deadlines) != set(self.queued) | set(self.loading) | set(self.reserved):
            errs.append("reservation deadlines do not match the reservations")
        n = 0
        for rid, (blocks, _) in self.quarantine.items():
            n += len(blocks)
            if rid in self.deadlines:
                errs.append(f"request {rid} is both a reservation and quarantined")
            for b in blocks:
                # Never computed here, so never cached: nobody else can have taken it.
                if b.ref_cnt < 1 or b.in_free_queue or b.block_hash is not None:
                    errs.append(f"quarantined block {b.block_id} of {rid}: ref_cnt {b.ref_cnt}, "
                                f"free {b.in_free_queue}, cached {b.block_hash is not None}")
        if n != self.num_quarantined_blocks:
            errs.append(f"{self.num_quarantined_blocks} quarantined blocks counted, {n} held")
        return errs
