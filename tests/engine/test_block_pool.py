"""Block pool, free queue and prefix-cache hashing (engine stage), without a scheduler."""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline.engine.block_pool import BlockPool, FreeBlockQueue, KVBlock
from pipeline.engine.kv_cache_manager import KVCacheManager
from pipeline.engine.request import Request
from pipeline.sampling_params import SamplingParams


def ids(blocks) -> list[int]:
    return [b.block_id for b in blocks]


def test_free_queue_removes_from_the_middle():
    blocks = [KVBlock(i) for i in range(5)]
    q = FreeBlockQueue(blocks)
    q.remove(blocks[2])
    q.appendleft(blocks[2])
    q.remove(blocks[4])
    assert ids(q) == [2, 0, 1, 3] and len(q) == 4
    assert q.popleft() is blocks[2]
    q.append(blocks[4])
    assert ids(q) == [0, 1, 3, 4]
    for _ in range(4):
        q.popleft()
    with pytest.raises(IndexError):
        q.popleft()


def test_eviction_order_uncached_first_then_lru_chain_tail_first():
    pool = BlockPool(6)
    a = pool.get_new_blocks(3)  # a chain of three blocks, all cached
    b = pool.get_new_blocks(2)  # two blocks, only the first cached
    for i, blk in enumerate(a):
        assert pool.cache_block(blk, bytes([1, i]), bytes([1, i]))
    assert pool.cache_block(b[0], b"\2", b"\2")
    pool.free_blocks(reversed(a))  # tail first
    pool.free_blocks(reversed(b))
    # Free queue head: the never-used block, then uncached b[1], then LRU cached: a's tail
    # before its head, then b[0] (freed last).
    order = ids(pool.free_queue)
    assert order[:2] == [b[1].block_id, 5] or order[:2] == [5, b[1].block_id]
    assert order[2:] == [a[2].block_id, a[1].block_id, a[0].block_id, b[0].block_id]
    assert pool.num_cached_free == 4 and not pool.check()
    # A hit on a[0] takes it out of the middle; freeing it again makes it most recent.
    pool.touch([a[0]])
    assert a[0].ref_cnt == 1 and pool.num_cached_free == 3
    pool.free_blocks([a[0]])
    assert ids(pool.free_queue)[-1] == a[0].block_id
    # Allocating everything evicts and forgets every hash.
    got = pool.get_new_blocks(6)
    assert not pool.cached and pool.num_cached_free == 0 and pool.num_evictions == 4
    assert all(blk.block_hash is None and blk.ref_cnt == 1 for blk in got)
    assert not pool.check()


def test_cache_block_rules():
    pool = BlockPool(3)
    x, y = pool.get_new_blocks(2)
    assert pool.cache_block(x, b"h", b"k")
    assert not pool.cache_block(y, b"h", b"k")  # same content already cached elsewhere
    assert pool.lookup(b"h", b"k") is x
    assert pool.lookup(b"h", b"other tokens") is None  # a hash hit must match the tokens
    pool.free_blocks([y])
    with pytest.raises(RuntimeError, match="nobody owns"):
        pool.cache_block(y, b"g", b"g")
    with pytest.raises(RuntimeError, match="freed more often"):
        pool.free_blocks([y])
    with pytest.raises(RuntimeError, match="asked for 4"):
        pool.get_new_blocks(4)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from("afct"), st.integers(0, 7)), max_size=60))
def test_pool_invariant_under_random_operations(ops):
    pool = BlockPool(8)
    held: list[KVBlock] = []
    for op, k in ops:
        if op == "a" and pool.num_free_blocks:
            held += pool.get_new_blocks(1 + k % pool.num_free_blocks)
        elif op == "f" and held:
            blk = held.pop(k % len(held))
            pool.free_blocks([blk])
        elif op == "c" and held:
            blk = held[k % len(held)]
            pool.cache_block(blk, bytes([k]), bytes([k]))
        elif op == "t":
            hit = pool.cached.get(bytes([k]))
            if hit is not None:
                pool.touch([hit])
                held.append(hit)
        assert not pool.check()
        assert pool.num_used_blocks == len(set(map(id, held)))


def _req(tokens, salt=None) -> Request:
    return Request("r", list(tokens), SamplingParams(), cache_salt=salt)


def test_chained_hashes_salted_per_instance_and_tenant():
    m1 = KVCacheManager(8, 4, hash_key=b"k1")
    m2 = KVCacheManager(8, 4, hash_key=b"k2")
    r1, r2, r3 = _req(range(10)), _req(range(10)), _req(range(10), salt="tenant-a")
    for m, r in ((m1, r1), (m2, r2), (m1, r3)):
        m.hash_new_blocks(r)
    assert len(r1.block_hashes) == 2  # only full blocks
    assert r1.block_hashes != r2.block_hashes  # per-instance key
    assert not set(r1.block_hashes) & set(r3.block_hashes)  # cache_salt changes the chain
    # Same second block, different first block: the chain makes the second hash differ.
    r4 = _req([9, 9, 9, 9, 4, 5, 6, 7])
    m1.hash_new_blocks(r4)
    assert r4.block_hashes[1] != r1.block_hashes[1]
    # Appending tokens hashes only the newly full block.
    r1.all_token_ids += [10, 11]
    before = m1.num_hashed_tokens
    m1.hash_new_blocks(r1)
    assert len(r1.block_hashes) == 3 and m1.num_hashed_tokens == before + 4


def test_prefix_hit_stops_at_first_miss_and_spares_the_last_token():
    m = KVCacheManager(16, 4, hash_key=b"k")
    owner = _req(range(12))
    m.hash_new_blocks(owner)
    assert m.allocate_slots(owner, 12) is not None
    owner.num_computed_tokens = 12
    m.cache_computed_blocks(owner)
    assert owner.num_cached_blocks == 3
    same = _req(range(12))
    m.hash_new_blocks(same)
    hits, n = m.get_computed_blocks(same)
    assert n == 8 and hits == owner.blocks[:2]  # 12 tokens: the last block is recomputed
    longer = _req(list(range(12)) + [50])
    m.hash_new_blocks(longer)
    assert m.get_computed_blocks(longer)[1] == 12
    diverge = _req([0, 1, 2, 3, 99, 5, 6, 7, 8])
    m.hash_new_blocks(diverge)
    assert m.get_computed_blocks(diverge)[1] == 4


def test_a_hash_collision_never_hands_out_foreign_kv():
    m = KVCacheManager(16, 4, hash_key=b"k")
    owner = _req([1, 2, 3, 4, 5, 6, 7, 8, 9])
    m.hash_new_blocks(owner)
    m.allocate_slots(owner, 9)
    owner.num_computed_tokens = 9
    m.cache_computed_blocks(owner)
    probe = _req([1, 2, 3, 4, 5, 6, 7, 8, 9])
    m.hash_new_blocks(probe)
    assert m.get_computed_blocks(probe)[1] == 8
    # Forge a collision: the second block's hash now maps to different content.
    owner.blocks[1].block_key = owner.blocks[1].block_key[:-4] + b"\0\0\0\0"
    hits, n = m.get_computed_blocks(probe)
    assert n == 4 and hits == owner.blocks[:1]
