"""Cache messager, a prefill or decode instance with a KV tier (``--kv-offload-dir`` with
``--role prefill|decode``): `RoleTierMessager` runs the role's loop and the tier's mover side
by side, over the instance's one pair of engine rings (kv_plans, kv_reports) and, on a
decode instance, kv_ready.

- Prefill: `PrefillMessager` reads kv_plans on the main thread (blocking on the layer signal
  while a step's KV ships); the TierPlans among them go to a `TierThread` (a queue), whose
  TierReports share kv_reports with the TransferReports under ``PrefillMessager.report_lock``
  (the ring stays single-producer). A tier load may wait behind the one transfer plan sent
  before it on the ring (at most a step); saves never delay a transfer.
- Decode: kv_plans and kv_reports are the tier's alone: the main thread runs `TierMessager`'s
  mover on them while `DecodeMessager`'s receiver thread writes kv_ready, checking after each
  round that the receiver still runs.
No loop polls: each blocks on a ring, the queue or the layer signal, waking at most every
``ring_timeout_s`` to check its peers; either part failing ends the stage.

State: the role's loop, the tier's (its thread, DiskTier and pool view, or `TierMessager`).
"""
from __future__ import annotations

from typing import Any

import msgspec

from pipeline.cache.decode import DecodeMessager
from pipeline.cache.kv_tier.mover import TierThread
from pipeline.cache.kv_tier.store import DiskTier
from pipeline.cache.prefill import PrefillMessager
from pipeline.cache.stage_spec import model_of
from pipeline.cache.tier import TierMessager
from pipeline.messages.kv_layout import KVLayout
from pipeline.messages.kv_tier import TierPlan
from pipeline.runtime.process import log
from pipeline.runtime.spec import StageSpec


class RoleTierMessager:
    def __init__(self, spec: StageSpec) -> None:
        role = spec.config.kv_transfer_config.role
        self.spec, self.role = spec, role
        self.prefill: PrefillMessager | None = None
        self.decode: DecodeMessager | None = None
        self.tier_loop: TierMessager | None = None
        self.thread: TierThread | None = None
        self.disk: DiskTier | None = None
        self.endpoint = ""
        self.layout: KVLayout
        if role == "prefill":
            self.prefill = pre = PrefillMessager(spec)
            try:
                if pre.seg is None:
                    raise ValueError("cache messager (prefill, KV tier): the worker's KV cache "
                                     "is not in shared memory (a tier from GPU memory is not built)")
                m, cc = model_of(spec), spec.config.cache_config
                layout = msgspec.structs.replace(m.kv, model_hash=m.kv_tier_id)
                self.disk = DiskTier(cc.kv_offload_dir, cc.kv_offload_bytes, layout)
                # Not drained at close: as the mixed instance's messager, the queued saves
                # of an engine that is gone are dropped (their blocks may be reused).
                self.thread = TierThread(self.disk, layout.pool(pre.seg), pre.send_report,
                                         drain=False)
            except BaseException:
                self.close()
                raise
            pre.on_other = self._submit
            self.layout = pre.layout
        elif role == "decode":
            self.decode = DecodeMessager(spec)
            try:
                self.tier_loop = TierMessager(spec)
            except BaseException:
                self.close()
                raise
            self.endpoint = self.decode.endpoint
            self.layout = self.decode.layout
        else:
            raise ValueError(f"cache messager: a KV tier beside role {role!r}: only prefill and "
                             f"decode instances run one (a mixed one runs the tier alone)")

    def _submit(self, msg: Any) -> None:
        """What kv_plans carried that is not the prefill loop's: a TierPlan, to the thread."""
        assert self.thread is not None
        if not isinstance(msg, TierPlan):
            log(self.spec, f"{type(msg).__name__} on kv_plans is for no part of this messager: "
                           f"dropped")
            return
        why = self.thread.submit(msg)
        if why is not None:
            raise RuntimeError(why)  # the tier's thread died: the stage ends

    def run_forever(self) -> None:
        timeout = self.spec.ring_timeout_s
        if self.prefill is not None:
            assert self.thread is not None
            while True:
                self.prefill.handle_next(timeout)
                self.thread.check()
        dec, tier = self.decode, self.tier_loop
        assert dec is not None and dec.rx is not None and tier is not None
        while not dec.rx.wait(0):
            tier.mover.run_once(timeout)  # PeerDied if the engine (kv_plans' writer) died
            dec.engine_alive()
        raise dec.rx.error or RuntimeError("KV receiver thread ended")

    def close(self) -> None:
        if self.thread is not None:
            # Before the pool's mapping goes; a thread stuck sending to a dead engine is a
            # daemon thread, left to the process's exit.
            self.thread.close(timeout=2 * self.spec.ring_timeout_s)
            if not self.thread.thread.is_alive():
                self.thread.mover.pool = None  # type: ignore[assignment]  # pins the mapping
        for part in (self.prefill, self.tier_loop, self.decode):
            if part is not None:
                part.close()
        if self.disk is not None:
            self.disk.close()
