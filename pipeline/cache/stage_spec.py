"""What a cache messager needs of its StageSpec, checked at start before anything is
attached: the worker's exported KV pool (exactly one of a shared-memory segment or a CUDA IPC
handle) and the rings of its role. Used by both loops (`prefill`, `decode`).

Owns no state.
"""
from __future__ import annotations

from pipeline.ipc.cuda_ipc import decode_handle
from pipeline.runtime.spec import ModelInfo, StageSpec


def model_of(spec: StageSpec) -> ModelInfo:
    """The worker's ModelInfo, if the messager can run with it; ValueError naming what is not."""
    m = spec.model
    if m is None:
        raise ValueError("cache messager: spec.model is missing (it is started after the worker "
                         "reported its KV cache)")
    if m.kv_segment is None and not m.kv_cuda_ipc:
        raise ValueError("cache messager: the worker exported no KV cache (ModelInfo.kv_segment is "
                         "None and ModelInfo.kv_cuda_ipc is empty)")
    if m.kv_segment is not None and m.kv_cuda_ipc:
        raise ValueError("cache messager: the worker exported its KV cache twice (both "
                         "ModelInfo.kv_segment and ModelInfo.kv_cuda_ipc are set)")
    if m.kv_cuda_ipc:
        decode_handle(m.kv_cuda_ipc)  # malformed: refused at start, not by the first peer
    return m


def need_rings(spec: StageSpec, *roles: str) -> None:
    missing = [r for r in roles if r not in spec.rings]
    if missing:
        raise ValueError(f"cache messager ({spec.config.kv_transfer_config.role}): spec.rings lacks "
                         f"{', '.join(missing)}")
