"""The KV disk tier's store (pipeline/cache/kv_tier): round trips, corruption, restart,
two instances and two processes on one directory, the LRU budget (hypothesis)."""
from __future__ import annotations

import multiprocessing as mp
import os
import shutil
import tempfile
from collections import OrderedDict

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pipeline._ext import kv_io
from pipeline.cache.kv_tier import DiskTier
from pipeline.messages.kv_layout import KVLayout

LAY = KVLayout(num_layers=3, num_blocks=6, block_size=4, num_kv_heads=2, head_dim=8,
               dtype="bfloat16", model_hash="model-a")


def _pool(seed: int, lay: KVLayout = LAY) -> np.ndarray:
    buf = np.random.default_rng(seed).integers(0, 256, lay.total_bytes, dtype=np.uint8)
    return lay.pool(buf)


def _dir_bytes(root: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(root) for f in fs
               if not f.startswith(".lock"))


def _crc32c_ref(data: bytes) -> int:
    c = 0xFFFFFFFF
    for b in data:
        c ^= b
        for _ in range(8):
            c = (c >> 1) ^ 0x82F63B78 if c & 1 else c >> 1
    return c ^ 0xFFFFFFFF


@pytest.mark.parametrize("n", [0, 1, 7, 31, 32, 33, 100, 257])
def test_checksum_is_striped_crc32c(n: int) -> None:
    data = np.random.default_rng(n).integers(0, 256, n, dtype=np.uint8)
    assert kv_io.crc32c(np.frombuffer(b"123456789", np.uint8)) == 0xE3069283
    q = (n // 32) * 8
    stripes = [data[:q], data[q:2 * q], data[2 * q:3 * q], data[3 * q:]]
    le = b"".join(_crc32c_ref(s.tobytes()).to_bytes(4, "little") for s in stripes)
    assert kv_io.checksum(data) == _crc32c_ref(le)


def test_round_trip_block_and_layer_range(tmp_path: str) -> None:
    src, dst = _pool(1), _pool(2)
    tier = DiskTier(tmp_path, 10 * LAY.bytes_per_block, LAY)
    assert tier.save(b"k" * 16, src[:, :, 4, :])
    assert not tier.save(b"k" * 16, src[:, :, 4, :])  # already there
    assert tier.lookup([b"k" * 16, b"x" * 16, b"k" * 16]) == 1
    assert tier.load(b"k" * 16, dst[:, :, 0, :])
    assert np.array_equal(dst[:, :, 0, :], src[:, :, 4, :])
    before = dst.copy()
    assert tier.load(b"k" * 16, dst[:, :, 5, :], layers=(1, 2))
    assert np.array_equal(dst[1, :, 5, :], src[1, :, 4, :])
    after = dst.copy()
    after[1, :, 5, :] = before[1, :, 5, :]
    assert np.array_equal(after, before)  # nothing else written
    assert not tier.load(b"y" * 16, dst[:, :, 0, :])
    assert tier.save(7, src[:, :, 0, :]) and tier.lookup([7]) == 1  # int keys (vLLM style)


def test_bad_arguments_name_the_limit(tmp_path: str) -> None:
    with pytest.raises(ValueError, match="less than one block"):
        DiskTier(tmp_path, LAY.bytes_per_block - 1, LAY)
    tier = DiskTier(tmp_path, 10 * LAY.bytes_per_block, LAY)
    with pytest.raises(ValueError, match="shape"):
        tier.save(b"k", np.zeros(4, np.uint8))
    with pytest.raises(ValueError, match="layers"):
        tier.load(b"k", _pool(0)[:, :, 0, :], layers=(2, 2))
    with pytest.raises(ValueError, match="block key"):
        tier.save(b"k" * 65, _pool(0)[:, :, 0, :])


def _corrupt(kind: str, tier: DiskTier, root: str) -> None:
    a, b = tier.path(b"a"), tier.path(b"b")
    data = bytearray(open(a, "rb").read())
    if kind == "truncate":
        data = data[:len(data) - 3]
    elif kind == "flip_payload":
        data[-100] ^= 0x10
    elif kind == "flip_header":
        data[40] ^= 0x01
    elif kind == "swap":  # b's complete file under a's name
        data = bytearray(open(b, "rb").read())
    elif kind == "foreign":  # another model's file of the same key under the same name
        other = KVLayout(**{**{f: getattr(LAY, f) for f in LAY.__struct_fields__},
                            "model_hash": "model-b"})
        t2 = DiskTier(root, 10 * LAY.bytes_per_block, other)
        t2.save(b"a", _pool(9)[:, :, 0, :])
        data = bytearray(open(t2.path(b"a"), "rb").read())
    with open(a, "wb") as f:
        f.write(data)


@pytest.mark.parametrize("kind", ["truncate", "flip_payload", "flip_header", "swap", "foreign"])
@pytest.mark.parametrize("layers", [None, (2, 3)])
def test_corrupt_file_is_a_miss_and_removed(tmp_path: str, kind: str, layers) -> None:
    src, dst = _pool(3), _pool(4)
    tier = DiskTier(tmp_path, 10 * LAY.bytes_per_block, LAY)
    tier.save(b"a", src[:, :, 0, :])
    tier.save(b"b", src[:, :, 1, :])
    _corrupt(kind, tier, str(tmp_path))
    if kind == "flip_payload" and layers == (2, 3):
        layers = (0, 1)  # the flipped byte is in the last layer: read another
        assert DiskTier(tmp_path, 10 * LAY.bytes_per_block, LAY).load(b"a", dst[:, :, 0, :],
                                                                       layers=layers)
        layers = (2, 3)
    assert tier.load(b"a", dst[:, :, 0, :], layers=layers) is False
    assert not os.path.exists(tier.path(b"a"))
    assert tier.load(b"b", dst[:, :, 1, :]) and np.array_equal(dst[:, :, 1, :], src[:, :, 1, :])


@pytest.mark.parametrize("kind", ["truncate", "flip_payload", "flip_header", "swap", "foreign"])
def test_load_chain_stops_at_the_first_block_that_does_not_load(tmp_path: str, kind: str) -> None:
    """``load_chain`` (the mover's loop) accepts and refuses exactly what ``load`` does: the
    leading blocks up to a bad file (removed), a missing one, or an id outside the pool."""
    src, dst = _pool(7), _pool(8)
    tier = DiskTier(tmp_path, 10 * LAY.bytes_per_block, LAY)
    for i, k in enumerate((b"x", b"a", b"b")):
        tier.save(k, src[:, :, i, :])
    assert tier.load_chain([b"x", b"a", b"b"], dst, [3, 4, 5]) == 3
    assert np.array_equal(dst[:, :, 3:6, :], src[:, :, 0:3, :])
    _corrupt(kind, tier, str(tmp_path))
    assert tier.load_chain([b"x", b"a", b"b"], dst, [0, 1, 2]) == 1
    assert not os.path.exists(tier.path(b"a")) and os.path.exists(tier.path(b"b"))
    assert np.array_equal(dst[:, :, 0, :], src[:, :, 0, :])
    assert tier.load_chain([b"b", b"a"], dst, [2, 1]) == 1  # a is gone now: a miss
    assert tier.load_chain([b"x", b"b"], dst, [0, LAY.num_blocks]) == 1  # outside the pool
    assert tier.load_chain([b"x"], dst, [-1]) == 0
    with pytest.raises(ValueError, match="shape"):
        tier.load_chain([b"x"], _pool(0, KVLayout(**{**{f: getattr(LAY, f) for f in LAY.__struct_fields__},
                                                     "num_layers": 2})), [0])


def test_restart_finds_blocks_and_models_do_not_mix(tmp_path: str) -> None:
    src, dst = _pool(5), _pool(6)
    t1 = DiskTier(tmp_path, 10 * LAY.bytes_per_block, LAY)
    keys = [bytes([i]) * 16 for i in range(4)]
    for i, k in enumerate(keys):
        t1.save(k, src[:, :, i, :])
    t1.close()
    t2 = DiskTier(tmp_path, 10 * LAY.bytes_per_block, LAY)
    assert t2.lookup(keys) == 4
    for i, k in enumerate(keys):
        assert t2.load(k, dst[:, :, i, :])
    assert np.array_equal(dst[:, :, :4, :], src[:, :, :4, :])
    other = KVLayout(**{**{f: getattr(LAY, f) for f in LAY.__struct_fields__}, "head_dim": 16})
    assert DiskTier(tmp_path, 10 * LAY.bytes_per_block, other).lookup(keys) == 0


OPS = st.lists(st.tuples(st.sampled_from(["save", "load", "lookup", "touch"]),
                         st.integers(0, 1), st.integers(0, 11)), min_size=1, max_size=60)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=OPS, cap=st.integers(2, 6))
