"""The KV disk tier's acceptance (issue 26) through the in-process ``LLM(kv_offload_dir=...)``:
greedy outputs equal a run without the tier while the tier serves hits (preemptions, a
working set 4x the pool), a restart on the same directory, two processes sharing it within
its budget, and files corrupted between runs. The real default model in float32, so equal
KV gives equal tokens; a pool of a few blocks makes the tier do the work.
"""
from __future__ import annotations

import hashlib
import multiprocessing as mp
import os
import queue
import random
import time
from array import array
from pathlib import Path

import msgspec
import numpy as np
import pytest

from pipeline import LLM
from pipeline.cache.kv_tier import format as fmt
from pipeline.cache.kv_tier.budget import LOCK_NAME, TMP_PREFIX
from pipeline.cache.kv_tier.store import DiskTier
from pipeline.config import DEFAULT_MODEL
from pipeline.engine.kv_connector.tier_index import HASH_KEY_FILE, tier_hash_key
from pipeline.sampling_params import SamplingParams

pytestmark = pytest.mark.skipif(not (Path(DEFAULT_MODEL) / "model.safetensors").is_file(),
                                reason="default model not built")

BS = 16
PREFIX, SUFFIX, MAX_TOKENS = 3 * BS, 4, 24  # 52-token prompts: 3 shared blocks, 5 in all
_rng = random.Random(26)
PREFIXES = [[_rng.randrange(3, 2000) for _ in range(PREFIX)] for _ in range(8)]
# PROMPTS[8 * p + s]: prefix p, suffix s.
PROMPTS = [p + [_rng.randrange(3, 2000) for _ in range(SUFFIX)] for p in PREFIXES for _ in range(8)]
SP = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
SMALL_POOL = 16  # blocks: 3 requests' worth


def make_llm(num_blocks: int, tier: str | None = None, size: int | str = "1GiB") -> LLM:
    kw: dict = {}
    if tier is not None:
        kw = {"kv_offload_dir": tier, "kv_offload_size": size}
    return LLM(device="cpu", dtype="float32", block_size=BS, num_blocks=num_blocks,
               max_model_len=128, max_num_seqs=64, **kw)


def generate(llm: LLM, idx: list[int]) -> dict[int, list[int]]:
    outs = llm.generate([PROMPTS[i] for i in idx], SP, use_tqdm=False)
    return {i: list(o.outputs[0].token_ids) for i, o in zip(idx, outs)}


def assert_released(llm: LLM) -> None:
    """Closed: its shared-memory segment is gone (tests/conftest.py checks only Instances)."""
    iid = llm.config.instance_id
    llm.close()
    assert not [n for n in os.listdir("/dev/shm") if iid in n]


def chain_head(root: str, tokens: list[int]) -> bytes:
    """The tier key of ``tokens``' first block: its prefix-cache hash under the tier's shared
    hash key (as engine/kv_cache_manager.py hashes, no cache salt)."""
    return hashlib.blake2b(array("i", tokens[:BS]).tobytes(), digest_size=16,
                           key=tier_hash_key(root)).digest()


def ns_dir(root: str) -> Path:
    (d,) = [p for p in Path(root).iterdir() if p.is_dir()]
    return d


def assert_all_files_intact(llm: LLM, root: str) -> int:
    """Every block file loads whole under this LLM's layout (a bad one would be removed and
    False); no temp file is left. The number of block files."""
    lay = llm._tier.mover.tier.layout
    tier = DiskTier(root, 1 << 30, lay)
    dst = lay.pool(np.zeros(lay.total_bytes, np.uint8))[:, :, 0, :]
    names = [p.name for p in ns_dir(root).iterdir()]
    assert not [n for n in names if n.startswith(TMP_PREFIX)]
    assert all(tier.load(bytes.fromhex(n), dst) for n in names)
    tier.close()
    return len(names)


@pytest.fixture(scope="module")
def reference() -> dict[int, list[int]]:
    """Every prompt's greedy tokens without a tier, a pool that holds them all at once."""
    llm = make_llm(512)
    try:
        out = generate(llm, list(range(len(PROMPTS))))
        assert llm.stats()["num_preemptions"] == 0
    finally:
        assert_released(llm)
    return out


