"""Engine stage: the Scheduler's steps of prefill/decode disaggregation, both roles.

Methods of ``engine.scheduler.Scheduler`` (its class body binds each function here under the
same name), kept apart so the scheduler module reads as the plain engine. No state of their
own: they act on the Scheduler's requests and on the PD state ``engine.disagg`` keeps beside
them (``Scheduler.reservations``, ``Scheduler.transfers``).

Decode role: a request reserves blocks for its prompt (an output with a KVReservation, made
in ``poll_kv`` or in ``schedule()`` and collected by ``take_outputs``), waits for
``on_kv_ready`` (or times out in ``poll_kv``), appends the prefill instance's first token and
joins the batch holding its blocks with the prompt computed. A reservation that ended before
its KV arrived leaves its writable blocks in the quarantine until its KVReady or deadline.
Prefill role: each step that computes a PD request's prompt has a TransferPlan
(``take_plan``) whose blocks stay leased until ``on_transfer_report``; the KVFinish of each PD
request goes out via ``take_kv_finishes``. A PD request ends after its first token
(``first_token``), whatever its max_tokens: the decode instance decodes it. With
``--pd-fallback local`` it ends only once every step that carried its sends is reported:
parked until then (``Scheduler.parked``), then ended (``settle_parked``), or, on any failed
transfer, decoded here (``kv_failed``: its KVFinish says FALLBACK_ERROR); without it a failed
transfer fails the request.
"""
from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import TYPE_CHECKING

from pipeline.engine.request import Request, RequestStatus
from pipeline.messages import EngineOutput
from pipeline.messages.kv import FALLBACK_ERROR, KVFinish, KVReady, TransferPlan, TransferReport

if TYPE_CHECKING:
    from pipeline.engine.scheduler import Scheduler

logger = logging.getLogger(__name__)


# -- decode role -----------------------------------------------------------------------------
def reserve_kv(self: Scheduler) -> list[EngineOutput]:
    """Reserve blocks for queued decode-role requests (FCFS), keeping the running requests'
    reserve free as admission does; their KVReservation outputs."""
    res = self.reservations
    return [res.output(req, self.config.kv_listen)
            for req in res.reserve(int(self._reserve * len(self.running)))]


def poll_kv(self: Scheduler) -> list[EngineOutput]:
    """Between steps (decode role): free quarantined blocks past their deadline, fail
    reservations past theirs, then reserve blocks for queued requests. The outputs to emit
    (failures, KVReservations)."""
    res = self.reservations
    if res.quarantine:
        res.release_expired()
    outs = expire_sends(self) if self.send_deadlines else []
    if not res:
        return outs
    outs += self.expire_reservations()
    if res.queued:
        outs += self._reserve_kv()
    return outs


def expire_sends(self: Scheduler) -> list[EngineOutput]:
    """Prefill role: fail the requests whose decode-side reservation has ended (or is about
    to: SEND_MARGIN_S) before their prompt's KV went out; nothing more is sent for them."""
    now = self.clock()
    outs: list[EngineOutput] = []
    for rid in [r for r, t in self.send_deadlines.items() if t <= now]:
        del self.send_deadlines[rid]
        req = self.requests.get(rid)
        if req is not None and not req.kv_finished:
            outs += self._fail(req, "kv_transfer_timeout", (
                "the decode instance's reservation for this request ended before its prompt's "
                "KV was sent (--kv-transfer-timeout there)"))
    return outs


def expire_reservations(self: Scheduler) -> list[EngineOutput]:
    """Fail every reservation (queued or holding blocks) past its deadline, freeing its
    blocks but the quarantined ones."""
    outs: list[EngineOutput] = []
    for req in self.reservations.expired():
        why = self.reservations.timeout_message(req)
        req.status = RequestStatus.FINISHED_ERROR
        self._finish(req, why)
        outs.append(self._output(req, [], why, error_code="kv_transfer_timeout"))
    return outs


