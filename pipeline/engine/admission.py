"""Engine stage: admission, the scheduler's one job of taking waiting requests into the batch.

Owns / State: the reserve (blocks held back per running request for their growth: reset on
a preemption, when admission was too eager; decaying while none happens, FastDeploy v1's
scheme) and the admission counter (the "newest admitted" preemption victim's order). Reads
and changes the Scheduler's queue, running list and block table through it (``sched``).

Each step that preempted nothing admits waiting requests in queue order while the token
budget, ``max_num_seqs``, the blocks (minus the reserve) and the step ring's room for new
requests allow: a prefix-cache hit first, then the KV connector's tokens beyond it (a second
KV tier: the request then waits for its load outside the batch, holding the blocks of its
whole sequence), then blocks for the chunk it computes now. A request holding blocks (its KV
arrived from a peer or a tier) looks up nothing and needs no block to join.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from pipeline.engine import inflight
from pipeline.engine.block_pool import KVBlock
from pipeline.engine.request import Request, RequestStatus
from pipeline.messages import NewRequestData, ids_to_bytes

if TYPE_CHECKING:
    from pipeline.engine.scheduler import Scheduler

RESERVE_INIT = 1.0
RESERVE_MIN = 0.05
RESERVE_DECAY = 0.98
# Newly admitted requests one step may carry to the workers (their token ids and sampling
# params, encoded): the step must cross the step ring (runtime/rings.py: messages of at least
# 16 MiB, and of one largest request plus the rest of a step) with room for the rest. The
# first request of a step always goes.
NEW_REQUESTS_BYTES_PER_STEP = 8 << 20


@dataclass(slots=True)
class StepBudget:
    """What one schedule() call has handed out so far."""
    budget: int
    num_sched: dict[str, int] = field(default_factory=dict)
    new_blocks: dict[str, list[int]] = field(default_factory=dict)
    preempted: list[Request] = field(default_factory=list)
    new_request_bytes: int = 0  # of the requests admitted in this step
    spec: dict[str, bytes] = field(default_factory=dict)  # drafts verified (SchedulerOutput)
    spec_idle: list[str] = field(default_factory=list)  # no drafts wanted next step
    spec_fewer: dict[str, int] = field(default_factory=dict)  # fewer than K drafts wanted next step


class Admission:
    def __init__(self, sched: Scheduler) -> None:
        self.sched = sched
        self.reserve_per_running = RESERVE_INIT
        self.seq = 0

    def headroom(self) -> int:
        """Blocks admission keeps free for the running requests' growth."""
        return int(self.reserve_per_running * len(self.sched.running))

    def preempted(self) -> None:
        self.reserve_per_running = RESERVE_INIT

    def admit(self, step: int, st: StepBudget, new_reqs: list[NewRequestData]) -> None:
        """Admit into step ``step`` (its ``st`` so far), appending to ``new_reqs``."""
        sched = self.sched
        self.reserve_per_running = max(RESERVE_MIN, self.reserve_per_running * RESERVE_DECAY)
        running, kv, conn, num_sched = sched.running, sched.kv, sched.connector, st.num_sched
        budget = st.budget
        reserve = self.headroom()
        while budget > 0 and len(running) < sched.max_num_seqs:
            req = sched.waiting.peek()
            if req is None:
                break
            # Prompt logprobs need every prompt position's logits, mean pooling every hidden
            # state: no prefix-cache hit. A request holding blocks (decode role: its prompt's
            # KV arrived) looks up nothing.
            held = bool(req.blocks)
            whole = req.computes_whole_prompt
            computed, n_hit = ([], 0) if whole or held else kv.get_computed_blocks(req)
            if conn is not None and not (held or whole):
                # Tokens beyond the pool's hit that the connector loads (a second KV tier):
                # the request waits for them outside the batch, holding its blocks.
                n_ext = min(conn.get_num_new_matched_tokens(req, n_hit),
                            req.num_tokens - 1 - n_hit)
                if n_ext < 0:
                    break  # its next blocks are being loaded for another request: soon a pool hit
                if n_ext > 0:
                    if not self._load_external(req, computed, n_hit, n_ext, reserve):
                        break
                    continue
            n = min(req.num_tokens - req.num_computed_tokens - n_hit, budget)
            if sched.explicit_threshold or running:
                n = min(n, sched.long_prefill_token_threshold)
            size = 4 * req.num_tokens + req.params_bytes  # what NewRequestData carries
            if new_reqs and st.new_request_bytes + size > NEW_REQUESTS_BYTES_PER_STEP:
                break
            # Only a request that takes blocks eats into the running requests' reserve (one
            # whose KV arrived has its first decode token's slot already: it never waits for
            # a block, so reservations cannot deadlock the batch).
            need = kv.blocks_needed(req, n, computed)
            if running and need and need + reserve > kv.pool.num_free_blocks:
                break
            if kv.allocate_slots(req, n, computed) is None:
                break
            sched.waiting.pop()
            if not held:
                kv.record_lookup(req.num_tokens, n_hit)
            if req.num_cached_tokens < 0:
                req.num_cached_tokens = n_hit
                req.first_scheduled_time = time.time()
            req.status = RequestStatus.RUNNING
            inflight.mark_scheduled(req, step, n)
            req.sent_to_worker = True
            self.seq += 1
            req.admit_seq = self.seq
            running.append(req)
            num_sched[req.req_id] = n
            budget -= n
            st.new_request_bytes += size
            new_reqs.append(NewRequestData(req.req_id, ids_to_bytes(req.all_token_ids),
                                           req.num_prompt_tokens, req.sampling_params,
                                           [b.block_id for b in req.blocks],
                                           req.num_computed_tokens, req.grammar, req.embed))

    def _load_external(self, req: Request, computed: list[KVBlock], n_hit: int, n_ext: int,
                       reserve: int) -> bool:
        """Blocks for ``req``'s pool hit, the ``n_ext`` tokens the connector loads and the
        rest of its sequence, taken as admission takes them; the connector holds it
        (WAITING_FOR_KV) until the load is in and hands it back (``resume``). False: no room
        now."""
        sched = self.sched
        kv = sched.kv
        # Blocks for the whole sequence, not only the loaded part: a request back from its
        # load must find room for the tokens it computes, or loads admitted while nothing
        # ran could take the pool between them and wait for ever, each holding its blocks
        # and none able to join (waiting requests are never preempted).
        rest = req.num_tokens - req.num_computed_tokens - n_hit
        need = kv.blocks_needed(req, rest, computed)
        if sched.running and need + reserve > kv.pool.num_free_blocks:
            return False
        new = kv.allocate_slots(req, rest, computed)
        if new is None:
            return False
        new = new[:n_ext // kv.block_size]  # the loaded blocks; the rest, computed after
        sched.waiting.pop()
        kv.record_lookup(req.num_tokens, n_hit)  # the pool's hit; the connector counts its own
        if req.num_cached_tokens < 0:
            req.num_cached_tokens = n_hit + n_ext
            req.first_scheduled_time = time.time()
        req.status = RequestStatus.WAITING_FOR_KV
        assert sched.connector is not None
        sched.connector.update_state_after_alloc(req, new, n_ext)
        return True

