"""Engine stage, prefill role: what each PD request sends and the blocks its sends hold.

Owns / State:
- ``SendState`` per prefill-role request (held by ``PrefillConnector.sends``): where its
  prompt's KV goes (the decode instance's blocks), how many leading blocks went in full so
  far (reset by a preemption: sent again from the remote prefix-hit boundary), whether its
  KVFinish (first token, or error) is out, and for --pd-fallback local whether it may decode
  here, the steps whose plans carry its sends and whose reports are not in yet (``pending``)
  and, while PARKED, its first token and how it ends once its transfer is settled.
- ``TransferLeases``: per step, a reference on every block of the step's TransferPlan until
  the cache messager's TransferReport for that step (seed 000: a block is never freed or
  reused while its KV is on the wire), the requests whose sends it carries (each counts it in
  ``SendState.pending`` until then), and the KVFinish messages owed to the messager (at most
  one per request: its first token, or why it failed, or FALLBACK_ERROR).
"""
from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass

from pipeline.engine.block_pool import BlockPool, KVBlock
from pipeline.engine.request import Request, RequestStatus
from pipeline.messages import EngineRequest
from pipeline.messages.kv import KVFinish, KVSend, KVTransferParams, TransferPlan, pairs_to_bytes

# A prefill stops sending this long before the reservation's end as the router reported it
# (KVTransferParams.deadline_s): the decode side's clock started a hop earlier.
SEND_MARGIN_S = 1.0


@dataclass(slots=True, eq=False)
class SendState:
    """One prefill-role request's transfer (see the module docstring)."""
    req: Request
    params: KVTransferParams
    fallback: bool = False
    sent_blocks: int = 0
    finished: bool = False
    pending: int = 0
    first_token: int = -1
    end: RequestStatus | None = None


class TransferLeases:
    """Prefill role: per-step plans of the prompt blocks to send, the blocks they hold until
    the step's report, and the KVFinish messages owed to the cache messager."""

    def __init__(self, pool: BlockPool, block_size: int) -> None:
        self.pool = pool
        self.block_size = block_size
        self.leases: dict[int, list[KVBlock]] = {}  # step id -> blocks held for its transfer
        self.carried: dict[int, list[SendState]] = {}  # step id -> the sends it carries
        self.held: Counter[int] = Counter()  # block id -> leases on it (the audit's view)
        self.finishes: list[KVFinish] = []
        self.num_unknown_reports = 0

    @property
    def num_leased_blocks(self) -> int:
        return len(self.held)

    def plan(self, step_id: int, scheduled: Iterable[tuple[SendState, int]]) -> TransferPlan | None:
        """The plan of step ``step_id`` given its (send, scheduled tokens) (requests not
        computed yet: ``num_computed_tokens`` is where the step starts). Per request: the
        prompt blocks its tokens up to this step's end touch that were not sent in full yet,
        from the decode side's prefix-hit boundary on. Leases them until ``release``."""
        bs = self.block_size
        sends: list[KVSend] = []
        blocks: list[KVBlock] = []
        carried: list[SendState] = []
        for st, n in scheduled:
            req, kv = st.req, st.params
            p = req.num_prompt_tokens
            end = min(req.num_computed_tokens + n, p)
            hi = -(-end // bs)
            lo = max(st.sent_blocks, kv.remote_num_cached_tokens // bs)
            # A partial block is sent again once more of it is computed.
            st.sent_blocks = hi if end >= p else max(st.sent_blocks, end // bs)
            if lo >= hi:
                continue
            mine = req.blocks[lo:hi]
            remote = kv.remote_block_ids
            sends.append(KVSend(req.req_id, kv.peer, kv.remote_req_id, pairs_to_bytes(
                [(b.block_id, remote[i]) for i, b in enumerate(mine, lo)])))
            blocks += mine
            carried.append(st)
            st.pending += 1
        if not sends:
            return None
        self.pool.touch(blocks)
        self.leases[step_id] = blocks
        self.carried[step_id] = carried
        self.held.update(b.block_id for b in blocks)
        return TransferPlan(step_id, sends)

    def release(self, step_id: int) -> list[SendState] | None:
        """Drop step ``step_id``'s lease (its report came, or its plan was never sent): the
        sends it carried, one ``pending`` less each (finished ones too); None if there is no
        such lease."""
        blocks = self.leases.pop(step_id, None)
        if blocks is None:
            return None
        carried = self.carried.pop(step_id)
        for st in carried:
            st.pending -= 1
        self.pool.free_blocks(reversed(blocks))  # tail first: eviction order
        held = self.held
        for b in blocks:
            held[b.block_id] -= 1
            if not held[b.block_id]:
                del held[b.block_id]
        return carried

    def finish(self, st: SendState, token: int = -1, error: str = "") -> None:
        """Owe the messager the KVFinish of ``st``'s request, unless one is out already (ring
        order: after every plan sent so far, so after its last write)."""
        if st.finished:
            return
        st.finished = True
        kv = st.params
        self.finishes.append(KVFinish(st.req.req_id, kv.peer, kv.remote_req_id, token, error))

    def refused(self, er: EngineRequest, why: str) -> None:
        """A prefill-role request the engine refused: its decode peer learns it at once."""
        kv = er.kv_transfer
        if kv is not None and kv.role == "prefill" and kv.peer and kv.remote_req_id:
            self.finishes.append(KVFinish(er.req_id, kv.peer, kv.remote_req_id, -1,
                                          f"the prefill instance refused the request: {why}"))

    def take_finishes(self) -> list[KVFinish]:
        out, self.finishes = self.finishes, []
        return out