def next_kv_deadline(self: Scheduler) -> float | None:
    """The earliest reservation or quarantine deadline on the scheduler's clock (None: none):
    the stage must wake by then to expire it."""
    deadlines = [self.reservations.next_deadline(), *self.send_deadlines.values()]
    return min((d for d in deadlines if d is not None), default=None)


def take_outputs(self: Scheduler) -> list[EngineOutput]:
    """Outputs made by ``schedule()`` outside any step result (KVReservations)."""
    outs, self._kv_outputs = self._kv_outputs, []
    return outs


def on_kv_ready(self: Scheduler, msg: KVReady) -> list[EngineOutput]:
    """The prompt's KV of reservation ``msg.req_id`` arrived (with the prefill instance's
    first token), or failed; either way the prefill side writes no more into its blocks.
    For a reservation that ended meanwhile it frees the quarantined blocks; other unknown
    ids are ignored (counted)."""
    req = self.reservations.take(msg.req_id)
    if req is None:
        if self.reservations.release(msg.req_id):
            return []  # aborted or timed out, answered then: only its blocks were left
        self.num_kv_ready_ignored += 1
        logger.warning("KVReady for %r, which holds no reservation (finished, timed out or "
                       "unknown): ignored", msg.req_id)
        return []
    if msg.error == FALLBACK_ERROR:  # not a failure of the request: the router takes P's answer
        return self._fail(req, "kv_fallback", FALLBACK_ERROR)
    if msg.error or msg.token < 0:
        self.num_kv_transfers_failed += 1
        why = msg.error or "the prefill instance sent no first token"
        return self._fail(req, "kv_transfer_failed", f"KV transfer from the prefill instance "
                                                     f"failed: {why}")
    req.num_computed_tokens = req.num_prompt_tokens
    req.kv_received = True
    self.kv.cache_computed_blocks(req)  # the decode side's prefix cache has the prompt now
    toks = req.all_token_ids
    toks.append(msg.token)
    self.num_generated_tokens += 1
    if self.kv.enable_caching and len(toks) % self.block_size == 0:
        self.kv.hash_new_blocks(req)
    done = req.check_stop(self.max_model_len)
    out = EngineOutput(req.out_id, [msg.token], req.finish_reason if done else None,
                       req.stop_reason, None, req.num_prompt_tokens, req.num_cached_tokens,
                       req.first_scheduled_time, None, req.index)
    if done:
        self._finish(req)
    else:
        # Joins the batch first thing, holding its blocks (see Scheduler._admit).
        req.status = RequestStatus.WAITING
        self.waiting.add_front(req)
    return [out]


# -- prefill role ----------------------------------------------------------------------------
def plan_step(self: Scheduler, step: int, num_sched: dict[str, int]) -> None:
    """End of ``schedule()`` (prefill role): the step's TransferPlan, kept for ``take_plan``."""
    if self._plan is not None:
        raise RuntimeError(f"step {self._plan.step_id}'s transfer plan was never taken "
                           "(take_plan): its blocks would stay leased forever")
    requests = self.requests
    scheduled: Iterable[tuple[Request, int]] = ((requests[r], n) for r, n in num_sched.items())
    self._plan = self.transfers.plan(step, scheduled)


def take_plan(self: Scheduler) -> TransferPlan | None:
    """The last schedule()'s TransferPlan (None: nothing to send). Send it to the cache
    messager before the step goes to the workers, or ``drop_plan`` it."""
    plan, self._plan = self._plan, None
    return plan


def drop_plan(self: Scheduler, plan: TransferPlan, why: str) -> list[EngineOutput]:
    """A plan that cannot be sent (``why``): release its lease; its requests' transfers
    failed (``kv_failed``)."""
    carried = self.transfers.release(plan.step_id) or []
    outs: list[EngineOutput] = []
    for s in plan.sends:
        req = self.requests.get(s.req_id)
        if req is not None and req.kv_send is not None and not req.kv_finished:
            self.num_kv_transfers_failed += 1
            outs += self._kv_failed(req, why)
    return outs + settle_parked(self, carried)


