"""Cache messager stage: the layer loop that ships one step's KV while the model computes.

Owns `Messager.run_step`: given a step's transfer plan (per request, its (local block,
remote block) pairs), it blocks on the worker's layer signal for layer i (a semaphore wait,
no polling loop, no sleep; PeerDied if the worker died) and sends layer i's blocks of every
request of the step at once, so layer i travels while layer i+1 is computed; then flushes.
Every request of the plan ends in exactly one of `StepReport.done` / `StepReport.failed`: a
request with bad pairs fails alone, a dead worker, a timeout or a transfer error fails the
whole step. State: none between steps beyond the signal and the transfer it was given.
"""
from __future__ import annotations

import time
from typing import Protocol

import msgspec
import numpy as np

from pipeline.cache.transfer import KVTransfer, KVTransferError
from pipeline.ipc.errors import PeerDied


class LayerWaiter(Protocol):
    """What the loop blocks on: `ipc.layer_signal.LayerSignal` (or a bench's polling stand-in)."""

    def wait(self, step: int, layer: int, timeout: float | None = None) -> None: ...


class StepReport(msgspec.Struct, kw_only=True):
    step: int
    done: list[str]
    failed: dict[str, str]  # request id -> why
    bytes: int = 0
    layer_send_s: list[float] = msgspec.field(default_factory=list)  # per layer sent


class Messager:
    def __init__(self, signal: LayerWaiter, transfer: KVTransfer, layer_timeout_s: float = 30.0) -> None:
        self.signal, self.transfer = signal, transfer
        self.num_layers = transfer.local.num_layers
        self.layer_timeout_s = layer_timeout_s

    def run_step(self, step: int, plan: dict[str, list[tuple[int, int]]]) -> StepReport:
        rep = StepReport(step=step, done=[], failed={})
        good: list[str] = []
        parts: list[np.ndarray] = []
        seen: set[int] = set()
        for rid, pairs in plan.items():
            try:
                arr = self.transfer.check(0, pairs)
                clash = seen.intersection(arr[:, 1].tolist())
                if clash:
                    raise ValueError(f"remote block {min(clash)} is also another request's")
            except (ValueError, TypeError) as e:
                rep.failed[rid] = f"bad transfer plan: {e}"
                continue
            seen.update(arr[:, 1].tolist())
            good.append(rid)
            parts.append(arr)
        if not good:
            return rep
        pairs_all = np.concatenate(parts)
        try:
            for layer in range(self.num_layers):
                self.signal.wait(step, layer, timeout=self.layer_timeout_s)
                t0 = time.perf_counter()
                rep.bytes += self.transfer.send_layer(layer, pairs_all)
                rep.layer_send_s.append(time.perf_counter() - t0)
            self.transfer.flush()
        except (PeerDied, TimeoutError, KVTransferError, OSError, ValueError) as e:
            why = f"{type(e).__name__}: {e}"
            rep.failed.update(dict.fromkeys(good, why))
            return rep
        rep.done = good
        return rep
