"""Engine stage, prefill role: requests whose prompt's KV goes to a decode instance.

Owns / State: each PD request's ``SendState`` (``sends``, by request id), the
``TransferLeases`` (per step: the plan's blocks until its report, the KVFinish messages
owed), the decode peers a transfer reached (``proven``, bounded), when each request's
decode-side reservation ends (``send_deadlines``: its sends must stop), the requests
``parked`` after their first token and this step's plan until the engine core takes it.

Each step that computes a PD request's prompt has a TransferPlan (``take_plan``) whose blocks
stay leased until ``on_message(TransferReport)``; the KVFinish of each PD request goes out via
``take_kv_finishes``. A PD request ends after its first token (``on_token``), whatever its
max_tokens: the decode instance decodes it. With ``--pd-fallback local``, or while its decode
peer is not ``proven`` (no transfer to it reported ok yet, or the last one failed), it ends
only once every step that carried its sends is reported: parked until then, then ended
(``_settle_parked``), or, on any failed transfer, decoded here (``_failed``: its KVFinish says
FALLBACK_ERROR) or failed. So a peer that refuses every transfer (another KV layout) fails
each request here, naming why, whichever of the messager and the sampler is faster; a proven
peer costs the first token no wait.
"""
from __future__ import annotations

import logging
from collections import Counter, OrderedDict
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from pipeline.engine.kv_connector.base import KVConnector
from pipeline.engine.kv_connector.leases import SEND_MARGIN_S, SendState, TransferLeases
from pipeline.engine.request import Request, RequestStatus
from pipeline.engine.step_outputs import final_output
from pipeline.messages import EngineOutput, EngineRequest
from pipeline.messages.kv import FALLBACK_ERROR, KVFinish, TransferPlan, TransferReport

if TYPE_CHECKING:
    from pipeline.engine.scheduler import Scheduler

logger = logging.getLogger(__name__)

MAX_PROVEN = 1024  # decode peers remembered as reached (least recently proven forgotten)


