"""Engine stage: a prefill or decode instance with a KV tier, its two connectors as the one
``Scheduler.connector`` (``CompositeConnector``), and ``with_tier``, the connector factory of
an instance with ``--kv-offload-dir`` (the tier alone on a mixed instance).

Owns / State: nothing of its own; ``part`` (the role's ``PrefillConnector`` or
``DecodeConnector``) owns the transfers, ``tier`` (a ``TierConnector``) the loads and saves.

Each hook goes to the part that owns the state it is about:
- the role: admission's checks and holds (``check_request``, ``tokens_to_fit``,
  ``add_request``, ``refused``), the step's transfer plan and outputs, ``on_token``,
  ``defer_abort``, deadlines (``poll``, ``next_deadline``) and its messages (TransferReport,
  KVReady);
- the tier: loads beyond the pool's hit (``get_num_new_matched_tokens``,
  ``update_state_after_alloc``), saves (``on_cached``) and its TierReports;
- both: a request leaving (``detach``: the tier first, so the blocks it loads into stay held
  as orphans; ``request_finished``, ``on_preempt``), what the messager is owed
  (``take_kv_finishes``: the role's KVFinish messages, then the TierPlans), and the
  accounting: ``num_held``, ``held_block_ids``, ``check`` and ``stats`` are sums (each request
  is counted by one part: a decode reservation's tier load is the reservation's), a request
  may hold blocks if either part says so.

Prefill role: a PD request whose prompt blocks beyond the pool's hit are on disk loads them
(WAITING_FOR_KV, outside the batch) as on a mixed instance, then computes the rest; its
transfer plans ship loaded blocks as they ship pool hits (every prompt block from the decode
side's cached boundary on). Decode role: the ``DecodeConnector`` asks the tier for a
reservation's blocks beyond its pool hit and loads them before its KVReservation goes out
(``DecodeConnector._loaded``), so the prefill side sends none of them.
"""
from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from pipeline.engine.block_pool import KVBlock
from pipeline.engine.kv_connector import make_connector
from pipeline.engine.kv_connector.base import KVConnector
from pipeline.engine.kv_connector.decode import DecodeConnector
from pipeline.engine.kv_connector.tier import TierConnector
from pipeline.engine.request import Request, RequestStatus
from pipeline.messages import EngineOutput, EngineRequest
from pipeline.messages.kv import KVFinish, TransferPlan
from pipeline.messages.kv_layout import KVLayout
from pipeline.messages.kv_tier import TierReport

if TYPE_CHECKING:
    from pipeline.engine.scheduler import Scheduler


def with_tier(root: str, layout: KVLayout) -> Callable[[Scheduler], KVConnector]:
    """The connector factory of an instance with a KV tier in ``root``: the tier alone on a
    mixed instance, else the role's connector and the tier in one."""
    def make(sched: Scheduler) -> KVConnector:
        tier = TierConnector(sched, root, layout)
        part = make_connector(sched)
        return tier if part is None else CompositeConnector(sched, part, tier)
    return make


class CompositeConnector(KVConnector):
    saves_cached = True

    def __init__(self, sched: Scheduler, part: KVConnector, tier: TierConnector) -> None:
        super().__init__(sched)
        self.part, self.tier = part, tier
        self.role = part.role
        self.allows_async = part.allows_async and tier.allows_async
        if isinstance(part, DecodeConnector):
            part.tier = tier  # its reservations count tier hits

    # -- admission -------------------------------------------------------------------------
    def check_request(self, er: EngineRequest, req_ids: set[str], num_prompt: int) -> None:
        self.tier.check_ids(req_ids)
        self.part.check_request(er, req_ids, num_prompt)

    def tokens_to_fit(self, er: EngineRequest, num_prompt: int) -> int:
        return self.part.tokens_to_fit(er, num_prompt)

    def add_request(self, req: Request, er: EngineRequest) -> bool:
        return self.part.add_request(req, er)

    def refused(self, er: EngineRequest, why: str) -> None:
        self.part.refused(er, why)

    def get_num_new_matched_tokens(self, req: Request, num_computed: int) -> int:
        return self.tier.get_num_new_matched_tokens(req, num_computed)

    def update_state_after_alloc(self, req: Request, blocks: list[KVBlock], num_external: int) -> None:
        self.tier.update_state_after_alloc(req, blocks, num_external)

    def on_cached(self, block: KVBlock) -> None:
        self.tier.on_cached(block)

    # -- each step -------------------------------------------------------------------------
    def build_connector_meta(self, step: int, num_sched: dict[str, int], admitted: bool) -> None:
        self.part.build_connector_meta(step, num_sched, admitted)

    def on_token(self, req: Request, token: int, done: bool) -> bool | None:
        return self.part.on_token(req, token, done)

    # -- leaving ---------------------------------------------------------------------------
    def defer_abort(self, req: Request, status: RequestStatus) -> bool:
        return self.part.defer_abort(req, status)

    def detach(self, req: Request) -> bool:
        loading = self.tier.detach(req)  # first: the blocks it loads into become orphans
        return self.part.detach(req) or loading

    def request_finished(self, req: Request, why: str) -> None:
        self.part.request_finished(req, why)
        self.tier.request_finished(req, why)

    def on_preempt(self, req: Request) -> None:
        self.part.on_preempt(req)
        self.tier.on_preempt(req)

    # -- between steps ---------------------------------------------------------------------
    def poll(self) -> list[EngineOutput]:
        return self.part.poll()

    def take_outputs(self) -> list[EngineOutput]:
        return self.part.take_outputs()

    def on_message(self, msg: Any) -> list[EngineOutput]:
        if isinstance(msg, TierReport):
            return self.tier.on_message(msg)
        return self.part.on_message(msg)

    def take_plan(self) -> TransferPlan | Any | None:
        return self.part.take_plan()

    def drop_plan(self, plan: TransferPlan, why: str) -> list[EngineOutput]:
        return self.part.drop_plan(plan, why)

    def take_kv_finishes(self) -> list[KVFinish | Any]:
        """The role's KVFinish messages, then the tier's TierPlans (loads first)."""
        return [*self.part.take_kv_finishes(), *self.tier.take_kv_finishes()]

    def next_deadline(self) -> float | None:
        return self.part.next_deadline()

    # -- accounting ------------------------------------------------------------------------
    @property
    def num_held(self) -> int:
        return self.part.num_held + self.tier.num_held

    @property
    def num_waiting(self) -> int:
        return self.part.num_waiting + self.tier.num_waiting

    def may_hold_blocks(self, req: Request) -> bool:
        return self.part.may_hold_blocks(req) or self.tier.may_hold_blocks(req)

    def held_block_ids(self) -> Counter[int]:
        held = self.part.held_block_ids()
        held.update(self.tier.held_block_ids())
        return held

    def check(self) -> list[str]:
        return self.part.check() + self.tier.check()

    def stats(self) -> dict[str, int | float]:
        return self.part.stats() | self.tier.stats()
