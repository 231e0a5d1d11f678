"""Engine stage, prefill/decode disaggregation: the decode role's reservations and the prefill
role's transfer leases. The Scheduler owns the requests and their outputs; these two own the
PD state beside them and take or give back blocks only through the KVCacheManager / BlockPool.
(``engine.scheduler_pd`` holds the Scheduler's own steps of both roles.)

Owns / State:
- ``Reservations`` (decode role): requests waiting for their prompt's KV, each with a deadline
  (arrival at the engine + kv_transfer_timeout on an injectable monotonic clock): ``queued``
  (FCFS, no blocks yet) then ``reserved`` (holding blocks for the whole prompt plus the first
  decode token's slot, so a request whose KV arrived never needs a block to join the batch),
  both in arrival order, so deadlines are ordered too. And the ``quarantine``: once a
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
- ``TransferLeases`` (prefill role): per step, a reference on every block of the step's
  TransferPlan until the cache messager's TransferReport for that step (seed 000: a block is
  never freed or reused while its KV is on the wire), the requests whose sends it carries
  (each counts it in ``Request.kv_pending`` until then: --pd-fallback local waits for them
  before a request's first token ends it), and the KVFinish messages owed to the messager
  (at most one per request: its first token, or why it failed, or FALLBACK_ERROR).
"""
from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Callable, Iterable

from pipeline.engine.block_pool import BlockPool, KVBlock
from pipeline.engine.kv_cache_manager import KVCacheManager
from pipeline.engine.request import Request, RequestStatus
from pipeline.messages import EngineOutput, EngineRequest
from pipeline.messages.kv import KVFinish, KVReservation, KVSend, TransferPlan, pairs_to_bytes

logger = logging.getLogger(__name__)


# The longest a reservation's blocks stay held after it ended without a KVReady (see above).
QUARANTINE_S = 5.0
# A prefill stops sending this long before the reservation's end as the router reported it
# (KVTransferParams.deadline_s): the decode side's clock started a hop earlier.
SEND_MARGIN_S = 1.0


