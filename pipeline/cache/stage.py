"""Cache messager stage process: ships a prefill instance's KV to decode instances, takes
it in on a decode instance (prefill/decode disaggregation, seed 000), or moves blocks
between the pool and a KV tier's files.

`run(spec, ready)` runs one of four loops: by ``spec.config.role`` `prefill.PrefillMessager`
(plans from the engine, shipped layer by layer to the decode peers) or `decode.DecodeMessager`
(a receiver turning done messages into ``KVReady`` for the engine); with ``--kv-offload-dir``
`tier.TierMessager` on a mixed instance, else `role_tier.RoleTierMessager` (the role's loop
and the tier's side by side).
Both need the worker's KV pool exported (`stage_spec.model_of`): in shared memory
(``spec.model.kv_segment``, CPU) or by CUDA IPC (``spec.model.kv_cuda_ipc``, CUDA).

State: the running loop (its own state is described in its module).
"""
from __future__ import annotations

import logging
import sys

from pipeline.cache.decode import DecodeMessager
from pipeline.cache.prefill import PrefillMessager
from pipeline.cache.role_tier import RoleTierMessager
from pipeline.cache.tier import TierMessager
from pipeline.runtime.process import ReadyFn, log
from pipeline.runtime.spec import StageSpec


def _log_to_stderr(spec: StageSpec) -> None:
    """pipeline.cache's log records (links, rejected messages) on stderr, named by stage."""
    lg = logging.getLogger("pipeline.cache")
    if not lg.handlers:
        h = logging.StreamHandler(sys.stderr)
        h.setFormatter(logging.Formatter(f"[{spec.name}] %(message)s"))
        lg.addHandler(h)
        lg.setLevel(logging.INFO)
        lg.propagate = False


def run(spec: StageSpec, ready: ReadyFn) -> None:
    role = spec.config.kv_transfer_config.role
    loop: PrefillMessager | DecodeMessager | TierMessager | RoleTierMessager
    tier_dir = spec.config.cache_config.kv_offload_dir
    if tier_dir and role in ("prefill", "decode"):
        loop = RoleTierMessager(spec)
        info: dict = {"kv_endpoint": loop.endpoint} if role == "decode" else {}
        what = f"KV tier in {tier_dir}" + (f", listening on {loop.endpoint}" if loop.endpoint else "")
        role += " + tier"
    elif tier_dir:
        loop = TierMessager(spec)
        info = {}
        what = f"KV tier in {tier_dir}"
        role = "tier"
    elif role == "prefill":
        loop = PrefillMessager(spec)
        info = {}
        what = f"kv_transfer {spec.config.kv_transfer_config.kv_transfer}"
    elif role == "decode":
        loop = DecodeMessager(spec)
        info = {"kv_endpoint": loop.endpoint}
        what = f"listening on {loop.endpoint}"
    else:
        raise ValueError(f"cache messager: config.role={role!r}: only prefill and decode "
                         f"instances, and those with a KV tier, run one")
    _log_to_stderr(spec)
    try:
        log(spec, f"cache messager ({role}) ready: {loop.layout.num_layers} layers x "
                  f"{loop.layout.num_blocks} blocks of {loop.layout.block_bytes} bytes (K and V), {what}")
        ready(info)
        loop.run_forever()
    finally:
        loop.close()
