"""Engine stage: the KV connector, the one way KV that is not computed by this instance's
own steps enters or leaves the scheduler's view (the shape of vLLM v1's KV connector).

Owns / State: nothing here; each connector owns the transfer state of its requests (a
``PrefillConnector`` its sends and leases, a ``DecodeConnector`` its reservations and
quarantine). A mixed instance has none: ``Scheduler.connector is None``, and the scheduler's
hot path makes no role check.

The scheduler calls a connector at fixed points, and only there:
- admission: ``check_request`` (may refuse), ``tokens_to_fit`` (the max_tokens the pool must
  hold for it), ``add_request`` (True: the connector holds the request out of the queue until
  its KV is in, then hands it back with ``Scheduler.resume``), ``refused``;
- ``get_num_new_matched_tokens``: at admission, the tokens beyond the pool's own prefix hit
  that the connector can load (a second KV tier). A connector that answers > 0 then gets the
  request with its blocks allocated (``update_state_after_alloc``) and holds it, as the
  decode connector holds a reservation, until the load is in (``on_message``), so a request
  waiting for a load never delays the running batch;
- ``on_cached`` (``saves_cached``): each block as the pool's prefix cache takes it (its KV
  computed), to save it to a second KV tier;
- each step: ``build_connector_meta`` at the end of ``schedule()`` (the prefill connector's
  TransferPlan, the blocks to save), ``on_token`` for each sampled token of a request it has
  a say in (the prefill role's first token ends the request);
- leaving: ``defer_abort``, ``detach``, ``request_finished``, ``on_preempt``;
- between steps (the engine core): ``poll`` (deadlines), ``on_message`` (what the cache
  messager reports), ``take_plan`` / ``drop_plan`` / ``take_kv_finishes`` (what goes to the
  messager, before and after the step), ``take_outputs``, ``next_deadline``;
- accounting: ``num_held`` (requests it holds that are no work for a step), ``num_waiting``,
  ``may_hold_blocks`` / ``held_block_ids`` / ``check`` (the block-table audit), ``stats``.
"""
from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING, Any

from pipeline.engine.block_pool import KVBlock
from pipeline.engine.request import Request, RequestStatus
from pipeline.messages import EngineOutput, EngineRequest
from pipeline.messages.kv import KVFinish, TransferPlan

if TYPE_CHECKING:
    from pipeline.engine.scheduler import Scheduler


