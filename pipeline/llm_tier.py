"""The in-process ``LLM``'s KV tier (``--kv-offload-dir``): the disk tier on a thread of this
process, and the saves still deferred when it closes. Owns nothing: the ``LLM`` holds the
tier it starts here.
"""
from __future__ import annotations

import time
from typing import Any

from pipeline.config import EngineConfig


def start_tier(config: EngineConfig, worker: Any) -> tuple[Any, str, bytes, Any]:
    """The tier (an ``InProcessTier``), its group (``EngineStats.kv_tier_group``), its hash
    key and the engine's connector factory."""
    import msgspec

    from pipeline.cache.kv_tier.mover import InProcessTier
    from pipeline.cache.kv_tier.store import DiskTier
    from pipeline.engine.kv_connector.tier import TierConnector
    from pipeline.engine.kv_connector.tier_index import tier_hash_key

    cc = config.cache_config
    kvc = worker.kv_cache
    layout = msgspec.structs.replace(kvc.layout, model_hash=worker.kv_tier_id())
    tier = InProcessTier(DiskTier(cc.kv_offload_dir, cc.kv_offload_bytes, layout),
                         layout.pool(kvc.segment_bytes()))
    hash_key = tier_hash_key(cc.kv_offload_dir)
    return tier, layout.tier_group(hash_key), hash_key, lambda s: TierConnector(s, cc.kv_offload_dir, layout)


def finish_saves(tier: Any, scheduler: Any, timeout: float = 60.0) -> None:
    """The KV tier's deferred saves (blocks cached past the share of the pool held for saves)
    sent to its thread as its reports free room: no engine loop runs them once ``generate``
    returns, and a restart should find them."""
    conn = getattr(scheduler, "connector", None)
    deferred = getattr(conn, "deferred", None)
    end = time.monotonic() + timeout
    try:
        while True:
            for plan in conn.take_kv_finishes() if conn is not None else []:
                tier.submit(plan)
            if not deferred or time.monotonic() > end:
                return
            msg = tier.poll(0.5)
            if msg is not None:
                conn.on_message(msg)  # type: ignore[union-attr]
    except RuntimeError:  # the tier's thread failed: nothing more will be written
        return
