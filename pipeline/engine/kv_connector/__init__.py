"""Engine stage: KV connectors (``base.KVConnector``): the prefill and decode roles of
prefill/decode disaggregation, a second KV tier (``tier``) and a role with a tier
(``composite``, whose ``with_tier`` makes the connector of an instance with one)."""
from __future__ import annotations

from typing import TYPE_CHECKING

from pipeline.engine.kv_connector.base import KVConnector

if TYPE_CHECKING:
    from pipeline.engine.scheduler import Scheduler


def make_connector(sched: Scheduler) -> KVConnector | None:
    """The connector of ``sched.config.role``; None for a mixed instance."""
    role = sched.config.kv_transfer_config.role
    if role == "prefill":
        from pipeline.engine.kv_connector.prefill import PrefillConnector
        return PrefillConnector(sched)
    if role == "decode":
        from pipeline.engine.kv_connector.decode import DecodeConnector
        return DecodeConnector(sched)
    return None