def test_outputs_with_the_tier_equal_those_without(tmp_path, reference) -> None:
    # Four calls of 16 prompts, each call two suffixes of every prefix: the prefixes' 24
    # blocks alone outgrow the pool, so a later call finds them on disk, not in the pool.
    calls = [[8 * p + s for p in range(8) for s in (2 * k, 2 * k + 1)] for k in range(4)]
    llm = make_llm(SMALL_POOL, str(tmp_path))
    try:
        got: dict[int, list[int]] = {}
        for idx in calls:
            got.update(generate(llm, idx))
        st = llm.stats()
        assert sched_clean(llm)
    finally:
        assert_released(llm)
    assert got == reference
    blocks = {tuple((PROMPTS[i] + t)[:end]) for i, t in got.items()
              for end in range(BS, PREFIX + SUFFIX + MAX_TOKENS, BS)}
    assert len(blocks) >= 4 * SMALL_POOL  # the working set, in full blocks
    assert st["num_preemptions"] > 0
    assert st["kv_tier_loaded_tokens"] > 0 and st["kv_tier_failed_blocks"] == 0
    assert st["kv_tier_saving_blocks"] == 0 and st["kv_tier_loading_requests"] == 0


def sched_clean(llm: LLM) -> bool:
    """Nothing held: no request, no save or load in flight, a sound block table."""
    s = llm.scheduler
    return not s.requests and s.check_invariants() == [] and s.kv.pool.num_used_blocks == 0


def test_a_restart_on_the_same_directory_loads_from_the_tier(tmp_path, reference) -> None:
    idx = [8 * p + s for p in range(8) for s in (0, 1)]
    first = make_llm(256, str(tmp_path))
    try:
        assert {i: reference[i] for i in idx} == generate(first, idx)
        computed_first = first.stats()["computed_tokens"]
    finally:
        assert_released(first)  # close() writes the queued saves
    second = make_llm(256, str(tmp_path))
    try:
        assert {i: reference[i] for i in idx} == generate(second, idx)
        st = second.stats()
        assert sched_clean(second)
    finally:
        assert_released(second)
    # Every prefix's 3 blocks came from the tier (a fresh pool has nothing), once per prefix.
    assert st["kv_tier_loaded_tokens"] >= 8 * PREFIX and st["kv_tier_failed_blocks"] == 0
    assert st["computed_tokens"] <= computed_first - 8 * PREFIX


def test_close_writes_the_saves_deferred_past_the_pools_share(tmp_path) -> None:
    """A 7-block prompt cached by one step in a 16-block pool: 4 blocks are held for saves
    (MAX_SAVING_SHARE), 3 wait. No engine loop runs once generate returns: close() sends
    them as the first saves finish, so a restart loads the whole chain."""
    prompt = [_rng.randrange(3, 2000) for _ in range(7 * BS)]
    one = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    first = make_llm(SMALL_POOL, str(tmp_path))
    try:
        first.generate([prompt], one, use_tqdm=False)
        st = first.stats()  # (a report may have come in before generate returned)
        assert st["kv_tier_saving_blocks"] <= 4
        assert st["kv_tier_saved_blocks"] + st["kv_tier_saving_blocks"] + st["kv_tier_deferred_blocks"] == 7
    finally:
        assert_released(first)
    assert num_block_files(tmp_path) == 7
    second = make_llm(SMALL_POOL, str(tmp_path))
    try:
        second.generate([prompt + [5, 6]], one, use_tqdm=False)
        st = second.stats()
    finally:
        assert_released(second)
    assert st["kv_tier_loaded_tokens"] == 7 * BS and st["kv_tier_save_skipped"] == 0


def num_block_files(root: Path) -> int:
    return len(list(ns_dir(str(root)).iterdir()))


def _instance(root: str, size: int, idx: list[int], barrier, q) -> None:
    llm = make_llm(SMALL_POOL, root, size)
    try:
        barrier.wait(timeout=120)  # both built: their generates overlap
        out: dict[int, list[int]] = {}
        for k in range(0, len(idx), 12):
            out.update(generate(llm, idx[k:k + 12]))
        q.put((out, llm.stats()["kv_tier_saved_blocks"], llm.config.instance_id,
               sched_clean(llm)))
    finally:
        llm.close()


def collect(q, procs: list, timeout: float) -> list:
    """One result per process; fails at once when one died without it, else at ``timeout``."""
    deadline = time.monotonic() + timeout
    results: list = []
    while len(results) < len(procs):
        try:
            results.append(q.get(timeout=1))
        except queue.Empty:
            codes = [p.exitcode for p in procs]
            assert not [c for c in codes if c not in (None, 0)], f"an instance died: {codes}"
            assert time.monotonic() < deadline, f"no result in {timeout}s: {codes}"
    return results


