"""Ring tags: the first byte of every ring message names its type.

One enum for the whole instance and, per ring role, the one map of tag -> message type
that ring may carry. A reader decodes with its ring's map, so a message of the wrong type
(a mis-wired ring) fails loudly instead of decoding as garbage.
"""
from __future__ import annotations

import enum

from pipeline.messages.answers import RequestDelta, RequestResult
from pipeline.messages.engine_outputs import EngineOutputs, EngineStats
from pipeline.messages.kv import KVFinish, KVReady, TransferPlan, TransferReport
from pipeline.messages.requests import AbortRequest, EngineRequest, GatewayRequest, OutputRegistration
from pipeline.messages.step import ModelRunnerOutput, SchedulerOutput


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


# ring role -> {tag: message type}; the roles are runtime.rings.RING_ROLES' keys plus "steps".
RING_MESSAGES: dict[str, dict[int, type]] = {
    "submit": {Tag.GATEWAY_REQUEST: GatewayRequest, Tag.ABORT: AbortRequest},
    "rejects": {Tag.RESULT: RequestResult},
    "register": {Tag.REGISTRATION: OutputRegistration},
    "requests": {Tag.ENGINE_REQUEST: EngineRequest, Tag.ABORT: AbortRequest},
    "steps": {Tag.STEP: SchedulerOutput},
    "results": {Tag.RUNNER_OUTPUT: ModelRunnerOutput},
    "outputs": {Tag.ENGINE_OUTPUTS: EngineOutputs},
    "stops": {Tag.ABORT: AbortRequest},
    "answers": {Tag.DELTA: RequestDelta, Tag.RESULT: RequestResult},
    "stats": {Tag.STATS: EngineStats},
    # disaggregation only (roles prefill / decode): engine <-> cache messager
    "kv_plans": {Tag.TRANSFER_PLAN: TransferPlan, Tag.KV_FINISH: KVFinish},
    "kv_reports": {Tag.TRANSFER_REPORT: TransferReport},
    "kv_ready": {Tag.KV_READY: KVReady},
}
