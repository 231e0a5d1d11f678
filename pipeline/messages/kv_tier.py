"""A second KV tier (disk): what the engine and the cache messager say to each other about it.

- engine -> cache messager (ring ``kv_plans``): ``TierPlan``: loads (per request, the pool
  blocks its tier hits go into and their keys, in chain order) and saves (pool blocks whose
  KV was just computed and cached, with their keys). The engine holds a reference on every
  block of a plan until the messager reports it, so no step writes into a block being read
  or written by the messager.
- cache messager -> engine (ring ``kv_reports``): ``TierReport``: per load, how many of its
  leading blocks arrived intact (the rest are computed again); the saves it is done with.
Keys are the prefix cache's chained block hashes (``engine.kv_cache_manager``), the block ids
this instance's own.
"""
from __future__ import annotations

from typing import Annotated

import msgspec
from msgspec import Meta

MAX_TIER_KEY_BYTES = 64
TierKey = Annotated[bytes, Meta(max_length=MAX_TIER_KEY_BYTES)]


class TierLoad(msgspec.Struct, array_like=True):
    req_id: str
    block_ids: bytes  # little-endian int32, one per key
    keys: list[TierKey]


class TierPlan(msgspec.Struct, array_like=True):
    loads: list[TierLoad]
    save_block_ids: bytes  # little-endian int32, one per key
    save_keys: list[TierKey]


class TierLoaded(msgspec.Struct, array_like=True):
    req_id: str
    num_ok: int  # leading blocks of the load that arrived intact
    bytes: int = 0
    seconds: float = 0.0


class TierReport(msgspec.Struct, array_like=True):
    loaded: list[TierLoaded]
    saved_block_ids: bytes  # little-endian int32: blocks the messager no longer reads
    num_written: int = 0  # of those, files written (the others were on disk already, or refused)
    bytes_written: int = 0
    save_seconds: float = 0.0


def ids_bytes(ids) -> bytes:
    import numpy as np
    return np.asarray(ids, dtype="<i4").tobytes()


def bytes_ids(b: bytes) -> list[int]:
    import numpy as np
    return np.frombuffer(b, dtype="<i4").tolist()
