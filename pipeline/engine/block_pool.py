"""Engine stage: the fixed pool of KV blocks, their reference counts and the prefix cache map.

The pool owns every KVBlock of the instance. A block is either in use (ref_cnt > 0, held by
one or more requests; more than one only for a shared cached prefix) or free (ref_cnt == 0,
in the free queue). A free block that still carries a hash is "cached-evictable": a later
request may take it back out of the middle of the queue, and allocation evicts it only when
it reaches the head. Every operation here is O(1) per block.

Eviction order: the queue's head is taken first. Freed blocks without a hash go to the head
(nothing to lose); freed cached blocks go to the tail, so the least recently used cached
block is evicted first. Callers free a request's blocks tail-first, so a chain's tail is
evicted before its head (a shorter prefix stays useful longer than a longer one).
"""
from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass


@dataclass(slots=True, eq=False)
class KVBlock:
    block_id: int
    ref_cnt: int = 0
    block_hash: bytes | None = None
    # The exact bytes that were hashed (parent hash + token ids): a hit must match them, so
    # a hash collision can never hand a request someone else's KV.
    block_key: bytes | None = None
    prev: KVBlock | None = None
    next: KVBlock | None = None
    in_free_queue: bool = False


class FreeBlockQueue:
    """Intrusive doubly linked list of free blocks with sentinels: O(1) everywhere."""

    __slots__ = ("head", "tail", "size")

    def __init__(self, blocks: list[KVBlock]) -> None:
        self.head = KVBlock(-1)
        self.tail = KVBlock(-2)
        self.head.next, self.tail.prev = self.tail, self.head
        self.size = 0
        for b in blocks:
            self.append(b)

    def __len__(self) -> int:
        return self.size

    def _link_after(self, anchor: KVBlock, b: KVBlock) -> None:
        nxt = anchor.next
        b.prev, b.next = anchor, nxt
        anchor.next = b
        nxt.prev = b  # type: ignore[union-attr]
        b.in_free_queue = True
        self.size += 1

    def append(self, b: KVBlock) -> None:
        self._link_after(self.tail.prev, b)  # type: ignore[arg-type]

    def appendleft(self, b: KVBlock) -> None:
        self._link_after(self.head, b)

    def remove(self, b: KVBlock) -> None:
        b.prev.next = b.next  # type: ignore[union-attr]
        b.next.prev = b.prev  # type: ignore[union-attr]
        b.prev = b.next = None
        b.in_free_queue = False
        self.size -= 1

    def popleft(self) -> KVBlock:
        b = self.head.next
        if b is self.tail:
            raise IndexError("no free KV block")
        self.remove(b)  # type: ignore[arg-type]
        return b  # type: ignore[return-value]

    def __iter__(self):
        b = self.head.next
        while b is not self.tail:
            yield b
            b = b.next


class BlockPool:
    def __init__(self, num_blocks: int, enable_caching: bool = True) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        self.free_queue = FreeBlockQueue(self.blocks)
        self.cached: dict[bytes, KVBlock] = {}
        self.num_cached_free = 0  # free blocks that still carry a hash (evictable)
        self.num_evictions = 0
        # Called with each block as it is published in the prefix cache, its KV computed and
        # its owner holding it (a KV connector saving blocks to a second KV tier).
        self.on_cached: Callable[[KVBlock], None] | None = None

    @property
    def num_free_blocks(self) -> int:
        """Blocks allocation can hand out now, evictable cached ones included."""
        return self.free_queue.size

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.free_queue.size

    def get_new_blocks(self, n: int) -> list[KVBlock]:
        if n > self.free_queue.size:
            raise RuntimeError(f"asked for {n} KV blocks, {self.free_queue.size} free")
        out = []
        for _ in range(n):
            b = self.free_queue.popleft()
            if b.block_hash is not None:
                self._evict(b)
            b.ref_cnt = 1
            out.append(b)
        return out

    def _evict(self, b: KVBlock) -> None:
        if self.cached.get(b.block_hash) is b:  # type: ignore[arg-type]
            del self.cached[b.block_hash]  # type: ignore[arg-type]
        b.block_hash = b.block_key = None
        self.num_cached_free -= 1
        self.num_evictions += 1

    def touch(self, blocks: Iterable[KVBlock]) -> None:
        """Take prefix-cache hits: a free cached block leaves the queue's middle."""
        for b in blocks:
            if b.ref_cnt == 0:
                self.free_queue.remove(b)
                self.num_cached_free -= 1
            b.ref_cnt += 1

    def free_blocks(self, blocks_in_eviction_order) -> None:
        """Drop one reference from each block; pass a request's blocks tail-first."""
        for b in blocks_in_eviction_order:
            b.ref_cnt -= 1
            if b.ref_cnt == 0:
                if b.block_hash is None:
                    self.free_queue.appendleft(b)
                else:
                    self.free_queue.append(b)
                    self.num_cached_free += 1
            elif b.ref_cnt < 0:
                raise RuntimeError(f"KV block {b.block_id} freed more often than taken")

    def lookup(self, block_hash: bytes, block_key: bytes) -> KVBlock | None:
        b = self.cached.get(block_hash)
        if b is None or b.block_key != block_key:
            return None
        return b

    def cache_block(self, b: KVBlock, block_hash: bytes, block_key: bytes) -> bool:
        """Publish an in-use, fully computed block under its chain hash.

        Only the owner calls this, while it owns the block. If another block already holds
        the same content (two requests computed it at once) this one stays uncached.
        """
        if b.ref_cnt <= 0:
            raise RuntimeError(f"caching KV block {b.block_id} that nobody owns")
        if b.block_hash is not None or block_hash in self.cached:
            return False
        b.block_hash, b.block_key = block_hash, block_key
        self.cached[block_hash] = b
        if self.on_cached is not None:
            self.on_cached(b)
        return True

    def check(self) -> list[str]:
        """Full O(num_blocks) consistency scan; returns violations (empty when sound)."""
        errs: list[str] = []
        in_queue = 0
        cached_free = 0
        for b in self.free_queue:
            in_queue += 1
            if b.ref_cnt != 0:
                errs.append(f"block {b.block_id} in free queue with ref_cnt {b.ref_cnt}")
            if b.block_hash is not None:
                cached_free += 1
        if in_queue != self.free_queue.size:
            errs.append(f"free queue links {in_queue} blocks, size says {self.free_queue.size}")
        in_use = sum(1 for b in self.blocks if b.ref_cnt > 0)
        if any(b.ref_cnt == 0 and not b.in_free_queue for b in self.blocks):
            errs.append("a block with ref_cnt 0 is missing from the free queue")
        if cached_free != self.num_cached_free:
            errs.append(f"cached-evictable count {self.num_cached_free}, actual {cached_free}")
        if (in_queue - cached_free) + cached_free + in_use != self.num_blocks:
            errs.append(f"free {in_queue - cached_free} + cached-evictable {cached_free} + "
                        f"in-use {in_use} != total {self.num_blocks}")
        for h, b in self.cached.items():
            if b.block_hash != h:
                errs.append(f"cache map entry for block {b.block_id} has a stale hash")
        return errs
