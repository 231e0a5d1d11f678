"""Cache messager, KV tier: `TierMessager` moves blocks between this instance's KV pool and
the disk tier's files (``--kv-offload-dir``), for the engine's ``TierConnector``.

It reads ``TierPlan`` messages on ``kv_plans`` (engine -> messager) and answers with
``TierReport`` messages on ``kv_reports`` (cache/kv_tier/mover.py: loads first, each answered
as soon as it is in; saves in small batches between looks for loads), so file I/O never
runs in the engine's or the worker's process and no step waits for a write. The pool is the
worker's shared-memory segment (CPU). A malformed message is logged and skipped; the engine's
death ends the loop (PeerDied from the ring).

State: the ring ends, the pool's mapping, the DiskTier and the mover's queued saves.
"""
from __future__ import annotations

from typing import Any

import msgspec

from pipeline.cache.kv_tier.mover import TierMover
from pipeline.cache.kv_tier.store import DiskTier
from pipeline.cache.stage_spec import model_of, need_rings
from pipeline.ipc.segment import attach_segment
from pipeline.runtime import rings
from pipeline.runtime.process import log
from pipeline.runtime.spec import StageSpec


class TierMessager:
    def __init__(self, spec: StageSpec) -> None:
        m = model_of(spec)
        if m.kv_segment is None:
            raise ValueError("cache messager (KV tier): the worker's KV cache is not in shared "
                             "memory (a tier from GPU memory is not built)")
        need_rings(spec, "kv_plans", "kv_reports")
        cc = spec.config.cache_config
        self.spec = spec
        self.layout = msgspec.structs.replace(m.kv, model_hash=m.kv_tier_id)
        self.seg = attach_segment(m.kv_segment)
        try:
            self.tier = DiskTier(cc.kv_offload_dir, cc.kv_offload_bytes,
                                 self.layout)
            self.plans = rings.attach(spec, "kv_plans")  # engine -> messager
            self.reports = rings.attach(spec, "kv_reports", "writer")  # messager -> engine
            self.mover = TierMover(self.tier, self.layout.pool(self.seg), self._recv,
                                   self.reports.send)
        except BaseException:
            self.seg.close()
            raise

    def _recv(self, timeout: float | None) -> Any:
        try:
            return self.plans.recv(timeout) if timeout != 0 else self.plans.try_recv()
        except TimeoutError:
            return None
        except (ValueError, msgspec.MsgspecError) as e:
            log(self.spec, f"rejected a malformed message on kv_plans: {e}")
            return None

    def run_forever(self) -> None:
        while True:
            self.mover.run_once(self.spec.ring_timeout_s)

    def close(self) -> None:
        for ch in (self.plans, self.reports):
            ch.close()
        self.tier.close()
        self.mover.pool = None  # type: ignore[assignment]  # the view pins the mapping
        try:
            self.seg.close()
        except BufferError:
            pass
