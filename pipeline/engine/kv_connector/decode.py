"""Engine stage, decode role: requests whose prompt's KV a prefill instance computes.

Owns / State: the ``Reservations`` (queued, reserved, quarantine; see
``kv_connector.reservations``), the ids of requests whose KV arrived (``received``: they wait
for admission holding their blocks with the prompt computed) and the KVReservation outputs
made inside ``schedule()`` until the engine core takes them.

A request reserves blocks for its prompt (an output with a KVReservation, made in ``poll``
or at the end of ``schedule()``), waits for its KVReady (``on_message``; or times out in
``poll``), appends the prefill instance's first token and joins the batch first thing,
holding its blocks with the prompt computed. A reservation that ended before its KV arrived
leaves its writable blocks in the quarantine until its KVReady or deadline.

With a KV tier (``tier``, set by ``composite.CompositeConnector``): a reservation's prompt
blocks beyond the pool's hit that are on disk are loaded first, and its KVReservation goes
out once they are in, counting the intact ones as cached (``_loaded``), so the prefill
instance sends only the rest.
"""
from __future__ import annotations

import logging
from collections import Counter
from typing import TYPE_CHECKING, Any

from pipeline.engine.kv_connector.base import KVConnector
from pipeline.engine.kv_connector.reservations import Reservations
from pipeline.engine.request import Request, RequestStatus
from pipeline.engine.step_outputs import final_output
from pipeline.messages import EngineOutput, EngineRequest
from pipeline.messages.kv import FALLBACK_ERROR, KVReady

if TYPE_CHECKING:
    from pipeline.engine.kv_connector.tier import TierConnector
    from pipeline.engine.scheduler import Scheduler

logger = logging.getLogger(__name__)


