"""Cache messager stage: the layer loop that ships one step's KV while the model computes.

Owns `Messager.run_peers` (and `run_step`, its one-peer form): given a step's transfer plan
(per decode peer, its transfer and per request its (local block, remote block) pairs), it
blocks on the worker's layer signal for layer i (a semaphore wait, no polling loop, no
sleep; PeerDied if the worker died) and sends layer i's blocks of every request of the step
to every peer at once, so layer i travels while layer i+1 is computed; then flushes each
peer. Every request of the plan ends in exactly one of `StepReport.done` /
`StepReport.failed`: a request with bad pairs fails alone, a peer whose send or flush fails
fails its own requests (and is named in `StepReport.peers_failed`, so that its link can be
dropped), a dead worker or a layer time-out fails the whole step.
State: none between steps beyond the signal and the transfer it was given.
"""
from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Protocol

import msgspec
import numpy as np

from pipeline.cache.transfer import KVTransfer, KVTransferError
from pipeline.ipc.errors import PeerDied

PEER_ERRORS = (KVTransferError, OSError, ValueError)  # one peer's send or flush failed
STEP_ERRORS = (PeerDied, TimeoutError, ValueError)  # the layer signal failed: the whole step


class LayerWaiter(Protocol):
    """What the loop blocks on: `ipc.layer_signal.LayerSignal` (or a bench's polling stand-in)."""

    def wait(self, step: int, layer: int, timeout: float | None = None) -> None: ...


class StepReport(msgspec.Struct, kw_only=True):
    step: int
    done: list[str]
    failed: dict[str, str]  # request id -> why
    bytes: int = 0
    layer_send_s: list[float] = msgspec.field(default_factory=list)  # per layer sent
    peers_failed: dict[str, str] = msgspec.field(default_factory=dict)  # peer -> why


Plan = Mapping[str, object]  # request id -> its (local block, remote block) pairs


class Messager:
    """`transfer`: the one peer of `run_step` (None: only `run_peers` is used, then give
    `num_layers`)."""

    def __init__(self, signal: LayerWaiter, transfer: KVTransfer | None = None,
                 layer_timeout_s: float = 30.0, *, num_layers: int | None = None) -> None:
        if transfer is None and num_layers is None:
            raise ValueError("Messager needs a transfer or num_layers")
        self.signal, self.transfer = signal, transfer
        self.num_layers = num_layers if num_layers is not None else transfer.local.num_layers  # type: ignore[union-attr]
        self.layer_timeout_s = layer_timeout_s

    def run_step(self, step: int, plan: Plan) -> StepReport:
        """One peer: the transfer given at construction."""
        if self.transfer is None:
            raise ValueError("run_step needs the Messager's transfer; use run_peers")
        return self.run_peers(step, {"": (self.transfer, plan)})

    def run_peers(self, step: int, peers: Mapping[str, tuple[KVTransfer, Plan]]) -> StepReport:
        """Request ids must be unique across peers (the report is keyed by them)."""
        rep = StepReport(step=step, done=[], failed={})
        live: dict[str, tuple[KVTransfer, np.ndarray, list[str]]] = {}
        for peer, (transfer, plan) in peers.items():
            good, parts = self._check(transfer, plan, rep)
            if good:
                live[peer] = (transfer, np.concatenate(parts), good)
        if not live:
            return rep

        def fail_peer(peer: str, e: BaseException) -> None:
            why = f"{type(e).__name__}: {e}"
            rep.failed.update(dict.fromkeys(live.pop(peer)[2], f"KV peer {peer}: {why}" if peer else why))
            rep.peers_failed[peer] = why

        try:
            for layer in range(self.num_layers):
                self.signal.wait(step, layer, timeout=self.layer_timeout_s)
                t0 = time.perf_counter()
                for peer, (transfer, pairs, _) in list(live.items()):
                    try:
                        rep.bytes += transfer.send_layer(layer, pairs)
                    except PEER_ERRORS as e:
                        fail_peer(peer, e)
                rep.layer_send_s.append(time.perf_counter() - t0)
                if not live:
                    return rep
        except STEP_ERRORS as e:
            why = f"{type(e).__name__}: {e}"
            for _, _, good in live.values():
                rep.failed.update(dict.fromkeys(good, why))
            return rep
        for peer, (transfer, _, _) in list(live.items()):
            try:
                transfer.flush()
            except PEER_ERRORS as e:
                fail_peer(peer, e)
        rep.done = [rid for _, _, good in live.values() for rid in good]
        return rep

    @staticmethod
    def _check(transfer: KVTransfer, plan: Plan, rep: StepReport) -> tuple[list[str], list[np.ndarray]]:
        """Requests of one peer whose pairs are valid and write no remote block twice."""
        good: list[str] = []
        parts: list[np.ndarray] = []
        seen: set[int] = set()
        for rid, pairs in plan.items():
            try:
                arr = transfer.check(0, pairs)
                clash = seen.intersection(arr[:, 1].tolist())
                if clash:
                    raise ValueError(f"remote block {min(clash)} is also another request's")
            except (ValueError, TypeError) as e:
                rep.failed[rid] = f"bad transfer plan: {e}"
                continue
            seen.update(arr[:, 1].tolist())
            good.append(rid)
            parts.append(arr)
        return good, parts
