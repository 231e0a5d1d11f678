"""Prefill/decode disaggregation: what crosses process (and instance) boundaries for it.

- ``KVTransferParams``: set by the router on a request (never by a client): on the decode
  instance "reserve blocks for the prompt, then wait for its KV"; on the prefill instance
  "compute the prompt and ship its KV there".
- ``KVReservation``: decode engine -> (token processor, gateway) -> router, in a delta: the
  blocks to fill and the decode instance's cache messager to send them to.
- engine -> cache messager (prefill): ``TransferPlan`` per step (per request, its (local
  block, remote block) pairs), ``KVFinish`` once a request's first token is known (or it
  failed); cache messager -> engine: ``TransferReport`` per plan (only then may the engine
  free or cache the plan's blocks: seed 000).
- cache messager -> engine (decode): ``KVReady`` when a prefill peer said a request's KV is in
  (with its first token) or failed.
Ids are each engine's own: a prefill names the decode side's request by ``remote_req_id``.
A prefill instance with ``--pd-fallback local`` whose transfer of a request failed decodes it
itself and tells the decode side so with ``KVFinish.error == FALLBACK_ERROR`` (the decode
engine fails its half with error code "kv_fallback"; the router then takes the prefill
instance's answer).
"""
from __future__ import annotations

from typing import Annotated, Literal

import msgspec
from msgspec import Meta

MAX_KV_ENDPOINT_BYTES = 256
# A prompt's block table on the decode side: at most MAX_PROMPT_TOKENS / 1 blocks; bounded
# again by the decode pool's size where it is used.
MAX_REMOTE_BLOCKS = 1 << 20

# KVFinish.error / KVReady.error of a request the prefill instance decodes itself.
FALLBACK_ERROR = "the prefill instance decodes this request itself (--pd-fallback local)"

Endpoint = Annotated[str, Meta(max_length=MAX_KV_ENDPOINT_BYTES)]


class KVTransferParams(msgspec.Struct, kw_only=True, forbid_unknown_fields=True, omit_defaults=True):
    """``role`` "decode": reserve and wait for the KV; "prefill": send it to ``peer``."""
    role: Literal["decode", "prefill"]
    peer: Endpoint = ""  # prefill: the decode instance's KVReservation.endpoint
    remote_req_id: Annotated[str, Meta(max_length=256)] = ""  # prefill: KVReservation.engine_req_id
    # prefill: the decode side's blocks for the whole prompt, in position order...
    remote_block_ids: Annotated[list[Annotated[int, Meta(ge=0)]], Meta(max_length=MAX_REMOTE_BLOCKS)] = []
    # ...of which the first remote_num_cached_tokens // block_size it has already (prefix hit).
    remote_num_cached_tokens: Annotated[int, Meta(ge=0)] = 0
    # prefill: the reservation's time left (KVReservation.timeout_s) when the router asked; the
    # prefill side writes nothing after it (0: no limit), so freed decode blocks stay unwritten.
    deadline_s: Annotated[float, Meta(ge=0)] = 0.0


class KVReservation(msgspec.Struct, kw_only=True):
    engine_req_id: str
    block_ids: list[int]
    num_cached_tokens: int  # the decode side's prefix-cache hit: blocks it needs not receive
    endpoint: str  # where the decode instance's cache messager listens
    timeout_s: float  # the reservation is freed (the request fails) this long after it was made


class KVSend(msgspec.Struct, array_like=True):
    """One request's share of a step's transfer plan."""
    req_id: str  # the prefill engine's
    peer: str
    remote_req_id: str
    pairs: bytes  # little-endian int32 (local block, remote block) pairs


class TransferPlan(msgspec.Struct, array_like=True):
    step_id: int
    sends: list[KVSend]


class KVFinish(msgspec.Struct, array_like=True):
    """The request's last chunk was computed (its first ``token``), or it failed (``error``)."""
    req_id: str  # the prefill engine's
    peer: str
    remote_req_id: str
    token: int = -1
    error: str = ""


class TransferReport(msgspec.Struct, array_like=True):
    step_id: int
    failed: dict[str, str]  # prefill engine req id -> why; every other send of the plan is in
    bytes: int = 0


class KVReady(msgspec.Struct, array_like=True):
    req_id: str  # the decode engine's
    token: int = -1  # the first token, sampled by the prefill instance
    error: str = ""  # non-empty: the transfer failed and the request fails with this


def pairs_to_bytes(pairs) -> bytes:
    import numpy as np
    return np.asarray(pairs, dtype="<i4").reshape(-1, 2).tobytes()


def bytes_to_pairs(b: bytes):
    import numpy as np
    return np.frombuffer(b, dtype="<i4").reshape(-1, 2)
