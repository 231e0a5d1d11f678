"""The KV cache layout: the one description of a KV pool every stage reads.

Owns `KVLayout`: the worker allocates its cache by it (``worker.kv_cache``), reports it in
``ModelInfo.kv`` (the engine and the tokenizer take the block count and size from there), and
the cache messager maps the pool by it and sends it as the handshake a prefill and a decode
instance compare before any block moves (``check_peer``, ``LayoutMismatch``). The pool is one
allocation ``[num_layers, 2 (K, V), num_blocks, block_size, num_kv_heads, head_dim]`` of
``dtype``; ``pool`` views its bytes as ``[num_layers, 2, num_blocks, block_bytes]`` uint8.
``block_bytes`` is computed here only. Owns no state.
"""
from __future__ import annotations

import hashlib
from typing import TYPE_CHECKING

import msgspec

if TYPE_CHECKING:
    import numpy as np

# Bytes per element of the torch dtype names a KV cache may have (torch's names, without
# "torch."): a table, not torch, so that a stage without torch can size a pool.
ITEMSIZE = {"float64": 8, "float32": 4, "float16": 2, "bfloat16": 2, "int8": 1, "uint8": 1,
            "float8_e4m3fn": 1, "float8_e5m2": 1}
# What two instances must share; num_blocks may differ (each pool is sized by its own memory).
MUST_MATCH = ("num_layers", "block_size", "num_kv_heads", "head_dim", "dtype", "model_hash")
# Prefixes the digest ``tier_group`` publishes, so it is never a hash the key is used for.
TIER_GROUP_DOMAIN = b"pipeline kv tier group v1\0"
_POSITIVE = ("num_layers", "num_blocks", "block_size", "num_kv_heads", "head_dim")


class LayoutMismatch(ValueError):
    """The two instances' KV caches cannot exchange blocks; names each differing field."""


class KVLayout(msgspec.Struct, frozen=True, kw_only=True):
    """A KV pool's shape. Under tensor parallelism with shared ranks (worker.kv_cache) it is
    the whole segment: ``num_layers`` counts every rank's layers, ``num_kv_heads`` one rank's."""
    num_layers: int
    num_blocks: int
    block_size: int  # tokens per block
    num_kv_heads: int
    head_dim: int
    dtype: str  # torch dtype name, e.g. "float32"
    # The model config hash: same shapes of a different model are refused too. "" until the
    # worker stage knows the checkpoint (the cache itself does not).
    model_hash: str = ""

    def __post_init__(self) -> None:
        for f in _POSITIVE:
            if getattr(self, f) < 1:
                raise ValueError(f"KVLayout.{f}={getattr(self, f)} must be >= 1")
        if self.dtype not in ITEMSIZE:
            raise ValueError(f"KVLayout.dtype={self.dtype!r} must be one of {sorted(ITEMSIZE)}")

    @property
    def block_bytes(self) -> int:
        """Bytes of one block of one layer's K (or V): the unit a transfer moves."""
        return self.block_size * self.num_kv_heads * self.head_dim * ITEMSIZE[self.dtype]

    @property
    def bytes_per_block(self) -> int:
        """Bytes one block costs across all layers, K and V: what the pool is sized in."""
        return self.num_layers * 2 * self.block_bytes

    @property
    def total_bytes(self) -> int:
        return self.num_blocks * self.bytes_per_block

    def check_peer(self, peer: KVLayout) -> None:
        """Raise LayoutMismatch naming every field on which `peer` differs, with both values."""
        diffs = [f"{f}: local={getattr(self, f)!r} remote={getattr(peer, f)!r}"
                 for f in MUST_MATCH if getattr(self, f) != getattr(peer, f)]
        if diffs:
            raise LayoutMismatch("KV layout mismatch, refusing to transfer: " + "; ".join(diffs))

    def tier_namespace(self) -> bytes:
        """16-byte digest of what must match for a KV tier's block to be reused here
        (num_blocks excluded): the subdirectory of a tier's files (cache/kv_tier/format.py)."""
        fields = "\0".join(f"{f}={getattr(self, f)!r}" for f in MUST_MATCH)
        return hashlib.blake2b(f"{fields}\0block_bytes={self.block_bytes}".encode(),
                               digest_size=16).digest()

    def tier_group(self, hash_key: bytes) -> str:
        """Who reads the same tier files as this instance (the router's tier siblings): a hex
        digest of the tier's hash key (``DIR/.hash_key``) and ``tier_namespace``, equal exactly
        when both are. Domain-separated, so it reveals nothing of the key."""
        return hashlib.blake2b(TIER_GROUP_DOMAIN + hash_key + self.tier_namespace(),
                               digest_size=16).hexdigest()

    def pool(self, buf: object) -> np.ndarray:
        """uint8 view `[num_layers, 2, num_blocks, block_bytes]` over a pool's memory."""
        import numpy as np  # here: the client imports the messages and needs no numpy

        # Size checked before any view exists: a raised error must not pin the mapping.
        with memoryview(buf) as mv:  # type: ignore[arg-type]
            nbytes = mv.nbytes
        if nbytes != self.total_bytes:
            raise LayoutMismatch(f"KV pool is {nbytes} bytes, its layout says "
                                 f"{self.total_bytes} ({self})")
        arr = np.frombuffer(buf, dtype=np.uint8)  # type: ignore[call-overload]
        return arr.reshape(self.num_layers, 2, self.num_blocks, self.block_bytes)
