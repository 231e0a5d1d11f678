"""What a stage is told at start (`StageSpec`) and what the worker reports (`ModelInfo`).

The gateway builds one StageSpec per stage process and hands it over msgspec-encoded, and
starts every stage at once. What worker rank 0 learnt at load time (ModelInfo) reaches the
stages built from it (``runtime.process.NEEDS_MODEL``) over their control pipes when rank 0
reports ready (``await_start``); they put it into their spec before their loop starts. Owns
no state.
"""
from __future__ import annotations

import msgspec

from pipeline.config import EngineConfig
from pipeline.messages.kv_layout import KVLayout


class ModelInfo(msgspec.Struct, kw_only=True):
    """What the worker learnt at load time and the other stages need to be built.

    ``kv`` is its KV cache's layout (the engine's block count and size, what the cache
    messager maps and ships, the handshake's model hash). The pool itself is in the
    shared-memory segment ``kv_segment`` on CPU (None on CUDA); on CUDA, rank 0 of a prefill
    or decode instance exports it as ``kv_cuda_ipc`` (the msgpack
    `pipeline.ipc.cuda_ipc.CudaIpcHandle` of all its bytes; b"" otherwise)."""
    max_model_len: int
    vocab_size: int
    eos_token_ids: list[int]
    kv: KVLayout
    kv_segment: str | None = None
    kv_cuda_ipc: bytes = b""
    # A KV tier's (--kv-offload-dir) model identity: the weights and the settings that change
    # the KV (``RankModel.kv_tier_id``); "" without a tier.
    kv_tier_id: str = ""
    hidden_size: int = 0  # the length of an embedding (task "embed")


class StageSpec(msgspec.Struct, kw_only=True):
    name: str  # e.g. "worker0"; used in every error message about the stage
    kind: str  # key of runtime.process.STAGE_MODULES
    config: EngineConfig
    rings: dict[str, str]  # role -> shared-memory name, see runtime.rings.RINGS
    rank: int = 0
    # Wait for the gateway's ("start", model) on the control pipe after importing the stage's
    # code: the gateway starts stages before the rings exist (runtime.process).
    await_start: bool = False
    model: ModelInfo | None = None  # set before run() for runtime.process.NEEDS_MODEL stages
    ring_timeout_s: float = 1.0  # how often a blocked stage re-checks its peers
