"""Engine stage: the block-table audit behind ``Scheduler.check_invariants``.

Read-only over the scheduler's state. O(blocks + owned blocks), so the engine runs it when
idle, and tests after every step: free + cached-evictable + in-use == total, every in-use
block's ref count equals its number of owners plus the references held for a KV transfer
(prefill role: a step's blocks stay leased until the cache messager reports their transfer;
decode role: an ended reservation's blocks stay quarantined until its prefill peer is done
with them; ``Reservations.check`` checks the quarantine itself), only cached blocks are
shared by requests, no request lists a block twice, nothing is leaked, and only requests that
may hold blocks do: running ones, and those the KV connector says may (decode-role
reservations, WAITING_FOR_KV, and requests waiting for admission with the KV they received;
prefill-role requests PARKED until their transfers are reported, --pd-fallback local).
"""
from __future__ import annotations

import logging
from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING

from pipeline.engine import inflight
from pipeline.engine.block_pool import BlockPool
from pipeline.engine.request import Request, RequestStatus

if TYPE_CHECKING:
    from pipeline.engine.scheduler import Scheduler

logger = logging.getLogger(__name__)


def _running(req: Request) -> bool:
    return req.status == RequestStatus.RUNNING


def audit_block_table(pool: BlockPool, requests: Iterable[Request], num_running: int,
                      held: Mapping[int, int] | None = None,
                      may_hold_blocks: Callable[[Request], bool] | None = None) -> list[str]:
    """``held``: block id -> references held for a KV transfer, not by a request (prefill
    transfer leases, decode quarantine); a referenced block nobody holds is a leak.
    ``may_hold_blocks``: the KV connector's rule of which requests may own blocks (none:
    running ones only)."""
    errs = pool.check()
    held = held or {}
    may_hold = may_hold_blocks or _running
    owners: dict[int, list[str]] = defaultdict(list)
    n_running = 0
    for req in requests:
        if req.status == RequestStatus.RUNNING:
            n_running += 1
        if req.blocks and not may_hold(req):
            errs.append(f"request {req.req_id} ({req.status.name}) holds {len(req.blocks)} blocks")
        for b in req.blocks:
            owners[b.block_id].append(req.req_id)
    for bid, ids in owners.items():
        b = pool.blocks[bid]
        if len(set(ids)) != len(ids):
            errs.append(f"block {bid} listed twice by request {ids[0]}")
        if len(ids) > 1 and b.block_hash is None:
            errs.append(f"uncached block {bid} owned by several requests: {sorted(ids)}")
        n_held = held.get(bid, 0)
        if len(ids) + n_held != b.ref_cnt:
            errs.append(f"block {bid} ref_cnt {b.ref_cnt} but owners {sorted(ids)}"
                        + (f" and {n_held} held for a KV transfer" if n_held else ""))
    for bid, n_held in held.items():
        b = pool.blocks[bid]
        if bid not in owners and b.ref_cnt != n_held:
            errs.append(f"block {bid} ref_cnt {b.ref_cnt} but {n_held} held for a KV transfer, "
                        f"no owner")
    for b in pool.blocks:
        if b.ref_cnt > 0 and b.block_id not in owners and b.block_id not in held:
            errs.append(f"block {b.block_id} leaked: ref_cnt {b.ref_cnt}, no owner")
    if n_running != num_running:
        errs.append(f"{num_running} in the running list, {n_running} RUNNING")
    return errs


def audit_scheduler(sched: Scheduler) -> list[str]:
    """``Scheduler.check_invariants``: the block table with what the KV connector holds, the
    connector's own state, and every request's steps in flight; violations logged."""
    conn = sched.connector
    errs = audit_block_table(sched.kv.pool, sched.requests.values(), len(sched.running),
                             conn.held_block_ids() if conn else None,
                             conn.may_hold_blocks if conn else None)
    if conn is not None:
        errs += conn.check()
    for r in sched.requests.values():
        errs += inflight.check(r, sched.block_size)
    for e in errs:
        logger.error("KV block table invariant violated: %s", e)
    return errs
