"""Cache messager stage: the `KVTransfer` interface and its same-host implementation.

Owns `KVTransfer` (send the K and V of (local block, remote block) pairs of ONE layer; flush;
close), `KVTransferError`, the pairs' validation (``check_pairs``: every id inside its pool, no
remote block written twice) and coalescing into runs contiguous on both sides (``runs``: one
copy or message per run), and `IpcTransfer`, which maps the decode instance's KV segment by
name and copies each contiguous run of blocks with one copy per run (K and V slabs), no
per-block Python loop. The TCP implementation is `pipeline/cache/tcp.py` (its receiving end
`tcp_receiver.py`).
State (IpcTransfer): the attached remote segment and the uint8 views of both pools.
"""
from __future__ import annotations

from abc import ABC, abstractmethod

import numpy as np

from pipeline.ipc.segment import attach_segment
from pipeline.messages.kv_layout import KVLayout


def check_pairs(pairs: object, local_blocks: int, remote_blocks: int) -> np.ndarray:
    """(local, remote) block pairs as an int64 array of shape (n, 2); ValueError naming the
    first block id out of range or the first remote block written twice."""
    arr = np.asarray(pairs, dtype=np.int64).reshape(-1, 2)
    for col, side, limit in ((0, "local", local_blocks), (1, "remote", remote_blocks)):
        bad = np.flatnonzero((arr[:, col] < 0) | (arr[:, col] >= limit))
        if bad.size:
            raise ValueError(f"{side} block {int(arr[bad[0], col])} out of range 0..{limit - 1}")
    remote, counts = np.unique(arr[:, 1], return_counts=True)
    if (counts > 1).any():
        raise ValueError(f"remote block {int(remote[counts > 1][0])} written twice in one transfer")
    return arr


def runs(pairs: np.ndarray) -> list[tuple[int, int, int]]:
    """Coalesce checked pairs into (local start, remote start, count) runs where both sides
    are contiguous: one copy (or one message) per run instead of per block."""
    if not len(pairs):
        return []
    p = pairs[np.argsort(pairs[:, 0], kind="stable")]
    brk = np.flatnonzero((np.diff(p[:, 0]) != 1) | (np.diff(p[:, 1]) != 1)) + 1
    starts = np.concatenate(([0], brk))
    ends = np.concatenate((brk, [len(p)]))
    return [(int(p[s, 0]), int(p[s, 1]), int(e - s)) for s, e in zip(starts, ends)]


class KVTransferError(ConnectionError):
    """The peer lost, refused or never acknowledged some of a step's blocks."""


class KVTransfer(ABC):
    """Moves blocks of the local KV pool into the remote one, one layer at a time."""

    local: KVLayout
    remote: KVLayout

    def check(self, layer: int, pairs: object) -> np.ndarray:
        """Validated (n, 2) int64 pairs of `layer`; ValueError naming the field and limit."""
        if not 0 <= layer < self.local.num_layers:
            raise ValueError(f"layer={layer} out of range 0..{self.local.num_layers - 1}")
        return check_pairs(pairs, self.local.num_blocks, self.remote.num_blocks)

    @abstractmethod
    def send_layer(self, layer: int, pairs: object) -> int:
        """Send (or start sending) K and V of `layer` for the pairs; returns the bytes. The
        local blocks may be read until `flush` returns: they must not change before."""

    @abstractmethod
    def flush(self) -> None:
        """Return once every block sent so far is in the remote pool; KVTransferError if not
        (what then reached the remote pool is unknown: fail the step, reconnect)."""

    @abstractmethod
    def close(self) -> None:
        """Release the connection or mapping. Idempotent."""


class IpcTransfer(KVTransfer):
    """Same host: copy straight into the decode instance's shared KV segment."""

    def __init__(self, local_pool: object, local: KVLayout, remote_segment: str,
                 remote: KVLayout) -> None:
        local.check_peer(remote)
        self.local, self.remote = local, remote
        self._src: np.ndarray | None = local.pool(local_pool)
        self._seg = attach_segment(remote_segment)
        try:
            self._dst: np.ndarray | None = remote.pool(self._seg)
        except BaseException:
            self._seg.close()
            raise

    def send_layer(self, layer: int, pairs: object) -> int:
        if self._src is None or self._dst is None:
            raise KVTransferError(f"transfer to {self._seg.name} is closed")
        arr = self.check(layer, pairs)
        src, dst = self._src[layer], self._dst[layer]
        for lo, ro, n in runs(arr):
            dst[:, ro:ro + n] = src[:, lo:lo + n]  # K and V runs: two memcpys
        return 2 * len(arr) * self.local.block_bytes

    def flush(self) -> None:
        """Copies are synchronous: done when send_layer returns."""

    def close(self) -> None:
        self._src = self._dst = None  # the views pin both mappings
        self._seg.close()