def check_kv_transfer(er: EngineRequest, role: str, block_size: int, num_prompt: int) -> None:
    """What the tokenizer stage checked (``tokenizer.validate.check_kv_transfer``), again
    where a wrong block table would corrupt another instance's KV cache: ValueError."""
    kvt = er.kv_transfer
    assert kvt is not None
    if kvt.role != role:
        raise ValueError(f"kv_transfer.role {kvt.role!r} on an engine of role {role!r}")
    if er.sampling_params.n != 1:
        raise ValueError(f"a kv_transfer request has n=1, got n={er.sampling_params.n}")
    if kvt.role == "prefill":
        need = -(-num_prompt // block_size)
        if len(kvt.remote_block_ids) != need:
            raise ValueError(f"kv_transfer.remote_block_ids: {len(kvt.remote_block_ids)} blocks, "
                             f"the prompt's {num_prompt} tokens need {need} of {block_size}")
        cached = kvt.remote_num_cached_tokens
        if cached % block_size or cached >= num_prompt:
            raise ValueError(f"kv_transfer.remote_num_cached_tokens: {cached} must be a multiple "
                             f"of {block_size} below the prompt's {num_prompt} tokens")


class KVConnector:
    """The hooks, each a no-op by default (see the module docstring)."""
    role = ""

    def __init__(self, sched: Scheduler) -> None:
        self.sched = sched

    # -- admission -------------------------------------------------------------------------
    def check_request(self, er: EngineRequest, req_ids: set[str], num_prompt: int) -> None:
        """ValueError if ``er`` (under ``req_ids``: its own and its children's) is not for
        this connector or would clash with transfer state it still holds."""
        if er.kv_transfer is not None:
            check_kv_transfer(er, self.role, self.sched.block_size, num_prompt)

    def tokens_to_fit(self, er: EngineRequest, num_prompt: int) -> int:
        """The max_tokens the whole pool must hold for ``er`` here."""
        return er.sampling_params.max_tokens

    def add_request(self, req: Request, er: EngineRequest) -> bool:
        """The first child of ``er``, built; True when the connector holds it (not queued)."""
        return False

    def refused(self, er: EngineRequest, why: str) -> None:
        """The scheduler refused ``er`` (``why``)."""

    def get_num_new_matched_tokens(self, req: Request, num_computed: int) -> int:
        """Tokens beyond ``num_computed`` (the pool's prefix hit) this connector can load;
        -1: not now (they are being loaded for another request: admission waits for them to
        become a pool hit)."""
        return 0

    def update_state_after_alloc(self, req: Request, blocks: list[KVBlock], num_external: int) -> None:
        """``req`` got ``blocks`` (new ones, after its pool hit) for the ``num_external``
        tokens this connector loads (and more after them, for the rest of its tokens); it
        holds the request (WAITING_FOR_KV) until the load is in: then
        ``num_computed_tokens`` += ``num_external``, and ``Scheduler.resume``."""

    # Whether ``on_cached`` gets every block the prefix cache takes (BlockPool.on_cached).
    saves_cached = False
    # Whether the engine may schedule a step while the previous one runs (engine.inflight).
    allows_async = False

    def on_cached(self, block: KVBlock) -> None:
        """``block`` entered the prefix cache: its KV computed, its owner holding it (a
        save takes a reference of its own until the block's bytes are read)."""

    # -- each step -------------------------------------------------------------------------
    def build_connector_meta(self, step: int, num_sched: dict[str, int], admitted: bool) -> None:
        """End of ``schedule()``: ``num_sched`` this step's requests (not computed yet);
        ``admitted``: whether the step admitted (it preempted nothing)."""

    def on_token(self, req: Request, token: int, done: bool) -> bool | None:
        """``req`` sampled ``token`` (``done``: its own rules ended it). None: no say; else
        whether it ended (False: it left the batch held by the connector)."""
        return None

    # -- leaving ---------------------------------------------------------------------------
    def defer_abort(self, req: Request, status: RequestStatus) -> bool:
        """True when ``req`` ends with ``status`` only once its transfer is settled."""
        return False

    def detach(self, req: Request) -> bool:
        """Take ``req`` (to be finished) out of what the connector holds; False: not held."""
        return False

    def request_finished(self, req: Request, why: str) -> None:
        """``req`` ends now (``why``: before its first token, why)."""

    def on_preempt(self, req: Request) -> None:
        """``req`` lost its blocks; it is computed again from the start."""

    # -- between steps ---------------------------------------------------------------------
    def poll(self) -> list[EngineOutput]:
        """Deadlines and queued work; the outputs to emit."""
        return []

    def take_outputs(self) -> list[EngineOutput]:
        """Outputs made by ``schedule()`` outside any step result."""
        return []

    def on_message(self, msg: Any) -> list[EngineOutput]:
        """What the cache messager reports; the outputs to emit."""
        raise ValueError(f"{type(msg).__name__} is not for a {self.role or 'mixed'} instance")

    def take_plan(self) -> TransferPlan | Any | None:
        """The last schedule()'s plan: to the cache messager before the step, or ``drop_plan``."""
        return None

    def drop_plan(self, plan: TransferPlan, why: str) -> list[EngineOutput]:
        return []

    def take_kv_finishes(self) -> list[KVFinish]:
        """What the cache messager is owed after the step (and aborts)."""
        return []

    def next_deadline(self) -> float | None:
        return None

    # -- accounting ------------------------------------------------------------------------
    @property
    def num_held(self) -> int:
        """Requests held out of the batch and the queue: no work for a step."""
        return 0

    @property
    def num_waiting(self) -> int:
        """Of those, the ones waiting for blocks (counted as waiting in the stats)."""
        return 0

    def may_hold_blocks(self, req: Request) -> bool:
        """Whether ``req`` may own blocks in its status (the audit)."""
        return req.status == RequestStatus.RUNNING

    def held_block_ids(self) -> Counter[int]:
        """Block id -> references the connector holds, not a request."""
        return Counter()

    def check(self) -> list[str]:
        return []

    def stats(self) -> dict[str, int | float]:
        """EngineStats fields."""
        return {}