class DecodeConnector(KVConnector):
    role = "decode"

    def __init__(self, sched: Scheduler) -> None:
        super().__init__(sched)
        cfg = sched.config
        self.endpoint = cfg.kv_transfer_config.kv_listen
        self.reservations = Reservations(sched.kv, cfg.kv_transfer_config.kv_transfer_timeout, sched.clock)
        self.received: set[str] = set()
        self._outputs: list[EngineOutput] = []  # reservations made in schedule()
        self.num_kv_transfers_failed = 0
        self.num_kv_ready_ignored = 0  # KVReady for no reservation (gone, or never made)
        self.tier: TierConnector | None = None  # a KV tier beside it (composite)

    # -- admission -------------------------------------------------------------------------
    def check_request(self, er: EngineRequest, req_ids: set[str], num_prompt: int) -> None:
        for rid in req_ids:
            if rid in self.reservations.quarantine:  # its KVReady must free only its blocks
                raise ValueError(f"request id {rid!r} is still in the engine: a prefill instance "
                                 f"may be writing into its ended reservation's KV blocks")
        super().check_request(er, req_ids, num_prompt)

    def add_request(self, req: Request, er: EngineRequest) -> bool:
        if er.kv_transfer is None:
            return False
        self.reservations.add(req)  # n == 1: no siblings
        return True

    def build_connector_meta(self, step: int, num_sched: dict[str, int], admitted: bool) -> None:
        if admitted and self.reservations.queued:
            self._outputs += self._reserve()

    def _reserve(self) -> list[EngineOutput]:
        """Reserve blocks for queued requests (FCFS), keeping the running requests' reserve
        free as admission does; their KVReservation outputs."""
        res = self.reservations
        return [res.output(req, self.endpoint)
                for req in res.reserve(self.sched.admission.headroom(), self.tier, self._loaded)]

    def _loaded(self, req: Request, num_ok: int) -> list[EngineOutput]:
        """``req``'s tier load is in: its intact blocks computed and cached (the tier's
        ``_land``); reserved now, its KVReservation counting them as the decode side's."""
        assert req.num_cached_tokens == req.num_computed_tokens, (req.num_cached_tokens,
                                                                  req.num_computed_tokens)
        self.reservations.loaded(req)
        return [self.reservations.output(req, self.endpoint)]

    # -- leaving ---------------------------------------------------------------------------
    def detach(self, req: Request) -> bool:
        if req.status != RequestStatus.WAITING_FOR_KV:
            return False
        self.reservations.discard(req)
        return True

    def request_finished(self, req: Request, why: str) -> None:
        self.received.discard(req.req_id)

    # -- between steps ---------------------------------------------------------------------
    def poll(self) -> list[EngineOutput]:
        """Free quarantined blocks past their deadline, fail reservations past theirs, then
        reserve blocks for queued requests."""
        res = self.reservations
        if res.quarantine:
            res.release_expired()
        if not res:
            return []
        outs = self.expire_reservations()
        if res.queued:
            outs += self._reserve()
        return outs

    def expire_reservations(self) -> list[EngineOutput]:
        """Fail every reservation (queued or holding blocks) past its deadline, freeing its
        blocks but the quarantined ones."""
        sched, outs = self.sched, []
        for req in self.reservations.expired():
            # A loading one: the tier holds the blocks it loads into until its report.
            loading = self.tier is not None and self.tier.detach(req)
            why = self.reservations.timeout_message(req, loading)
            req.status = RequestStatus.FINISHED_ERROR
            sched.finish(req, why)
            outs.append(final_output(req, [], why, error_code="kv_transfer_timeout"))
        return outs

    def take_outputs(self) -> list[EngineOutput]:
        outs, self._outputs = self._outputs, []
        return outs

    def next_deadline(self) -> float | None:
        return self.reservations.next_deadline()

    def on_message(self, msg: Any) -> list[EngineOutput]:
        if not isinstance(msg, KVReady):
            return super().on_message(msg)
        return self.on_kv_ready(msg)

    def on_kv_ready(self, msg: KVReady) -> list[EngineOutput]:
        """The prompt's KV of reservation ``msg.req_id`` arrived (with the prefill instance's
        first token), or failed; either way the prefill side writes no more into its blocks.
        For a reservation that ended meanwhile it frees the quarantined blocks; other unknown
        ids are ignored (counted)."""
        sched = self.sched
        req = self.reservations.take(msg.req_id)
        if req is None:
            if self.reservations.release(msg.req_id):
                return []  # aborted or timed out, answered then: only its blocks were left
            self.num_kv_ready_ignored += 1
            logger.warning("KVReady for %r, which holds no reservation (finished, timed out or "
                           "unknown): ignored", msg.req_id)
            return []
        if msg.error == FALLBACK_ERROR:  # not a failure of the request: the router takes P's answer
            return sched.fail(req, "kv_fallback", FALLBACK_ERROR)
        if msg.error or msg.token < 0:
            self.num_kv_transfers_failed += 1
            why = msg.error or "the prefill instance sent no first token"
            return sched.fail(req, "kv_transfer_failed", f"KV transfer from the prefill instance "
                                                         f"failed: {why}")
        req.num_computed_tokens = req.num_prompt_tokens
        self.received.add(req.req_id)
        sched.kv.cache_computed_blocks(req)  # the decode side's prefix cache has the prompt now
        done = sched.results.append_token(req, msg.token)
        out = EngineOutput(req.out_id, [msg.token], req.finish_reason if done else None,
                           req.stop_reason, None, req.num_prompt_tokens, req.num_cached_tokens,
                           req.first_scheduled_time, None, req.index)
        if done:
            sched.finish(req)
        else:
            sched.resume(req)  # joins the batch first thing, holding its blocks
        return [out]

    # -- accounting ------------------------------------------------------------------------
    @property
    def num_held(self) -> int:
        return len(self.reservations)

    @property
    def num_waiting(self) -> int:
        return len(self.reservations.queued)

    def may_hold_blocks(self, req: Request) -> bool:
        st = req.status
        return (st == RequestStatus.RUNNING or st == RequestStatus.WAITING_FOR_KV
                or (st == RequestStatus.WAITING and req.req_id in self.received))

    def held_block_ids(self) -> Counter[int]:
        return self.reservations.quarantined_block_ids()

    def check(self) -> list[str]:
        res, requests = self.reservations, self.sched.requests
        errs = res.check()
        errs += [f"quarantined request {rid} is live again" for rid in res.quarantine
                 if rid in requests]
        return errs

    def stats(self) -> dict[str, int | float]:
        res = self.reservations
        return {"kv_reserved_requests": len(res.reserved),
                "kv_reserved_blocks": res.num_reserved_blocks,  # quarantined ones too
                "kv_reservation_timeouts": res.num_timeouts,
                "kv_transfers_failed": self.num_kv_transfers_failed}