def test_two_instances_model_lru(ops, cap: int) -> None:
    """Two DiskTiers on one dir against a dict: the directory never passes the budget, a
    load gives exactly the saved bytes or False, and a recently used block outlives older."""
    root = tempfile.mkdtemp()
    try:
        src, dst = _pool(7, KVLayout(**{**{f: getattr(LAY, f) for f in LAY.__struct_fields__},
                                         "num_blocks": 12})), _pool(8)
        probe = DiskTier(root, 1 << 30, LAY)
        budget = cap * probe.file_bytes
        probe.close()
        shutil.rmtree(root)
        tiers = [DiskTier(root, budget, LAY), DiskTier(root, budget, LAY)]
        saved: OrderedDict[int, bytes] = OrderedDict()
        for op, who, key in ops:
            t = tiers[who]
            if op == "save":
                t.save(key, src[:, :, key, :])
                saved[key] = src[:, :, key, :].tobytes()
                saved.move_to_end(key)
                assert _dir_bytes(root) <= budget
            elif op == "load":
                if t.load(key, dst[:, :, 0, :]):
                    assert dst[:, :, 0, :].tobytes() == saved[key]
                    saved.move_to_end(key)
                else:
                    saved.pop(key, None)
            elif op == "lookup":
                assert t.lookup([key]) in (0, 1)
                assert t.lookup([key]) == 0 or key in saved
            else:
                present = t.lookup([key]) == 1
                t.touch([key])
                if present and key in saved:
                    saved.move_to_end(key)
        # The most recent block always survives (eviction takes the oldest first).
        if saved:
            last = next(reversed(saved))
            assert tiers[0].load(last, dst[:, :, 0, :])
            assert dst[:, :, 0, :].tobytes() == saved[last]
    finally:
        shutil.rmtree(root, ignore_errors=True)


