"""Engine stage: the block-table audit behind ``Scheduler.check_invariants``.

Read-only over the scheduler's state. O(blocks + owned blocks), so the engine runs it when
idle, and tests after every step: free + cached-evictable + in-use == total, every in-use
block's ref count equals its number of owners, only cached blocks are shared, no request
lists a block twice, nothing is leaked, and only running requests hold blocks.
"""
from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable

from pipeline.engine.block_pool import BlockPool
from pipeline.engine.request import Request, RequestStatus


def audit_block_table(pool: BlockPool, requests: Iterable[Request], num_running: int) -> list[str]:
    errs = pool.check()
    owners: dict[int, list[str]] = defaultdict(list)
    n_running = 0
    for req in requests:
        if req.status == RequestStatus.RUNNING:
            n_running += 1
        elif req.blocks:
            errs.append(f"request {req.req_id} ({req.status.name}) holds {len(req.blocks)} blocks")
        for b in req.blocks:
            owners[b.block_id].append(req.req_id)
    for bid, ids in owners.items():
        b = pool.blocks[bid]
        if len(set(ids)) != len(ids):
            errs.append(f"block {bid} listed twice by request {ids[0]}")
        if len(ids) > 1 and b.block_hash is None:
            errs.append(f"uncached block {bid} owned by several requests: {sorted(ids)}")
        if len(ids) != b.ref_cnt:
            errs.append(f"block {bid} ref_cnt {b.ref_cnt} but owners {sorted(ids)}")
    for b in pool.blocks:
        if b.ref_cnt > 0 and b.block_id not in owners:
            errs.append(f"block {b.block_id} leaked: ref_cnt {b.ref_cnt}, no owner")
    if n_running != num_running:
        errs.append(f"{num_running} in the running list, {n_running} RUNNING")
    return errs
