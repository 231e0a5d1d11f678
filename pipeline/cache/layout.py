"""Cache messager stage: the KV cache layout both ends of a transfer must agree on.

Owns `KVLayout` (the handshake struct: what a prefill instance and a decode instance compare
before any block moves), `LayoutMismatch`, the raw byte view of a KV pool
(`[num_layers, 2 (K, V), num_blocks, block_bytes]` as uint8, over the worker's
`[num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]` allocation) and the
validation and coalescing of (local block, remote block) pairs. Owns no state.
"""
from __future__ import annotations

import msgspec
import numpy as np

from pipeline.runtime.spec import ModelInfo

# Bytes per element of the torch dtype names the worker writes into ModelInfo.kv_dtype.
ITEMSIZE = {"float64": 8, "float32": 4, "float16": 2, "bfloat16": 2, "int8": 1, "uint8": 1,
            "float8_e4m3fn": 1, "float8_e5m2": 1}
# What two instances must share; num_blocks may differ (each pool is sized by its own memory).
MUST_MATCH = ("num_layers", "block_size", "num_kv_heads", "head_dim", "dtype", "model_hash")


class LayoutMismatch(ValueError):
    """The two instances' KV caches cannot exchange blocks; names each differing field."""


class KVLayout(msgspec.Struct, frozen=True, kw_only=True):
    num_layers: int
    num_blocks: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: str  # torch dtype name, e.g. "float32"
    model_hash: str  # the model config hash: same shapes of a different model are refused too

    def __post_init__(self) -> None:
        for f in ("num_layers", "num_blocks", "block_size", "num_kv_heads", "head_dim"):
            if getattr(self, f) < 1:
                raise ValueError(f"KVLayout.{f}={getattr(self, f)} must be >= 1")
        if self.dtype not in ITEMSIZE:
            raise ValueError(f"KVLayout.dtype={self.dtype!r} must be one of {sorted(ITEMSIZE)}")

    @classmethod
    def from_model_info(cls, info: ModelInfo, model_hash: str) -> KVLayout:
        return cls(num_layers=info.num_layers, num_blocks=info.num_blocks,
                   block_size=info.block_size, num_kv_heads=info.num_kv_heads,
                   head_dim=info.head_dim, dtype=info.kv_dtype, model_hash=model_hash)

    @property
    def block_bytes(self) -> int:
        """Bytes of one block of one layer's K (or V)."""
        return self.block_size * self.num_kv_heads * self.head_dim * ITEMSIZE[self.dtype]

    @property
    def total_bytes(self) -> int:
        return self.num_layers * 2 * self.num_blocks * self.block_bytes

    def check_peer(self, peer: KVLayout) -> None:
        """Raise LayoutMismatch naming every field on which `peer` differs, with both values."""
        diffs = [f"{f}: local={getattr(self, f)!r} remote={getattr(peer, f)!r}"
                 for f in MUST_MATCH if getattr(self, f) != getattr(peer, f)]
        if diffs:
            raise LayoutMismatch("KV layout mismatch, refusing to transfer: " + "; ".join(diffs))

    def pool(self, buf: object) -> np.ndarray:
        """uint8 view `[num_layers, 2, num_blocks, block_bytes]` over a pool's memory."""
        # Size checked before any view exists: a raised error must not pin the mapping.
        with memoryview(buf) as mv:  # type: ignore[arg-type]
            nbytes = mv.nbytes
        if nbytes != self.total_bytes:
            raise LayoutMismatch(f"KV pool is {nbytes} bytes, its layout says "
                                 f"{self.total_bytes} ({self})")
        arr = np.frombuffer(buf, dtype=np.uint8)  # type: ignore[call-overload]
        return arr.reshape(self.num_layers, 2, self.num_blocks, self.block_bytes)


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