def check_kv_transfer(er: EngineRequest, role: str, block_size: int, num_prompt: int) -> None:
    """What the tokenizer stage checked (``tokenizer.validate.check_kv_transfer``), again
    where a wrong block table would corrupt another instance's KV cache: ValueError."""
    kvt = er.kv_transfer
    assert kvt is not None
    if kvt.role != role:
        raise ValueError(f"kv_transfer.role {kvt.role!r} on an engine of role {role!r}")
    if er.sampling_params.n != 1:
        raise ValueError(f"a kv_transfer request has n=1, got n={er.sampling_params.n}")
    if kvt.role == "prefill":
        need = -(-num_prompt // block_size)
        if len(kvt.remote_block_ids) != need:
            raise ValueError(f"kv_transfer.remote_block_ids: {len(kvt.remote_block_ids)} blocks, "
                             f"the prompt's {num_prompt} tokens need {need} of {block_size}")
        cached = kvt.remote_num_cached_tokens
        if cached % block_size or cached >= num_prompt:
            raise ValueError(f"kv_transfer.remote_num_cached_tokens: {cached} must be a multiple "
                             f"of {block_size} below the prompt's {num_prompt} tokens")


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
        self.deadlines: dict[str, float] = {}
        # Request id -> (blocks a peer may still write, deadline); in the order set aside, so
        # deadlines are ordered too.
        self.quarantine: dict[str, tuple[list[KVBlock], float]] = {}
        self.num_quarantined_blocks = 0
        self.num_timeouts = 0
        self.num_quarantine_expired = 0  # released at their deadline, without a KVReady

    def __len__(self) -> int:
        """Live reservations (queued or reserved); the quarantine holds no request."""
        return len(self.queued) + len(self.reserved)

    @property
    def num_reserved_blocks(self) -> int:
        """Blocks held for a peer: the reserved requests' and the quarantined ones."""
        return sum(len(r.blocks) for r in self.reserved.values()) + self.num_quarantined_blocks

    def add(self, req: Request) -> None:
        req.status = RequestStatus.WAITING_FOR_KV
        self.deadlines[req.req_id] = self.clock() + self.timeout_s
        self.queued[req.req_id] = req

    def reserve(self, headroom: int) -> list[Request]:
        """Give queued requests, in arrival order, blocks for ``reserve_tokens`` (prefix-cache
        hits first) while ``headroom`` blocks stay free for the running requests' growth.
        Returns those that got them (``num_cached_tokens`` set to the hit)."""
        kv, out = self.kv, []
        while self.queued:
            req = next(iter(self.queued.values()))
            computed, n_hit = kv.get_computed_blocks(req)
            n = reserve_tokens(req) - n_hit
            if kv.blocks_needed(req, n, computed) + headroom > kv.pool.num_free_blocks:
                break
            if kv.allocate_slots(req, n, computed) is None:
                break
            del self.queued[req.req_id]
            kv.record_lookup(req.num_prompt_tokens, n_hit)
            req.num_cached_tokens = n_hit
            self.reserved[req.req_id] = req
            out.append(req)
        return out

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

    def timeout_message(self, req: Request) -> str:
        t = f"--kv-transfer-timeout {self.timeout_s:g} s"
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
        """Forget ``req`` in either state (aborted). A reserved one's blocks that a peer may
        be writing go to the quarantine; the rest stay in ``req.blocks``, the caller's to free."""
        if self.queued.pop(req.req_id, None) is not None:
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
        firsts = [self.deadlines[next(iter(d))] for d in (self.queued, self.reserved) if d]
        if self.quarantine:
            firsts.append(next(iter(self.quarantine.values()))[1])
        return min(firsts) if firsts else None

    def expired(self) -> list[Request]:
        """Remove and return the requests past their deadline (the caller frees their blocks
        and fails them; a reserved one's writable blocks went to the quarantine)."""
        now, out = self.clock(), []
        for d in (self.queued, self.reserved):
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
        for r in self.reserved.values():
            if r.status != RequestStatus.WAITING_FOR_KV or \
                    len(r.blocks) * self.kv.block_size < reserve_tokens(r):
                errs.append(f"reservation {r.req_id} ({r.status.name}) holds {len(r.blocks)} "
                            f"blocks for {reserve_tokens(r)} tokens")
        if set(self.deadlines) != set(self.queued) | set(self.reserved):
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


class TransferLeases:
    """Prefill role: per-step plans of the prompt blocks to send, the blocks they hold until
    the step's report, and the KVFinish messages owed to the cache messager."""

    def __init__(self, pool: BlockPool, block_size: int) -> None:
        self.pool = pool
        self.block_size = block_size
        self.leases: dict[int, list[KVBlock]] = {}  # step id -> blocks held for its transfer
        self.carried: dict[int, list[Request]] = {}  # step id -> the requests it sends for
        self.held: Counter[int] = Counter()  # block id -> leases on it (the audit's view)
        self.finishes: list[KVFinish] = []
        self.num_unknown_reports = 0

    @property
    def num_leased_blocks(self) -> int:
        return len(self.held)

    def plan(self, step_id: int, scheduled: Iterable[tuple[Request, int]]) -> TransferPlan | None:
        """The plan of step ``step_id`` given its (request, scheduled tokens) (requests not
        computed yet: ``num_computed_tokens`` is where the step starts). Per request: the
        prompt blocks its tokens up to this step's end touch that were not sent in full yet,
        from the decode side's prefix-hit boundary on. Leases them until ``release``."""
        bs = self.block_size
        sends: list[KVSend] = []
        blocks: list[KVBlock] = []
        carried: list[Request] = []
        for req, n in scheduled:
            kv = req.kv_send
            if kv is None:
                continue
            p = req.num_prompt_tokens
            end = min(req.num_computed_tokens + n, p)
            hi = -(-end // bs)
            lo = max(req.kv_sent_blocks, kv.remote_num_cached_tokens // bs)
            # A partial block is sent again once more of it is computed.
            req.kv_sent_blocks = hi if end >= p else max(req.kv_sent_blocks, end // bs)
            if lo >= hi:
                continue
            mine = req.blocks[lo:hi]
            remote = kv.remote_block_ids
            sends.append(KVSend(req.req_id, kv.peer, kv.remote_req_id, pairs_to_bytes(
                [(b.block_id, remote[i]) for i, b in enumerate(mine, lo)])))
            blocks += mine
            carried.append(req)
            req.kv_pending += 1
        if not sends:
            return None
        self.pool.touch(blocks)
        self.leases[step_id] = blocks
        self.carried[step_id] = carried
        self.held.update(b.block_id for b in blocks)
        return TransferPlan(step_id, sends)

    def release(self, step_id: int) -> list[Request] | None:
        """Drop step ``step_id``'s lease (its report came, or its plan was never sent): the
        requests it sent for, one ``kv_pending`` less each (finished ones too); None if there
        is no such lease."""
        blocks = self.leases.pop(step_id, None)
        if blocks is None:
            return None
        carried = self.carried.pop(step_id)
        for req in carried:
            req.kv_pending -= 1
        self.pool.free_blocks(reversed(blocks))  # tail first: eviction order
        held = self.held
        for b in blocks:
            held[b.block_id] -= 1
            if not held[b.block_id]:
                del held[b.block_id]
        return carried

    def finish(self, req: Request, token: int = -1, error: str = "") -> None:
        """Owe the messager ``req``'s KVFinish, unless one is out already (ring order: after
        every plan sent so far, so after its last write)."""
        kv = req.kv_send
        if kv is None or req.kv_finished:
            return
        req.kv_finished = True
        self.finishes.append(KVFinish(req.req_id, kv.peer, kv.remote_req_id, token, error))

    def refused(self, er: EngineRequest, why: str) -> None:
        """A prefill-role request the engine refused: its decode peer learns it at once."""
        kv = er.kv_transfer
        if kv is not None and kv.role == "prefill" and kv.peer and kv.remote_req_id:
            self.finishes.append(KVFinish(er.req_id, kv.peer, kv.remote_req_id, -1,
                                          f"the prefill instance refused the request: {why}"))

    def take_finishes(self) -> list[KVFinish]:
        out, self.finishes = self.finishes, []
        return out