def test_a_scan_right_after_a_reservation_still_counts_the_file(tmp_path: str, monkeypatch) -> None:
    """Another instance's eviction scan that lands between a save's reservation and its write
    (its budget reset to the files it finds) must find the file being saved: the shared count
    is never below the bytes on disk, or the directory could outgrow its budget."""
    from pipeline.cache.kv_tier.budget import Budget
    root = str(tmp_path)
    size = 50 * LAY.bytes_per_block
    tier = DiskTier(root, size, LAY)
    other = Budget(root, size)  # another instance's view of the directory
    real = Budget.reserve

    def reserve_then_scan(self, nbytes, *args, **kwargs):
        real(self, nbytes, *args, **kwargs)
        with other._locked() as fd:  # what the other instance's scan does to the count
            other._write(fd, other._scan_and_evict(size))
    monkeypatch.setattr(Budget, "reserve", reserve_then_scan)
    src = _pool(1)
    for i in range(LAY.num_blocks):
        assert tier.save(bytes([i]) * 16, src[:, :, i, :])
        assert tier.budget.usage() >= _dir_bytes(root) > 0


def _worker(root: str, budget: int, seed: int, q) -> None:
    lay = KVLayout(**{**{f: getattr(LAY, f) for f in LAY.__struct_fields__}, "num_blocks": 16})
    src = _pool(100, lay)  # both processes: the same bytes for a key, as a real chain hash
    dst = _pool(seed, lay)
    tier = DiskTier(root, budget, LAY)
    rng = np.random.default_rng(seed)
    bad = hits = 0
    for _ in range(400):
        k = int(rng.integers(0, 16))
        if rng.random() < 0.5:
            tier.save(k, src[:, :, k, :])
        elif tier.load(k, dst[:, :, 0, :]):
            hits += 1
            bad += not np.array_equal(dst[:, :, 0, :], src[:, :, k, :])
    q.put((bad, hits, tier.num_corrupt))


def test_two_processes_write_and_read_one_dir(tmp_path: str) -> None:
    budget = 6 * DiskTier(tmp_path, 1 << 30, LAY).file_bytes
    shutil.rmtree(tmp_path)
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(str(tmp_path), budget, s, q)) for s in (1, 2)]
    for p in procs:
        p.start()
    results = [q.get(timeout=120) for _ in procs]
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    assert all(bad == 0 and corrupt == 0 for bad, _, corrupt in results)
    assert sum(h for _, h, _ in results) > 0
    assert _dir_bytes(str(tmp_path)) <= budget
