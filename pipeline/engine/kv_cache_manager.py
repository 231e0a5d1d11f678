"""Engine stage: per-request KV blocks and the prefix cache (chained block hashes).

Owns the BlockPool and the instance's hash key. A full block's hash is
``blake2b(key=instance_key, parent_hash || token_ids)``; the first block's parent is the
empty string, or a digest of the request's ``cache_salt`` so tenants with different salts
never share (or probe) each other's blocks. Hashes are computed incrementally, once per
block, as tokens are appended (output caching hashes generated tokens the same way).

Blocks are published in the cache only once their KV is computed (``cache_computed_blocks``
runs when the worker reports the step) and only by the request that owns them at that
moment: a preempted or finished request owns nothing, so it can cache nothing (seed 001).
"""
from __future__ import annotations

import hashlib
import os
from array import array
from collections.abc import Sequence

from pipeline.engine.block_pool import BlockPool, KVBlock
from pipeline.engine.request import Request


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True,
                 hash_key: bytes | None = None) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.pool = BlockPool(num_blocks, enable_caching)
        # Per-instance secret: hashes cannot be predicted or replayed across instances.
        self._key = hash_key if hash_key is not None else os.urandom(32)
        self.num_hashed_tokens = 0
        self.num_queried_tokens = 0
        self.num_hit_tokens = 0

    # -- hashing -------------------------------------------------------------------------
    def _block_key(self, req: Request, i: int) -> bytes:
        bs = self.block_size
        parent = req.block_hashes[i - 1] if i else self._root(req)
        return parent + array("i", req.all_token_ids[i * bs:(i + 1) * bs]).tobytes()

    def _root(self, req: Request) -> bytes:
        if req.cache_salt is None:
            return b""
        return hashlib.blake2b(b"cache_salt\0" + req.cache_salt.encode(), digest_size=16,
                               key=self._key).digest()

    def hash_new_blocks(self, req: Request) -> None:
        """Hash every full block of ``req`` not hashed yet (O(1) amortised per token)."""
        if not self.enable_caching:
            return
        n_full = len(req.all_token_ids) // self.block_size
        key = self._key
        hashes = req.block_hashes
        while len(hashes) < n_full:
            hashes.append(hashlib.blake2b(self._block_key(req, len(hashes)), digest_size=16,
                                          key=key).digest())
            self.num_hashed_tokens += self.block_size

    # -- prefix cache lookup -------------------------------------------------------------
    def get_computed_blocks(self, req: Request) -> tuple[list[KVBlock], int]:
        """Longest cached prefix of ``req`` as blocks, and its length in tokens.

        At most ``num_tokens - 1`` tokens: the last one is always recomputed so the worker
        gets logits to sample from, even when the whole prompt is cached.
        """
        if not self.enable_caching:
            return [], 0
        limit = min(len(req.block_hashes), (req.num_tokens - 1) // self.block_size)
        hits: list[KVBlock] = []
        cached = self.pool.cached
        for i in range(limit):
            b = cached.get(req.block_hashes[i])
            # The exact bytes are built only on a hash hit, to verify it.
            if b is None or b.block_key != self._block_key(req, i):
                break
            hits.append(b)
        return hits, len(hits) * self.block_size

    # -- allocation ----------------------------------------------------------------------
    def blocks_needed(self, req: Request, num_new_tokens: int,
                      computed: Sequence[KVBlock] = ()) -> int:
        """Free-queue blocks an ``allocate_slots`` with these arguments would consume."""
        total = req.num_computed_tokens + len(computed) * self.block_size + num_new_tokens
        new = -(-total // self.block_size) - len(req.blocks) - len(computed)
        return max(new, 0) + sum(1 for b in computed if b.ref_cnt == 0)

    def allocate_slots(self, req: Request, num_new_tokens: int,
                       computed: Sequence[KVBlock] = ()) -> list[KVBlock] | None:
        """Give ``req`` room for ``num_new_tokens`` more KV entries after its computed ones
        (and after ``computed``, a prefix-cache hit taken at admission).

        Returns the newly allocated blocks, or None (and changes nothing) if the pool cannot
        supply them.
        """
        bs = self.block_size
        total = req.num_computed_tokens + len(computed) * bs + num_new_tokens
        n_new = max(-(-total // bs) - len(req.blocks) - len(computed), 0)
        n_evictable_hits = sum(1 for b in computed if b.ref_cnt == 0)
        if n_new + n_evictable_hits > self.pool.num_free_blocks:
            return None
        if computed:
            self.pool.touch(computed)
            req.blocks.extend(computed)
            req.num_computed_tokens += len(computed) * bs
            req.num_cached_blocks = len(req.blocks)
        new = self.pool.get_new_blocks(n_new) if n_new else []
        req.blocks.extend(new)
        return new

    def cache_computed_blocks(self, req: Request) -> None:
        """Publish the blocks of ``req`` that became full of computed KV (prompt or output)."""
        if not self.enable_caching:
            return
        n_full = min(req.num_computed_tokens // self.block_size, len(req.block_hashes),
                     len(req.blocks))
        for i in range(req.num_cached_blocks, n_full):
            self.pool.cache_block(req.blocks[i], req.block_hashes[i], self._block_key(req, i))
        if n_full > req.num_cached_blocks:
            req.num_cached_blocks = n_full

    def record_lookup(self, num_queried: int, num_hit: int) -> None:
        self.num_queried_tokens += num_queried
        self.num_hit_tokens += num_hit

    def free(self, req: Request) -> None:
        """Release every block of ``req``, tail first; their hashes stay in the cache."""
        self.pool.free_blocks(reversed(req.blocks))
        req.blocks = []
        req.num_cached_blocks = 0

    @property
    def hit_rate(self) -> float:
        return self.num_hit_tokens / self.num_queried_tokens if self.num_queried_tokens else 0.0