class PrefillConnector(KVConnector):
    role = "prefill"

    def __init__(self, sched: Scheduler) -> None:
        super().__init__(sched)
        self.fallback_local = sched.config.kv_transfer_config.pd_fallback == "local"
        self.sends: dict[str, SendState] = {}
        self.transfers = TransferLeases(sched.kv.pool, sched.block_size)
        self.send_deadlines: dict[str, float] = {}
        self.parked: dict[str, Request] = {}
        self.proven: OrderedDict[str, None] = OrderedDict()  # peer endpoint, oldest first
        self._plan: TransferPlan | None = None
        self.num_kv_transfers_failed = 0
        self.num_kv_fallbacks = 0  # requests decoded here after their transfer failed

    # -- admission -------------------------------------------------------------------------
    def tokens_to_fit(self, er: EngineRequest, num_prompt: int) -> int:
        """A PD request ends after its first token unless it falls back: it needs the whole
        max_tokens only if that fits the pool (else it may not fall back)."""
        max_tokens = er.sampling_params.max_tokens
        if er.kv_transfer is None or self._fits(num_prompt, max_tokens):
            return max_tokens
        return 1

    def _fits(self, num_prompt: int, max_tokens: int) -> bool:
        need = -(-(num_prompt + max_tokens - 1) // self.sched.block_size)
        return need <= self.sched.kv.pool.num_blocks

    def add_request(self, req: Request, er: EngineRequest) -> bool:
        kvt = er.kv_transfer
        if kvt is None:
            return False
        # A request whose max_tokens does not fit this pool cannot decode here: it fails.
        fallback = self.fallback_local and self._fits(req.num_prompt_tokens, req.sampling_params.max_tokens)
        self.sends[req.req_id] = SendState(req, kvt, fallback)
        if kvt.deadline_s > 0:
            self.send_deadlines[req.req_id] = self.sched.clock() + max(0.0, kvt.deadline_s - SEND_MARGIN_S)
        return False  # queued as any request

    def refused(self, er: EngineRequest, why: str) -> None:
        self.transfers.refused(er, why)

    # -- each step -------------------------------------------------------------------------
    def build_connector_meta(self, step: int, num_sched: dict[str, int], admitted: bool) -> None:
        """This step's TransferPlan, kept for ``take_plan``."""
        if self._plan is not None:
            raise RuntimeError(f"step {self._plan.step_id}'s transfer plan was never taken "
                               "(take_plan): its blocks would stay leased forever")
        sends = self.sends
        scheduled: Iterable[tuple[SendState, int]] = (
            (sends[r], n) for r, n in num_sched.items() if r in sends)
        self._plan = self.transfers.plan(step, scheduled)

    def on_token(self, req: Request, token: int, done: bool) -> bool | None:
        """Its first ``token``: the request ends there (the prefill rule: "length" unless
        ``done`` says otherwise), its KVFinish carrying the token, unless some transfer of it
        is not reported yet and it may fall back or its peer is not proven: then it is parked
        (False) until ``_settle_parked`` or ``_failed`` decides."""
        st = self.sends.get(req.req_id)
        if st is None or st.finished:
            return None
        self.send_deadlines.pop(req.req_id, None)  # nothing more is sent for it
        if st.pending and (st.fallback or st.params.peer not in self.proven):
            st.end = req.status if done else None
            st.first_token = token
            req.status = RequestStatus.PARKED
            self.parked[req.req_id] = req
            return False
        self.transfers.finish(st, token=token)
        if not done:
            req.status = RequestStatus.FINISHED_LENGTH
        return True

    # -- leaving ---------------------------------------------------------------------------
    def defer_abort(self, req: Request, status: RequestStatus) -> bool:
        """A stop string on its first token: it ends so once its transfer is settled (ok: the
        decode side finds the same stop; failed: it ends here)."""
        if req.status == RequestStatus.PARKED and status in (
                RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH):
            self.sends[req.req_id].end = status
            return True
        return False

    def detach(self, req: Request) -> bool:
        return self.parked.pop(req.req_id, None) is not None

    def request_finished(self, req: Request, why: str) -> None:
        st = self.sends.pop(req.req_id, None)
        if st is not None:
            self.transfers.finish(st, error=why or "the prefill request ended before its first token")
            self.send_deadlines.pop(req.req_id, None)

    def on_preempt(self, req: Request) -> None:
        st = self.sends.get(req.req_id)
        if st is not None:
            st.sent_blocks = 0  # sent again from the remote prefix-hit boundary

    # -- between steps ---------------------------------------------------------------------
    def poll(self) -> list[EngineOutput]:
        """Fail the requests whose decode-side reservation has ended (or is about to:
        SEND_MARGIN_S) before their prompt's KV went out; nothing more is sent for them."""
        if not self.send_deadlines:
            return []
        now = self.sched.clock()
        outs: list[EngineOutput] = []
        for rid in [r for r, t in self.send_deadlines.items() if t <= now]:
            del self.send_deadlines[rid]
            st = self.sends.get(rid)
            if st is not None and not st.finished:
                outs += self.sched.fail(st.req, "kv_transfer_timeout", (
                    "the decode instance's reservation for this request ended before its prompt's "
                    "KV was sent (--kv-transfer-timeout there)"))
        return outs

    def next_deadline(self) -> float | None:
        return min(self.send_deadlines.values(), default=None)

    def take_plan(self) -> TransferPlan | None:
        plan, self._plan = self._plan, None
        return plan

    def drop_plan(self, plan: TransferPlan, why: str) -> list[EngineOutput]:
        """A plan that cannot be sent (``why``): release its lease; its requests' transfers
        failed (``_failed``)."""
        carried = self.transfers.release(plan.step_id) or []
        outs: list[EngineOutput] = []
        for s in plan.sends:
            st = self.sends.get(s.req_id)
            if st is not None and not st.finished:
                self.num_kv_transfers_failed += 1
                outs += self._failed(st, why)
        return outs + self._settle_parked(carried)

    def on_message(self, msg: Any) -> list[EngineOutput]:
        if not isinstance(msg, TransferReport):
            return super().on_message(msg)
        return self.on_transfer_report(msg)

    def on_transfer_report(self, rep: TransferReport) -> list[EngineOutput]:
        """The cache messager finished step ``rep.step_id``'s transfer: release its blocks;
        the requests whose transfer failed, if still alive and sending, failed (``_failed``);
        a parked request whose every transfer is now reported ends."""
        carried = self.transfers.release(rep.step_id)
        if carried is None:
            self.transfers.num_unknown_reports += 1
            logger.warning("TransferReport for step %d, which has no lease: ignored", rep.step_id)
        self._prove(carried or [], rep.failed)
        outs: list[EngineOutput] = []
        for rid, why in rep.failed.items():
            self.num_kv_transfers_failed += 1
            st = self.sends.get(rid)
            if st is not None and not st.finished:
                outs += self._failed(st, f"KV transfer to the decode instance failed: {why}")
        return outs + self._settle_parked(carried or [])

    def _prove(self, carried: list[SendState], failed: dict[str, str]) -> None:
        """A report's verdict on the peers of the sends it carried: reached (proven) or not."""
        proven = self.proven
        bad = {st.params.peer for st in carried if st.req.req_id in failed}
        for st in carried:
            peer = st.params.peer
            if peer in bad:
                proven.pop(peer, None)
                continue
            proven[peer] = None
            proven.move_to_end(peer)
            if len(proven) > MAX_PROVEN:
                proven.popitem(last=False)

    def _failed(self, st: SendState, why: str) -> list[EngineOutput]:
        """A transfer of live ``st.req`` failed (``why``): with --pd-fallback local
        (``st.fallback``) it is decoded here, else it fails (``kv_transfer_failed``)."""
        sched, req = self.sched, st.req
        if not st.fallback:
            return sched.fail(req, "kv_transfer_failed", why)
        logger.info("request %r: %s; decoding it here (--pd-fallback local)", req.req_id, why)
        self.num_kv_fallbacks += 1
        # After every plan that carried its sends (ring order): the decode side frees its
        # reservation once the last write is in, and fails its half with "kv_fallback".
        self.transfers.finish(st, error=FALLBACK_ERROR)
        del self.sends[req.req_id]  # a mixed request from now on: no more plans, no deadline
        self.send_deadlines.pop(req.req_id, None)
        if req.status != RequestStatus.PARKED:
            return []  # still computing its prompt: its first token ends nothing now
        del self.parked[req.req_id]
        if st.end is not None:  # its first token (or a stop string on it) ended it anyway
            req.status = st.end
            sched.finish(req)
            return [final_output(req, [], None)]
        sched.run(req)  # decodes on with the blocks it kept
        return []

    def _settle_parked(self, carried: Iterable[SendState]) -> list[EngineOutput]:
        """Of ``carried`` (a released step's sends), the parked requests whose every transfer
        is reported ok now end: KVFinish with the first token, a final output without tokens."""
        sched, outs = self.sched, []
        for st in carried:
            req = st.req
            if req.status != RequestStatus.PARKED or st.pending or \
                    self.parked.get(req.req_id) is not req:
                continue
            del self.parked[req.req_id]
            self.transfers.finish(st, token=st.first_token)
            req.status = st.end or RequestStatus.FINISHED_LENGTH
            sched.finish(req)
            outs.append(final_output(req, [], None))
        return outs

    def take_kv_finishes(self) -> list[KVFinish]:
        """At most one per request (``TransferLeases.finish``), so an abort after it sends none."""
        return self.transfers.take_finishes()

    # -- accounting ------------------------------------------------------------------------
    @property
    def num_held(self) -> int:
        return len(self.parked)

    def may_hold_blocks(self, req: Request) -> bool:
        return req.status == RequestStatus.RUNNING or req.status == RequestStatus.PARKED

    def held_block_ids(self) -> Counter[int]:
        return Counter(self.transfers.held)

    def check(self) -> list[str]:
        requests = self.sched.requests
        errs = [f"parked request {rid} ({r.status.name}) is not PARKED or not live"
                for rid, r in self.parked.items()
                if r.status != RequestStatus.PARKED or requests.get(rid) is not r]
        errs += [f"request {r.req_id} is PARKED but not in the parked table"
                 for r in requests.values()
                 if r.status == RequestStatus.PARKED and r.req_id not in self.parked]
        errs += [f"send state of {rid} outlives its request" for rid in self.sends
                 if rid not in requests]
        return errs

    def stats(self) -> dict[str, int | float]:
        return {"kv_transfer_leased_blocks": self.transfers.num_leased_blocks,
                "kv_transfers_failed": self.num_kv_transfers_failed}
