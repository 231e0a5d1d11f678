"""Engine stage: the scheduler (seed 002's "scheduler v1"): one block table, every request's state.

Owns the requests (waiting queue + running list), the KVCacheManager (block pool and prefix
cache) and the per-step diff sent to the worker. Nothing else allocates, frees, hashes or
caches a block. One step is ``schedule()`` -> worker -> ``update_from_output()``; a request
scheduled in a step whose result is not back yet is "in flight", so an engine may schedule
step N+1 before step N's result arrives. An in-flight request is scheduled again only with
``async_scheduling`` (``engine.inflight``: it runs ahead on the tokens its steps in flight
sample, which the worker appends itself); without, it waits for its result. A result for a
request that was preempted, aborted or finished meanwhile is stale and dropped, so such a
request never caches blocks it no longer owns (seed 001) and a token computed ahead for it
is never streamed.

A request of ``n > 1`` completions (parallel sampling) is n child Requests under one client
id (``engine.families``: the siblings wait for the first's prompt KV). Aborting the client id
aborts every child; a stop string ends one child (the token processor names it by
``child_id``).

KV that this instance's steps do not compute (prefill/decode disaggregation; later a second
KV tier) is the ``connector``'s (``engine.kv_connector``), called at fixed points: admission,
the end of ``schedule()``, each sampled token, a request's end or preemption. It owns the
transfer state of its requests; a mixed instance has none (``connector is None``). A request
the connector holds (a decode-role reservation waiting for its KV, a prefill-role request
parked after its first token) is in ``requests`` but neither running nor waiting; once its KV
came the connector hands it back (``resume``: admitted first, holding its blocks;
``engine.admission``).
"""
from __future__ import annotations

import logging
import time
from collections.abc import Callable

from pipeline.config import EngineConfig
from pipeline.engine import inflight
from pipeline.engine.admission import Admission, StepBudget
from pipeline.engine.audit import audit_scheduler
from pipeline.engine.families import Families
from pipeline.engine.growth import grow
from pipeline.engine.kv_cache_manager import KVCacheManager
from pipeline.engine.kv_connector import make_connector
from pipeline.engine.kv_connector.base import KVConnector
from pipeline.engine.new_request import make_requests
from pipeline.engine.preemption import make_policy
from pipeline.engine.request import ABORT_STATUS, Request, RequestStatus
from pipeline.engine.request_queue import WaitingQueue
from pipeline.engine.spec_decode import SpecDecode
from pipeline.engine.stats import scheduler_stats
from pipeline.engine.step_outputs import final_output
from pipeline.engine.step_results import StepResults
from pipeline.messages import (
    CachedRequestData,
    EngineOutput,
    EngineRequest,
    EngineStats,
    ModelRunnerOutput,
    NewRequestData,
    SchedulerOutput,
    ids_to_bytes,
)

logger = logging.getLogger(__name__)

