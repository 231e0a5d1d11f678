"""Ring tags: the first byte of every ring message names its type.

One enum for the whole instance. Which tags each ring may carry is declared with the ring
(``runtime.rings.RINGS``, derived as ``RING_MESSAGES``): a reader decodes with its ring's map,
so a message of the wrong type (a mis-wired ring) fails loudly instead of decoding as garbage.
Owns no state.
"""
from __future__ import annotations

import enum


class Tag(enum.IntEnum):
    GATEWAY_REQUEST = 1
    ABORT = 2
    ENGINE_REQUEST = 3
    REGISTRATION = 4
    STEP = 5
    RUNNER_OUTPUT = 6
    ENGINE_OUTPUTS = 7
    DELTA = 8
    RESULT = 9
    STATS = 10
    TRANSFER_PLAN = 11
    KV_FINISH = 12
    TRANSFER_REPORT = 13
    KV_READY = 14
    TIER_PLAN = 15
    TIER_REPORT = 16