def on_transfer_report(self: Scheduler, rep: TransferReport) -> list[EngineOutput]:
    """The cache messager finished step ``rep.step_id``'s transfer: release its blocks;
    the requests whose transfer failed, if still alive and sending, failed (``kv_failed``);
    a parked request whose every transfer is now reported ends."""
    carried = self.transfers.release(rep.step_id)
    if carried is None:
        self.transfers.num_unknown_reports += 1
        logger.warning("TransferReport for step %d, which has no lease: ignored", rep.step_id)
    outs: list[EngineOutput] = []
    for rid, why in rep.failed.items():
        self.num_kv_transfers_failed += 1
        req = self.requests.get(rid)
        if req is not None and req.kv_send is not None and not req.kv_finished:
            outs += self._kv_failed(req, f"KV transfer to the decode instance failed: {why}")
    return outs + settle_parked(self, carried or [])


def kv_failed(self: Scheduler, req: Request, why: str) -> list[EngineOutput]:
    """A transfer of live prefill-role ``req`` failed (``why``): with --pd-fallback local
    (``req.kv_fallback``) it is decoded here, else it fails (``kv_transfer_failed``)."""
    if not req.kv_fallback:
        return self._fail(req, "kv_transfer_failed", why)
    logger.info("request %r: %s; decoding it here (--pd-fallback local)", req.req_id, why)
    self.num_kv_fallbacks += 1
    # After every plan that carried its sends (ring order): the decode side frees its
    # reservation once the last write is in, and fails its half with "kv_fallback".
    self.transfers.finish(req, error=FALLBACK_ERROR)
    req.kv_send = None  # a mixed request from now on: no more plans, no send deadline
    self.send_deadlines.pop(req.req_id, None)
    if req.status != RequestStatus.PARKED:
        return []  # still computing its prompt: its first token ends nothing now
    del self.parked[req.req_id]
    if req.kv_end is not None:  # its first token (or a stop string on it) ended it anyway
        req.status = req.kv_end
        self._finish(req)
        return [self._output(req, [], None)]
    req.status = RequestStatus.RUNNING  # decodes on with the blocks it kept
    self.running.append(req)
    return []


def first_token(self: Scheduler, req: Request, token: int, done: bool) -> bool:
    """Prefill-role ``req`` sampled its first ``token`` (``done``: its own rules ended it).
    It ends there (the prefill rule: "length" unless ``done`` says otherwise), its KVFinish
    carrying the token, unless it may fall back and some transfer of it is not reported yet:
    then it is parked (False) until ``settle_parked`` or ``kv_failed`` decides."""
    self.send_deadlines.pop(req.req_id, None)  # nothing more is sent for it
    if req.kv_fallback and req.kv_pending:
        req.kv_end = req.status if done else None
        req.kv_first_token = token
        req.status = RequestStatus.PARKED
        self.parked[req.req_id] = req
        return False
    self.transfers.finish(req, token=token)
    if not done:
        req.status = RequestStatus.FINISHED_LENGTH
    return True


def settle_parked(self: Scheduler, carried: Iterable[Request]) -> list[EngineOutput]:
    """Of ``carried`` (a released step's requests), the parked ones whose every transfer is
    reported ok now end: KVFinish with the first token, a final output without tokens."""
    outs: list[EngineOutput] = []
    for req in carried:
        if req.status != RequestStatus.PARKED or req.kv_pending or \
                self.parked.get(req.req_id) is not req:
            continue
        del self.parked[req.req_id]
        self.transfers.finish(req, token=req.kv_first_token)
        req.status = req.kv_end or RequestStatus.FINISHED_LENGTH
        self._finish(req)
        outs.append(self._output(req, [], None))
    return outs


def take_kv_finishes(self: Scheduler) -> list[KVFinish]:
    """The KVFinish messages owed to the cache messager (send them after the plans); at most
    one per request (``TransferLeases.finish``), so an abort after it sends none."""
    return self.transfers.take_finishes()
