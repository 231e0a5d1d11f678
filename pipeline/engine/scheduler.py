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
id (``parents``). Only the first child is queued at first; its siblings are queued at its
place once its prompt's KV is computed, so they take the prompt's full blocks from the
prefix cache instead of computing them again (each recomputes at most its last, partial
block, for its own first token's logits). Aborting the client id aborts every child; a stop
string ends one child (the token processor names it by ``child_id``).

Disaggregation: ``engine.disagg`` holds its state (decode-role reservations and their
quarantine, prefill-role transfer leases), ``engine.scheduler_pd`` the Scheduler's methods
for it (``poll_kv``, ``on_kv_ready``, ``take_plan``, ``on_transfer_report``, ...). A decode-role
reservation waits for its KV outside the queue; once it came the request is admitted first,
holding its blocks (``_admit``). A prefill-role step's plan is made at the end of ``schedule()``;
a prefill-role request ends after its first token, or (--pd-fallback local) is parked out of
the batch, keeping its blocks, until its transfers are reported (``parked``).
"""
from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import msgspec

from pipeline.config import EngineConfig
from pipeline.engine import inflight, scheduler_pd
from pipeline.engine.audit import audit_block_table
from pipeline.engine.disagg import SEND_MARGIN_S, Reservations, TransferLeases, check_kv_transfer
from pipeline.engine.kv_cache_manager import KVCacheManager
from pipeline.engine.preemption import make_policy
from pipeline.engine.request import ABORT_STATUS, FINISH_REASONS, Request, RequestStatus
from pipeline.engine.request_queue import WaitingQueue
from pipeline.messages import (
    CachedRequestData,
    EngineOutput,
    EngineRequest,
    EngineStats,
    ModelRunnerOutput,
    NewRequestData,
    SchedulerOutput,
    TokenLogprobs,
    bytes_to_ids,
    ids_to_bytes,
)
from pipeline.messages.engine_outputs import child_id
from pipeline.messages.kv import TransferPlan
from pipeline.messages.step import PromptLogprobs
from pipeline.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

# Admission holds back this many blocks per running request for their growth. Reset on a
# preemption (admission was too eager), decays while none happens (FastDeploy v1's scheme).
RESERVE_INIT = 1.0
RESERVE_MIN = 0.05
RESERVE_DECAY = 0.98
# Newly admitted requests one step may carry to the workers (their token ids and sampling
# params, encoded): the step must cross the step ring (runtime/rings.py: messages of at least
# 16 MiB, and of one largest request plus the rest of a step) with room for the rest. The
# first request of a step always goes.
NEW_REQUESTS_BYTES_PER_STEP = 8 << 20


def _child_params(sp: SamplingParams, index: int) -> SamplingParams:
    """Completion ``index``'s own params: one sample, its own seed (seed + index, as vLLM),
    and only the first child computes the prompt's logprobs."""
    return msgspec.structs.replace(
        sp, n=1, seed=None if sp.seed is None else (sp.seed + index) % 2**63,
        prompt_logprobs=sp.prompt_logprobs if index == 0 else None)


@dataclass(slots=True)
class _Step:
    """What one schedule() call has handed out so far."""
    budget: int
    num_sched: dict[str, int] = field(default_factory=dict)
    new_blocks: dict[str, list[int]] = field(default_factory=dict)
    preempted: list[Request] = field(default_factory=list)
    new_request_bytes: int = 0  # of the requests admitted in this step


class Scheduler:
    def __init__(self, config: EngineConfig, num_blocks: int, block_size: int,
                 max_model_len: int, hash_key: bytes | None = None, *,
                 clock: Callable[[], float] = time.monotonic, async_scheduling: bool = False) -> None:
        """``clock``: the monotonic clock of reservation deadlines (tests inject one).
        ``async_scheduling``: schedule requests in flight ahead (``engine.inflight``)."""
        for name, v in (("max_num_seqs", config.max_num_seqs),
                        ("max_num_batched_tokens", config.max_num_batched_tokens),
                        ("max_model_len", max_model_len)):
            if v < 1:
                raise ValueError(f"{name} must be >= 1, got {v}")
        if config.long_prefill_token_threshold < 0:
            raise ValueError(f"long_prefill_token_threshold must be >= 0 (0: automatic), got "
                             f"{config.long_prefill_token_threshold}")
        self.config = config
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.max_num_seqs = config.max_num_seqs
        self.max_num_batched_tokens = config.max_num_batched_tokens
        self.async_scheduling = async_scheduling
        # An explicit threshold always caps a prefill chunk; the default (0) caps it only when
        # the chunk shares the step with other requests, so a lone prompt still gets the whole
        # budget (TTFT) while a prefill never inflates a decode step by more than a quarter.
        self._explicit_threshold = config.long_prefill_token_threshold > 0
        self.long_prefill_token_threshold = (config.long_prefill_token_threshold
                                             or max(1, config.max_num_batched_tokens // 4))
        self.kv = KVCacheManager(num_blocks, block_size, config.enable_prefix_caching, hash_key)
        self.policy = make_policy(config.preemption_policy)
        self.requests: dict[str, Request] = {}
        self.parents: dict[str, list[Request]] = {}  # client id -> children (n > 1)
        self.waiting = WaitingQueue()
        self.running: list[Request] = []  # admission order
        self.step_id = 0
        self._admit_seq = 0
        self._finished_ids: list[str] = []  # the worker must drop them at the next step
        self._reserve = RESERVE_INIT
        self.num_preemptions = 0
        self.num_prompt_tokens = 0
        self.num_computed_tokens = 0  # prompt, recomputed and decode tokens run by the worker
        self.num_generated_tokens = 0
        self.num_stale_results = 0  # results for requests preempted/aborted while in flight
        # Disaggregation (engine.disagg): decode-role reservations, prefill-role leases.
        self.role = config.role
        self.clock = clock
        self.reservations = Reservations(self.kv, config.kv_transfer_timeout, clock)
        self.transfers = TransferLeases(self.kv.pool, block_size)
        # Prefill role: when each request's decode-side reservation ends (its sends must stop).
        self.send_deadlines: dict[str, float] = {}
        self._plan: TransferPlan | None = None  # this step's, until take_plan()
        self._kv_outputs: list[EngineOutput] = []  # reservations made in schedule()
        self.num_kv_transfers_failed = 0
        # Prefill role, --pd-fallback local: requests whose first token is out, waiting for
        # their transfers' reports (PARKED: in self.requests, not in running nor waiting).
        self.parked: dict[str, Request] = {}
        self.num_kv_fallbacks = 0  # requests decoded here after their transfer failed
        self.num_kv_ready_ignored = 0  # KVReady for no reservation (gone, or never made)

    # -- admission and abort ------------------------------------------------------------
    def add_request(self, er: EngineRequest) -> None:
        """Queue a validated request (``tokenizer.validate``); ValueError if it could never
        fit in the whole KV cache, which only the engine knows. A refused prefill-role request
        still owes its decode peer a KVFinish (so the reservation there ends now)."""
        try:
            self._add_request(er)
        except ValueError as exc:
            if er.req_id not in self.requests:
                self.transfers.refused(er, str(exc))
            raise

    def _add_request(self, er: EngineRequest) -> None:
        sp = er.sampling_params
        n = sp.n
        ids = [child_id(er.req_id, k, n) for k in range(n)]
        for rid in {er.req_id, *ids}:
            if rid in self.requests or rid in self.parents:
                raise ValueError(f"request id {rid!r} is already in the engine")
            if rid in self.reservations.quarantine:  # its KVReady must free only its blocks
                raise ValueError(f"request id {rid!r} is still in the engine: a prefill instance "
                                 f"may be writing into its ended reservation's KV blocks")
        prompt = bytes_to_ids(er.prompt_token_ids).tolist()
        kvt = er.kv_transfer
        if kvt is not None:
            check_kv_transfer(er, self.role, self.block_size, len(prompt))
        # The last sampled token's KV is never computed, hence total - 1.
        need = -(-(len(prompt) + sp.max_tokens - 1) // self.block_size)
        sending = kvt is not None and kvt.role == "prefill"
        max_tokens = 1 if sending and need > self.kv.pool.num_blocks else sp.max_tokens
        if sending:  # it ends after its first token, unless it falls back (and fits)
            need = -(-(len(prompt) + max_tokens - 1) // self.block_size)
        if need > self.kv.pool.num_blocks:
            raise ValueError(f"prompt ({len(prompt)} tokens) + max_tokens ({max_tokens}) needs "
                             f"{need} KV blocks of {self.block_size} tokens, more than the whole "
                             f"KV cache (num_blocks={self.kv.pool.num_blocks})")
        eos = frozenset(er.eos_token_ids)
        params_bytes = len(msgspec.msgpack.encode(sp))
        children = [Request(rid, prompt, _child_params(sp, k) if n > 1 else sp, er.arrival_time,
                            eos, er.priority, er.cache_salt, out_id=er.req_id, index=k,
                            params_bytes=params_bytes)
                    for k, rid in enumerate(ids)]
        first = children[0]
        self.kv.hash_new_blocks(first)
        for c in children:
            c.block_hashes = list(first.block_hashes)  # same prompt, same chain
            self.requests[c.req_id] = c
        self.num_prompt_tokens += len(prompt)
        if kvt is not None and kvt.role == "decode":
            self.reservations.add(first)  # n == 1: no siblings
            return
        first.kv_send = kvt  # prefill role, or None
        # A request whose max_tokens does not fit this pool cannot decode here: it fails.
        first.kv_fallback = sending and self.config.pd_fallback == "local" and \
            max_tokens == sp.max_tokens
        if kvt is not None and kvt.deadline_s > 0:
            self.send_deadlines[first.req_id] = self.clock() + max(0.0, kvt.deadline_s - SEND_MARGIN_S)
        first.order = self.waiting.add(first)
        if n > 1:
            self.parents[er.req_id] = children
            first.held = children[1:]
            if not self.kv.enable_caching:
                self._release_siblings(first)  # nothing to share: no reason to wait

    def _release_siblings(self, first: Request) -> None:
        """Queue the held siblings of ``first`` at its place in the queue."""
        held, first.held = first.held, []
        for c in held:
            if c.status == RequestStatus.WAITING:
                self.waiting.add(c, first.order)

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
            children = self.parents.get(rid)
            for req in children if children is not None else [self.requests.get(rid)]:
                if req is None or req.req_id not in self.requests:
                    continue  # unknown or already finished: its final output went out already
                if req.status == RequestStatus.PARKED and status in (
                        RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH):
                    # A stop string on its first token: it ends so once its transfer is
                    # settled (ok: the decode side finds the same stop; failed: it ends here).
                    req.kv_end = status
                    continue
                self._detach(req)
                req.status = status
                self._finish(req, why or f"finished ({reason}) before its first token")
                outs.append(self._output(req, [], why))
        return outs

    def _detach(self, req: Request) -> None:
        """Take a live request out of the list or queue it is in (before finishing it)."""
        if req.status == RequestStatus.RUNNING:
            self.running.remove(req)
        elif req.status == RequestStatus.PARKED:
            del self.parked[req.req_id]
        elif req.status == RequestStatus.WAITING_FOR_KV:
            self.reservations.discard(req)
        else:
            self.waiting.discard(req)  # a no-op for a held sibling

    def _fail(self, req: Request, code: str, message: str) -> list[EngineOutput]:
        """End a live request as an error with ``code`` (the answer's ErrorInfo.code)."""
        self._detach(req)
        req.status = RequestStatus.FINISHED_ERROR
        self._finish(req, message)
        return [self._output(req, [], message, error_code=code)]

    def _finish(self, req: Request, why: str = "") -> None:
        """``why``: for a prefill-role PD request ending before its first token, what its
        KVFinish tells the decode instance."""
        if req.kv_send is not None:
            self.transfers.finish(req, error=why or "the prefill request ended before its first token")
            self.send_deadlines.pop(req.req_id, None)
        self.kv.free(req)
        req.finish_time = time.time()
        inflight.reset(req)
        del self.requests[req.req_id]
        if req.sent_to_worker:
            self._finished_ids.append(req.req_id)
        if req.held:  # never computed its prompt: the siblings compute it themselves
            self._release_siblings(req)
        children = self.parents.get(req.out_id)
        if children is not None and all(c.req_id not in self.requests for c in children):
            del self.parents[req.out_id]

    def _preempt(self, req: Request) -> None:
        self.kv.free(req)
        req.status = RequestStatus.PREEMPTED
        req.num_computed_tokens = 0
        inflight.reset(req)
        req.sent_to_worker = False
        req.num_preemptions += 1
        req.kv_sent_blocks = 0  # prefill role: send again from the remote prefix-hit boundary
        self.num_preemptions += 1
        self._reserve = RESERVE_INIT
        self.waiting.add_front(req)

    def has_unfinished_requests(self) -> bool:
        """Whether a step has work (or may have, once blocks free up). Decode-role
        reservations and parked prefill-role requests are no work for a step: the stage
        waits for KV, transfer reports or a deadline."""
        return len(self.requests) > len(self.reservations) + len(self.parked)

    # -- one step -----------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        self.step_id += 1
        step = self.step_id
        st = _Step(self.max_num_batched_tokens)
        bs = self.block_size
        order: list[Request] = []  # batch order: decodes, then continuing prefills
        prefills: list[Request] = []
        ahead, max_len = self.async_scheduling, self.max_model_len
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
            # Fast path: the decode token still fits in the request's last block.
            elif start < len(req.blocks) * bs or self._grow(req, 1, st):
                st.num_sched[req.req_id] = 1
                st.budget -= 1
                inflight.mark_scheduled(req, step, 1)
                order.append(req)
        threshold = self.long_prefill_token_threshold
        capped = self._explicit_threshold or len(self.running) > 1
        for req in prefills:
            if st.budget <= 0:
                break
            if req.status != RequestStatus.RUNNING:
                continue
            n = min(len(req.all_token_ids) + req.num_placeholders - req.num_computed_tokens
                    - req.num_inflight_tokens, st.budget)
            if capped:
                n = min(n, threshold)
            if self._grow(req, n, st):
                st.num_sched[req.req_id] = n
                st.budget -= n
                inflight.mark_scheduled(req, step, n)
                order.append(req)
        num_sched, new_blocks = st.num_sched, st.new_blocks
        # The worker's count before this step: its own, after the steps in flight.
        cached_reqs = [CachedRequestData(r.req_id, new_blocks.get(r.req_id, []),
                                         r.num_computed_tokens + r.num_inflight_tokens - num_sched[r.req_id])
                       for r in order if r.req_id in num_sched]
        budget, preempted = st.budget, st.preempted
        new_reqs: list[NewRequestData] = []
        # No admission in a step that had to preempt: the pool is too tight for more work.
        if not preempted:
            self._reserve = max(RESERVE_MIN, self._reserve * RESERVE_DECAY)
            self._admit(step, budget, num_sched, new_reqs, st)
            if self.reservations.queued:
                self._kv_outputs += self._reserve_kv()
        if self.role == "prefill":
            self._plan_step(step, num_sched)
        finished, self._finished_ids = self._finished_ids, []
        return SchedulerOutput(step, new_reqs, cached_reqs, num_sched, sum(num_sched.values()),
                               finished, [r.req_id for r in preempted])

    def _grow(self, req: Request, n: int, st: _Step) -> bool:
        """Room for ``n`` more tokens of running ``req``, preempting victims until it fits.

        False when ``req`` itself had to go. A victim already scheduled in this step gives
        its tokens back to the budget.
        """
        while (blocks := self.kv.allocate_slots(req, req.num_inflight_tokens + n)) is None:
            victim = self.policy.select_victim(self.running)
            if self.running[-1] is victim:
                self.running.pop()
            else:
                self.running.remove(victim)
            if victim.req_id in st.num_sched:  # its bookkeeping goes with _preempt's reset
                st.budget += st.num_sched.pop(victim.req_id)
                st.new_blocks.pop(victim.req_id, None)
            self._preempt(victim)
            st.preempted.append(victim)
            if victim is req:
                return False
        if blocks:
            st.new_blocks[req.req_id] = [b.block_id for b in blocks]
        return True

    def _admit(self, step: int, budget: int, num_sched: dict[str, int],
               new_reqs: list[NewRequestData], st: _Step) -> None:
        running, kv = self.running, self.kv
        reserve = int(self._reserve * len(running))
        while budget > 0 and len(running) < self.max_num_seqs:
            req = self.waiting.peek()
            if req is None:
                break
            # Prompt logprobs need every prompt position's logits: no prefix-cache hit. A
            # request holding blocks (decode role: its prompt's KV arrived) looks up nothing.
            held = bool(req.blocks)
            computed, n_hit = ([], 0) if req.owes_prompt_logprobs or held else \
                kv.get_computed_blocks(req)
            n = min(req.num_tokens - req.num_computed_tokens - n_hit, budget)
            if self._explicit_threshold or running:
                n = min(n, self.long_prefill_token_threshold)
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
            self.waiting.pop()
            if not held:
                kv.record_lookup(req.num_tokens, n_hit)
            if req.num_cached_tokens < 0:
                req.num_cached_tokens = n_hit
                req.first_scheduled_time = time.time()
            req.status = RequestStatus.RUNNING
            inflight.mark_scheduled(req, step, n)
            req.sent_to_worker = True
            self._admit_seq += 1
            req.admit_seq = self._admit_seq
            running.append(req)
            num_sched[req.req_id] = n
            budget -= n
            st.new_request_bytes += size
            new_reqs.append(NewRequestData(req.req_id, ids_to_bytes(req.all_token_ids),
                                           req.num_prompt_tokens, req.sampling_params,
                                           [b.block_id for b in req.blocks],
                                           req.num_computed_tokens))

    def update_from_output(self, sched: SchedulerOutput,
                           out: ModelRunnerOutput) -> list[EngineOutput]:
        sampled = dict(zip(out.req_ids, out.sampled_token_ids))
        logprobs = dict(zip(out.req_ids, out.logprobs)) if out.logprobs else None
        prompt_lps = {p.req_id: p for p in out.prompt_logprobs} if out.prompt_logprobs else None
        outputs: list[EngineOutput] = []
        any_finished = False
        kv, step, max_len, bs = self.kv, sched.step_id, self.max_model_len, self.block_size
        caching = kv.enable_caching
        requests = self.requests
        for rid, n in sched.num_scheduled_tokens.items():
            req = requests.get(rid)
            # Stale: aborted, finished, preempted (maybe re-admitted) since it was scheduled.
            if req is None or not inflight.take_result(req, step, n):
                self.num_stale_results += 1
                continue
            computed = req.num_computed_tokens
            self.num_computed_tokens += n
            if caching and computed // bs > req.num_cached_blocks:
                kv.cache_computed_blocks(req)
            if req.held and computed >= req.num_prompt_tokens:
                self._release_siblings(req)  # the prompt's blocks are cached now
            plp = self._prompt_logprobs(req, prompt_lps.get(rid)) if prompt_lps else None
            toks = req.all_token_ids
            tok = sampled.get(rid)
            if tok is None:
                if computed == len(toks):
                    raise RuntimeError(f"worker sampled no token for {rid!r} after computing all "
                                       f"{computed} known tokens")
                if plp:
                    outputs.append(self._output(req, [], None, prompt_logprobs=plp))
                continue
            if computed != len(toks):
                raise RuntimeError(f"worker sampled a token for {rid!r} mid-prefill "
                                   f"({computed}/{len(toks)} computed)")
            toks.append(tok)
            req.num_placeholders -= 1
            self.num_generated_tokens += 1
            if caching and len(toks) % bs == 0:
                kv.hash_new_blocks(req)
            n_toks = len(toks)
            # Inline pre-check: most tokens can end nothing, skip the full stop rules.
            done = (tok in req.stop_ids or n_toks >= req.max_num_tokens
                    or n_toks >= max_len) and req.check_stop(max_len)
            if req.kv_send is not None and not req.kv_finished:  # prefill role: the first token
                done = self._first_token(req, tok, done)
                any_finished = True  # ended or parked: out of the running list either way
            lp = logprobs.get(rid) if logprobs else None
            outputs.append(EngineOutput(req.out_id, [tok], FINISH_REASONS.get(req.status) if done else None,
                                        req.stop_reason, [lp] if lp else None,
                                        req.num_prompt_tokens, req.num_cached_tokens,
                                        req.first_scheduled_time, None, req.index, plp))
            if done:
                any_finished = True
                self._finish(req)
        if any_finished:
            self.running = [r for r in self.running if r.status == RequestStatus.RUNNING]
        return outputs

    @staticmethod
    def _prompt_logprobs(req: Request, p: PromptLogprobs | None) -> list[TokenLogprobs] | None:
        """The part of a step's prompt logprobs not sent yet (a rerun after preemption
        computes them again)."""
        if p is None:
            return None
        sent = req.prompt_logprobs_sent
        if p.start > sent:
            raise RuntimeError(f"worker sent prompt logprobs of {req.req_id!r} from token "
                               f"{p.start}, expected from {sent} or before")
        new = p.logprobs[sent - p.start:]
        req.prompt_logprobs_sent = max(sent, p.start + len(p.logprobs))
        return new or None

    @staticmethod
    def _output(req: Request, toks: list[int], error: str | None,
                prompt_logprobs: list[TokenLogprobs] | None = None,
                error_code: str | None = None) -> EngineOutput:
        return EngineOutput(req.out_id, toks, req.finish_reason, req.stop_reason, None,
                            req.num_prompt_tokens, max(req.num_cached_tokens, 0),
                            req.first_scheduled_time, error, req.index, prompt_logprobs,
                            error_code=error_code)

    # -- disaggregation (engine.scheduler_pd) ------------------------------------------------
    _reserve_kv = scheduler_pd.reserve_kv
    poll_kv = scheduler_pd.poll_kv
    expire_reservations = scheduler_pd.expire_reservations
    next_kv_deadline = scheduler_pd.next_kv_deadline
    take_outputs = scheduler_pd.take_outputs
    on_kv_ready = scheduler_pd.on_kv_ready
    _plan_step = scheduler_pd.plan_step
    take_plan = scheduler_pd.take_plan
    drop_plan = scheduler_pd.drop_plan
    _kv_failed = scheduler_pd.kv_failed
    _first_token = scheduler_pd.first_token
    on_transfer_report = scheduler_pd.on_transfer_report
    take_kv_finishes = scheduler_pd.take_kv_finishes

    # -- observability ------------------------------------------------------------------
    def stats(self) -> EngineStats:
        pool = self.kv.pool
        return EngineStats(
            # Requests queued for a reservation wait for blocks too.
            running=len(self.running), waiting=len(self.waiting) + len(self.reservations.queued),
            kv_blocks_total=pool.num_blocks, kv_blocks_used=pool.num_used_blocks,
            kv_blocks_cached=len(pool.cached), kv_blocks_cached_evictable=pool.num_cached_free,
            kv_blocks_free=pool.num_free_blocks - pool.num_cached_free,
            kv_usage=pool.num_used_blocks / pool.num_blocks,
            prefix_cache_hit_rate=self.kv.hit_rate,
            prefix_cache_queried_tokens=self.kv.num_queried_tokens,
            prefix_cache_hit_tokens=self.kv.num_hit_tokens,
            num_preemptions=self.num_preemptions, num_evictions=pool.num_evictions,
            prompt_tokens=self.num_prompt_tokens, computed_tokens=self.num_computed_tokens,
            generation_tokens=self.num_generated_tokens,
            stale_results_dropped=self.num_stale_results,
            reserve_blocks_per_running=self._reserve,
            kv_reserved_requests=len(self.reservations.reserved),
            kv_reserved_blocks=self.reservations.num_reserved_blocks,  # quarantined ones too
            kv_reservation_timeouts=self.reservations.num_timeouts,
            kv_transfer_leased_blocks=self.transfers.num_leased_blocks,
            kv_transfers_failed=self.num_kv_transfers_failed)

    def check_invariants(self) -> list[str]:
        """O(blocks) audit of the block table; logs and returns violations (empty: sound)."""
        res = self.reservations
        errs = audit_block_table(self.kv.pool, self.requests.values(), len(self.running),
                                 self.transfers.held + res.quarantined_block_ids())
        errs += res.check()
        errs += [f"quarantined request {rid} is live again" for rid in res.quarantine
                 if rid in self.requests]
        errs += [f"parked request {rid} ({r.status.name}) is not PARKED or not live"
                 for rid, r in self.parked.items()
                 if r.status != RequestStatus.PARKED or self.requests.get(rid) is not r]
        errs += [f"request {r.req_id} is PARKED but not in the parked table"
                 for r in self.requests.values()
                 if r.status == RequestStatus.PARKED and r.req_id not in self.parked]
        for r in self.requests.values():
            errs += inflight.check(r, self.block_size)
        for e in errs:
            logger.error("KV block table invariant violated: %s", e)
        return errs