def test_two_processes_share_one_directory_within_its_budget(tmp_path, reference) -> None:
    probe = make_llm(SMALL_POOL, str(tmp_path / "probe"))
    file_bytes = fmt.file_len(probe._tier.mover.tier.layout)
    assert_released(probe)
    root = tmp_path / "tier"
    budget = 24 * file_bytes  # a fifth of the 120 distinct blocks the two save: eviction runs
    a = [8 * p + s for p in range(6) for s in range(4)]  # prefixes 0-5
    b = [8 * p + s for p in reversed(range(2, 8)) for s in range(2, 6)]  # 7-2: overlapping
    ctx = mp.get_context("spawn")
    q, barrier = ctx.Queue(), ctx.Barrier(2)
    procs = [ctx.Process(target=_instance, args=(str(root), budget, idx, barrier, q))
             for idx in (a, b)]
    for p in procs:
        p.start()
    try:
        results = collect(q, procs, timeout=180)
    finally:
        for p in procs:
            p.join(timeout=60)
            if p.exitcode is None:
                p.kill()
                p.join(timeout=10)
    assert [p.exitcode for p in procs] == [0, 0]
    got: dict[int, list[int]] = {}
    for out, _, iid, clean in results:
        assert clean and not [n for n in os.listdir("/dev/shm") if iid in n]
        got.update(out)
    assert got == {i: reference[i] for i in a + b}
    assert sum(saved for _, saved, _, _ in results) * file_bytes > budget
    files = list(ns_dir(str(root)).iterdir())
    assert not [p for p in files if p.name.startswith(TMP_PREFIX)]
    on_disk = sum(p.stat().st_size for p in files)
    assert 0 < on_disk <= budget
    # The shared count is never below the truth (docs/kv_tier.md): the budget holds.
    count = int.from_bytes((root / LOCK_NAME).read_bytes()[:8], "little")
    assert on_disk <= count <= budget
    assert sorted(p.name for p in root.iterdir() if not p.is_dir()) == sorted([LOCK_NAME, HASH_KEY_FILE])


def test_files_corrupted_between_runs_are_misses_and_removed(tmp_path, reference) -> None:
    root = str(tmp_path / "tier")
    idx = [8 * p + s for p in range(8) for s in (0, 1)]
    first = make_llm(256, root)
    try:
        generate(first, idx)
        lay = first._tier.mover.tier.layout
    finally:
        assert_released(first)
    d = ns_dir(root)
    heads = [d / chain_head(root, PREFIXES[p]).hex() for p in range(8)]
    assert all(h.is_file() for h in heads)
    size = fmt.file_len(lay)
    raw = bytearray(heads[0].read_bytes())  # a flipped payload byte
    raw[fmt.header_len(lay) + 1000] ^= 0x10
    heads[0].write_bytes(bytes(raw))
    heads[1].write_bytes(heads[1].read_bytes()[:size // 2])  # truncated
    two, three = heads[2].read_bytes(), heads[3].read_bytes()  # swapped
    heads[2].write_bytes(three)
    heads[3].write_bytes(two)
    heads[4].write_bytes(os.urandom(size))  # garbage
    # Another model's block under the same key, moved in from its own namespace.
    other = msgspec.structs.replace(lay, model_hash="another model")
    foreign = DiskTier(tmp_path / "other", 1 << 30, other)
    key = bytes.fromhex(heads[5].name)
    assert foreign.save(key, other.pool(np.ones(other.total_bytes, np.uint8))[:, :, 0, :])
    foreign.close()
    os.replace(foreign.path(key), heads[5])
    bad = {h: h.read_bytes() for h in heads[:6]}

    second = make_llm(256, root)
    try:
        assert {i: reference[i] for i in idx} == generate(second, idx)
        st = second.stats()
        assert sched_clean(second)
        # Each corrupt head failed its load (a chain is useless past a gap: its tail too);
        # prefixes 6 and 7 loaded.
        assert st["kv_tier_failed_blocks"] >= 6
        assert st["kv_tier_loaded_tokens"] >= 2 * PREFIX
        # The corrupt files are gone: what is there now is a fresh save, whole.
        assert all(not h.exists() or h.read_bytes() != b for h, b in bad.items())
        assert assert_all_files_intact(second, root) >= 8 * 3
    finally:
        assert_released(second)
