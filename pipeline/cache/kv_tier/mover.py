"""KV disk tier: the loop that moves blocks between the pool and the files (the cache
messager's side of ``engine.kv_connector.tier``).

Owns ``TierMover``: takes ``TierPlan`` messages (``recv``) and answers with ``TierReport``
messages (``send``). Loads go first, each answered on its own as soon as its blocks are in
(a waiting request's time to first token); saves queue up and are written SAVE_BATCH blocks at
a time, checking for new loads between batches, each batch answered so the engine drops its
references. State: the DiskTier, the pool view and the queued saves.

The transport is the caller's: the cache messager process passes its rings (``cache.tier``),
a prefill or decode instance's messager a queue and a thread beside its role's loop
(``TierThread``, ``cache.role_tier``), the in-process ``LLM`` a pair of queues and a thread
(``InProcessTier``).
"""
from __future__ import annotations

import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

import numpy as np

from pipeline.cache.kv_tier.store import DiskTier
from pipeline.messages.kv_tier import TierLoaded, TierPlan, TierReport, bytes_ids, ids_bytes

SAVE_BATCH = 8  # blocks written between two looks for loads (~0.4 ms on the 0.5B shape)


class TierMover:
    def __init__(self, tier: DiskTier, pool: np.ndarray, recv: Callable[[float | None], Any],
                 send: Callable[[TierReport], None]) -> None:
        """``pool``: the KV pool as ``[num_layers, 2, num_blocks, block_bytes]`` uint8;
        ``recv(timeout)``: the next message or None (timeout 0: do not wait)."""
        self.tier, self.pool = tier, pool
        self.recv, self.send = recv, send
        self.saves: deque[tuple[int, bytes]] = deque()

    def run_once(self, timeout: float | None) -> None:
        """Take what came (waiting up to ``timeout`` only when no save is queued), do the
        loads, then one batch of saves."""
        msg = self.recv(0 if self.saves else timeout)
        while msg is not None:
            self.take(msg)
            msg = self.recv(0)
        if self.saves:
            self.save_batch()

    def take(self, msg: Any) -> None:
        if not isinstance(msg, TierPlan):
            raise ValueError(f"{type(msg).__name__} is not for a KV tier")
        for ld in msg.loads:
            done = self.load(ld.req_id, bytes_ids(ld.block_ids), ld.keys)
            self.send(TierReport([done], b""))
            if done.num_ok:  # recency after the report: the request waits for no utime
                self.tier.touch(ld.keys[:done.num_ok])
        ids = bytes_ids(msg.save_block_ids)
        if len(ids) != len(msg.save_keys):
            raise ValueError(f"TierPlan: {len(ids)} save blocks for {len(msg.save_keys)} keys")
        self.saves.extend(zip(ids, msg.save_keys))

    def load(self, req_id: str, block_ids: list[int], keys: list[bytes]) -> TierLoaded:
        """The leading blocks that load intact; past the first failure nothing is read (the
        request computes the rest, and a chain is useless past a gap). Their recency is
        the caller's (``take``: the chain touched once the report is out)."""
        t0 = time.perf_counter()
        ok = self.tier.load_chain(keys, self.pool, block_ids)
        return TierLoaded(req_id, ok, ok * self.tier.layout.bytes_per_block, time.perf_counter() - t0)

    def save_batch(self) -> None:
        t0 = time.perf_counter()
        done: list[int] = []
        written = 0
        nb = self.pool.shape[2]
        while self.saves and len(done) < SAVE_BATCH:
            bid, key = self.saves.popleft()
            done.append(bid)
            if 0 <= bid < nb and self.tier.save(key, self.pool[:, :, bid, :]):
                written += 1
        self.send(TierReport([], ids_bytes(done), written, written * self.tier.layout.bytes_per_block,
                             time.perf_counter() - t0))

    def drain(self) -> None:
        """Write every queued save (closing: a restart finds them)."""
        while self.saves:
            self.save_batch()


_STOP = object()  # TierThread.close's last message


class TierThread:
    """A TierMover on a thread of this process, fed by ``submit``; its reports go to ``send``
    (called on the thread). It blocks on its queue while no save is queued (no polling).
    ``close`` stops it after the plans submitted before, and with ``drain`` after their saves."""

    def __init__(self, tier: DiskTier, pool: np.ndarray, send: Callable[[TierReport], None],
                 drain: bool = True) -> None:
        self.plans: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self.mover = TierMover(tier, pool, self._recv, send)
        self.drain = drain
        self.error: BaseException | None = None
        self._stop = False
        self.thread = threading.Thread(target=self._run, name="kv-tier", daemon=True)
        self.thread.start()

    def _recv(self, timeout: float | None) -> Any:
        try:
            msg = self.plans.get(timeout=timeout) if timeout != 0 else self.plans.get_nowait()
        except queue.Empty:
            return None
        if msg is _STOP:
            self._stop = True
            return None
        return msg

    def _run(self) -> None:
        try:
            while not self._stop:
                self.mover.run_once(None)
            if self.drain:
                self.mover.drain()
        except BaseException as e:  # noqa: BLE001 - told by submit / check
            self.error = e

    def submit(self, plan: Any) -> str | None:
        if self.error is not None:
            return f"KV tier thread failed: {self.error!r}"
        self.plans.put(plan)
        return None

    def check(self) -> None:
        """RuntimeError if the thread failed."""
        if self.error is not None:
            raise RuntimeError(f"KV tier thread failed: {self.error!r}") from self.error

    def close(self, timeout: float | None = None) -> None:
        self.plans.put(_STOP)
        self.thread.join(timeout)


class InProcessTier(TierThread):
    """The in-process ``LLM``'s tier: ``submit`` a plan, ``poll`` the reports (waiting up to
    ``timeout`` for one); ``close`` writes the queued saves first."""

    def __init__(self, tier: DiskTier, pool: np.ndarray) -> None:
        self.reports: queue.SimpleQueue[TierReport] = queue.SimpleQueue()
        super().__init__(tier, pool, self.reports.put)

    def poll(self, timeout: float) -> TierReport | None:
        self.check()
        try:
            return self.reports.get(timeout=timeout) if timeout > 0 else self.reports.get_nowait()
        except queue.Empty:
            return None

    def close(self, timeout: float | None = None) -> None:
        """Finish the queued saves, then stop."""
        super().close(timeout)
        self.mover.tier.close()