class Scheduler:
    def __init__(self, config: EngineConfig, num_blocks: int, block_size: int,
                 max_model_len: int, hash_key: bytes | None = None, *,
                 clock: Callable[[], float] = time.monotonic, async_scheduling: bool = False,
                 connector: Callable[[Scheduler], KVConnector] | None = None) -> None:
        """``clock``: the monotonic clock of reservation deadlines (tests inject one).
        ``async_scheduling``: schedule requests in flight ahead (``engine.inflight``), in a
        mixed instance only (a connector's transfer follows its requests' confirmed state).
        ``connector``: makes the KV connector (default: the one of ``config.role``)."""
        for name, v in (("max_num_seqs", config.scheduler_config.max_num_seqs),
                        ("max_num_batched_tokens", config.scheduler_config.max_num_batched_tokens),
                        ("max_model_len", max_model_len)):
            if v < 1:
                raise ValueError(f"{name} must be >= 1, got {v}")
        if config.scheduler_config.long_prefill_token_threshold < 0:
            raise ValueError(f"long_prefill_token_threshold must be >= 0 (0: automatic), got "
                             f"{config.scheduler_config.long_prefill_token_threshold}")
        self.config = config
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.max_num_seqs = config.scheduler_config.max_num_seqs
        self.max_num_batched_tokens = config.scheduler_config.max_num_batched_tokens
        # An explicit threshold always caps a prefill chunk; the default (0) caps it only when
        # the chunk shares the step with other requests, so a lone prompt still gets the whole
        # budget (TTFT) while a prefill never inflates a decode step by more than a quarter.
        self.explicit_threshold = config.scheduler_config.long_prefill_token_threshold > 0
        self.long_prefill_token_threshold = (config.scheduler_config.long_prefill_token_threshold
                                             or max(1, config.scheduler_config.max_num_batched_tokens // 4))
        self.kv = KVCacheManager(num_blocks, block_size, config.cache_config.enable_prefix_caching, hash_key)
        self.policy = make_policy(config.scheduler_config.preemption_policy)
        self.requests: dict[str, Request] = {}
        self.waiting = WaitingQueue()
        self.families = Families(self.waiting, self.kv.enable_caching)  # n > 1
        self.running: list[Request] = []  # admission order
        self.step_id = 0
        self._finished_ids: list[str] = []  # the worker must drop them at the next step
        self.admission = Admission(self)
        self.num_preemptions = 0
        self.num_prompt_tokens = 0
        self.results = StepResults(self)
        self.clock = clock
        self.connector = connector(self) if connector is not None else make_connector(self)
        if self.connector is not None and self.connector.saves_cached:
            self.kv.pool.on_cached = self.connector.on_cached
        spec = config.speculative_config
        # Speculative decoding (engine.spec_decode): a verify step's outcome decides the next
        # step's tokens, so it runs without scheduling ahead.
        self.spec = SpecDecode(spec.num_speculative_tokens, spec.cost_aware) if spec is not None else None
        # A draft model writes its KV for the K drafts it proposes past a sampling step's
        # tokens: those slots are allocated with the step (worker.spec.draft).
        self.lookahead = spec.num_speculative_tokens if spec is not None and spec.method == "draft_model" else 0
        self.async_scheduling = (async_scheduling and self.spec is None
                                 and (self.connector is None or self.connector.allows_async))

    # -- admission and abort ------------------------------------------------------------
    def add_request(self, er: EngineRequest) -> None:
        """Queue a validated request (``tokenizer.validate``); ValueError if it could never
        fit in the whole KV cache, which only the engine knows. A refused prefill-role request
        still owes its decode peer a KVFinish (so the reservation there ends now)."""
        try:
            self._add_request(er)
        except ValueError as exc:
            if er.req_id not in self.requests and self.connector is not None:
                self.connector.refused(er, str(exc))
            raise

    def _add_request(self, er: EngineRequest) -> None:
        # The ids of children and parents: a child id may not take a client id, nor the reverse.
        taken = self.requests.keys() | self.families.parents.keys()
        conn = self.connector
        children = make_requests(er, taken, self.block_size, self.kv.pool.num_blocks, conn,
                                 self.config.model_config.pooling)
        first = children[0]
        self.kv.hash_new_blocks(first)
        for c in children:
            c.block_hashes = list(first.block_hashes)  # same prompt, same chain
            self.requests[c.req_id] = c
            if self.spec is not None:
                self.spec.start(c)
        self.num_prompt_tokens += first.num_prompt_tokens
        if conn is not None and conn.add_request(first, er):
            return  # held by the connector until its KV is in (n == 1: no siblings)
        first.order = self.waiting.add(first)
        if len(children) > 1:
            self.families.add(er.req_id, children)

    def abort_requests(self, req_ids, reason: str = "abort", message: str = "") -> list[EngineOutput]:
        """End requests (a client id ends all its children, a child id that child alone).

        ``reason`` "stop" (a stop string), "length" and "error" end them as such; any other
        aborts them, and the outputs say who and why: ``message``, else "aborted by the
        client" for "abort", else the reason itself.
        """
        status = ABORT_STATUS.get(reason, RequestStatus.FINISHED_ABORTED)
        why = message or None
        if status == RequestStatus.FINISHED_ABORTED and not why:
            why = "aborted by the client" if reason == "abort" else f"aborted: {reason}"
        outs = []
        for rid in req_ids:
            children = self.families.children(rid)
            for req in children if children is not None else [self.requests.get(rid)]:
                if req is None or req.req_id not in self.requests:
                    continue  # unknown or already finished: its final output went out already
                if self.connector is not None and self.connector.defer_abort(req, status):
                    continue  # ends so once its transfer is settled
                self._detach(req)
                req.status = status
                self.finish(req, why or f"finished ({reason}) before its first token")
                outs.append(final_output(req, [], why))
        return outs

    def _detach(self, req: Request) -> None:
        """Take a live request out of the list or queue it is in (before finishing it)."""
        if req.status == RequestStatus.RUNNING:
            self.running.remove(req)
        elif self.connector is None or not self.connector.detach(req):
            self.waiting.discard(req)  # a no-op for a held sibling

    def fail(self, req: Request, code: str, message: str) -> list[EngineOutput]:
        """End a live request as an error with ``code`` (the answer's ErrorInfo.code)."""
        self._detach(req)
        req.status = RequestStatus.FINISHED_ERROR
        self.finish(req, message)
        return [final_output(req, [], message, error_code=code)]

    def finish(self, req: Request, why: str = "") -> None:
        """Free a request that ended (its status says how). ``why``: for one ending before
        its first token, what the connector tells its peer."""
        if self.connector is not None:
            self.connector.request_finished(req, why)
        self.kv.free(req)
        req.finish_time = time.time()
        inflight.reset(req)
        del self.requests[req.req_id]
        if req.sent_to_worker:
            self._finished_ids.append(req.req_id)
        self.families.finished(req, self.requests)

    # -- what a connector hands back ----------------------------------------------------
    def resume(self, req: Request) -> None:
        """``req``'s KV is in (it holds its blocks): admitted first thing (``_admit``)."""
        req.status = RequestStatus.WAITING
        self.waiting.add_front(req)

    def run(self, req: Request) -> None:
        """``req``, held with its blocks, decodes on."""
        req.status = RequestStatus.RUNNING
        self.running.append(req)

    def has_unfinished_requests(self) -> bool:
        """Whether a step has work (or may have, once blocks free up). Requests the
        connector holds are no work for a step: the stage waits for KV, transfer reports or
        a deadline."""
        held = 0 if self.connector is None else self.connector.num_held
        return len(self.requests) > held

    # -- one step -----------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        self.step_id += 1
        step = self.step_id
        st = StepBudget(self.max_num_batched_tokens)
        bs = self.block_size
        order: list[Request] = []  # batch order: decodes, then continuing prefills
        prefills: list[Request] = []
        ahead, max_len, spec = self.async_scheduling, self.max_model_len, self.spec
        if spec is not None:
            spec.begin_step()
        # A snapshot: preemption shrinks self.running while we walk it.
        for req in list(self.running):
            if st.budget <= 0:
                break
            if req.status != RequestStatus.RUNNING:
                continue  # preempted just now
            if req.inflight_steps and not (ahead and inflight.may_run_ahead(req, max_len)):
                continue  # waits for its result
            # Counting the tokens in flight (engine.inflight): where this step starts.
            start = req.num_computed_tokens + req.num_inflight_tokens
            if len(req.all_token_ids) + req.num_placeholders - start != 1:
                prefills.append(req)
                continue
            # Drafts: as many as leave room for the token it samples anyway in the budget,
            # max_tokens and max_model_len.
            drafts = spec.drafts_for(req, min(st.budget, min(req.max_num_tokens, max_len)
                                              - len(req.all_token_ids)) - 1) if spec is not None else []
            n = 1 + len(drafts)
            need = n + min(self.lookahead, max_len - start - n)
            # Fast path: the decode token (and drafts) still fit in the request's last block.
            if start + need <= len(req.blocks) * bs or grow(self, req, need, st):
                st.num_sched[req.req_id] = n
                st.budget -= n
                inflight.mark_scheduled(req, step, n, len(drafts))
                if drafts:
                    st.spec[req.req_id] = ids_to_bytes(drafts)
                order.append(req)
        threshold = self.long_prefill_token_threshold
        capped = self.explicit_threshold or len(self.running) > 1
        for req in prefills:
            if st.budget <= 0:
                break
            if req.status != RequestStatus.RUNNING:
                continue
            n = min(len(req.all_token_ids) + req.num_placeholders - req.num_computed_tokens
                    - req.num_inflight_tokens, st.budget)
            if capped:
                n = min(n, threshold)
            start = req.num_computed_tokens + req.num_inflight_tokens
            last = start + n == len(req.all_token_ids) + req.num_placeholders  # it samples
            if grow(self, req, n + (min(self.lookahead, max_len - start - n) if last else 0), st):
                st.num_sched[req.req_id] = n
                st.budget -= n
                inflight.mark_scheduled(req, step, n)
                order.append(req)
        num_sched, new_blocks = st.num_sched, st.new_blocks
        # The worker's count before this step: its own, after the steps in flight.
        cached_reqs = [CachedRequestData(r.req_id, new_blocks.get(r.req_id, []),
                                         r.num_computed_tokens + r.num_inflight_tokens - num_sched[r.req_id])
                       for r in order if r.req_id in num_sched]
        preempted = st.preempted
        new_reqs: list[NewRequestData] = []
        # No admission in a step that had to preempt: the pool is too tight for more work.
        if not preempted:
            self.admission.admit(step, st, new_reqs)
        if spec is not None:  # what the worker proposes after this step, for whom
            spec.want([self.requests[rid] for rid in num_sched], st.spec_idle, st.spec_fewer)
        if self.connector is not None:
            self.connector.build_connector_meta(step, num_sched, not preempted)
        finished, self._finished_ids = self._finished_ids, []
        return SchedulerOutput(step, new_reqs, cached_reqs, num_sched, sum(num_sched.values()),
                               finished, [r.req_id for r in preempted], st.spec, st.spec_idle,
                               st.spec_fewer)

    def update_from_output(self, sched: SchedulerOutput,
                           out: ModelRunnerOutput) -> list[EngineOutput]:
        """Step ``sched``'s results (``engine.step_results``): the outputs to emit."""
        return self.results.apply(sched, out)

    # -- observability ------------------------------------------------------------------
    def stats(self) -> EngineStats:
        return scheduler_stats(self)

    def check_invariants(self) -> list[str]:
        """O(blocks) audit of the block table; logs and returns violations (empty: sound)."""
        return audit_scheduler(self)
