"""Cache messager stage: the (local block, remote block) pairs of a transfer.

Owns their validation (every id inside its pool, no remote block written twice) and their
coalescing into runs contiguous on both sides, so a link moves one run per copy or message.
The pools' layout itself is `messages.kv_layout.KVLayout`. Owns no state.
"""
from __future__ import annotations

import numpy as np


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
