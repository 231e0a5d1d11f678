"""Bench: the KV disk tier's store on its own (issue 26), before any connector uses it.

``python -m pipeline.bench.kvtier_store [--dir D] [--blocks N] [--files F] [--json]``:

- load bandwidth: ``DiskTier.load`` of N blocks of the 0.5B shape (24 layers, 2 KV heads,
  head_dim 64, block 16, bf16: 192 KiB a block) into a pool, against a plain read of the same
  files (open, ``os.readv`` of the whole file into a preallocated buffer, close), A/B
  interleaved, best of ``--reps``; page cache warm, and cold (``posix_fadvise DONTNEED`` on
  every file before each pass).
- metadata costs with F files (a one-row layout: the cost is per file, not per byte): save,
  lookup (a chain), and the eviction scan over F files, amortised over the tenth of the
  budget a scan frees.
Owns nothing; files go under ``--dir`` (a fresh temp dir by default, removed at the end).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
import time

import numpy as np

from pipeline.cache.kv_tier import DiskTier
from pipeline.cache.kv_tier.budget import LOW_WATER
from pipeline.messages.kv_layout import KVLayout

SHAPE_05B = dict(num_layers=24, block_size=16, num_kv_heads=2, head_dim=64, dtype="bfloat16")


def drop_cache(paths: list[str]) -> None:
    """Take ``paths`` out of the page cache (a cold read next)."""
    os.sync()  # dirty pages written back first: DONTNEED drops only clean ones
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def bandwidth(root: str, n: int, reps: int) -> dict[str, float]:
    lay = KVLayout(num_blocks=n, model_hash="bench", **SHAPE_05B)  # type: ignore[arg-type]
    src = np.random.default_rng(0).integers(0, 256, lay.total_bytes, dtype=np.uint8)
    dst_buf = np.zeros(lay.total_bytes, dtype=np.uint8)
    spool, dpool = lay.pool(src), lay.pool(dst_buf)
    tier = DiskTier(root, 2 * n * lay.bytes_per_block, lay)
    keys = [i.to_bytes(16, "big") for i in range(1, n + 1)]
    for i, k in enumerate(keys):
        tier.save(k, spool[:, :, i, :])
    os.sync()  # dirty pages written back: DONTNEED can drop them
    paths = [tier.path(k) for k in keys]
    flen = tier.file_bytes
    plain_buf = bytearray(n * flen)
    mv = memoryview(plain_buf)

    def plain() -> int:
        for i, p in enumerate(paths):
            fd = os.open(p, os.O_RDONLY)
            try:
                os.readv(fd, [mv[i * flen:(i + 1) * flen]])
            finally:
                os.close(fd)
        return n * flen

    def load() -> int:
        for i, k in enumerate(keys):
            if not tier.load(k, dpool[:, :, i, :]):
                raise RuntimeError(f"block {i} failed to load")
        return n * flen

    out: dict[str, float] = {"block_bytes": lay.bytes_per_block, "file_bytes": flen,
                             "blocks": n}
    for mode in ("warm", "cold"):
        best = {"plain": float("inf"), "load": float("inf")}
        for _ in range(reps):
            for name, fn in (("plain", plain), ("load", load)):
                if mode == "cold":
                    drop_cache(paths)
                else:
                    fn()  # warm the page cache (and the destination's pages)
                t = time.perf_counter()
                nbytes = fn()
                best[name] = min(best[name], time.perf_counter() - t)
        out[f"{mode}_plain_GBps"] = nbytes / best["plain"] / 1e9
        out[f"{mode}_load_GBps"] = nbytes / best["load"] / 1e9
        out[f"{mode}_ratio"] = best["plain"] / best["load"]
    if not np.array_equal(dpool, spool):
        raise RuntimeError("loaded blocks differ from the saved ones")
    tier.close()
    return out


def metadata(root: str, files: int) -> dict[str, float]:
    lay = KVLayout(num_layers=1, num_blocks=1, block_size=1, num_kv_heads=1, head_dim=64,
                   dtype="uint8", model_hash="meta")
    block = np.zeros((1, 2, lay.block_bytes), dtype=np.uint8)
    size = files * DiskTier(root, 1 << 40, lay).file_bytes  # exactly `files` fit
    tier = DiskTier(root, size, lay)
    keys = [i.to_bytes(16, "big") for i in range(files)]
    t = time.perf_counter()
    for k in keys:
        tier.save(k, block)
    save_s = (time.perf_counter() - t) / files
    chain = keys[:1000]
    t = time.perf_counter()
    for _ in range(10):
        assert tier.lookup(chain) == len(chain)
    lookup_s = (time.perf_counter() - t) / (10 * len(chain))
    scans = tier.budget.num_scans
    t = time.perf_counter()
    tier.save(files.to_bytes(16, "big"), block)  # one more: a full scan and eviction
    scan_s = time.perf_counter() - t
    assert tier.budget.num_scans == scans + 1
    tier.close()
    return {"files": files, "save_us": save_s * 1e6, "lookup_us_per_key": lookup_s * 1e6,
            "evict_scan_ms": scan_s * 1e3,
            "evict_us_per_save_amortised": scan_s * 1e6 / (files * (1 - LOW_WATER))}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m pipeline.bench.kvtier_store")
    ap.add_argument("--dir", default=None, help="where the files go (default: a temp dir)")
    ap.add_argument("--blocks", type=int, default=512)
    ap.add_argument("--files", type=int, default=100_000)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    base = tempfile.mkdtemp(prefix="kvtier-bench-", dir=a.dir)
    try:
        res = {"bandwidth": bandwidth(os.path.join(base, "bw"), a.blocks, a.reps),
               "metadata": metadata(os.path.join(base, "meta"), a.files)}
    finally:
        shutil.rmtree(base, ignore_errors=True)
    if a.json:
        print(json.dumps(res, indent=1))
    else:
        for sec, vals in res.items():
            print(sec + ": " + ", ".join(f"{k}={v:.3g}" for k, v in vals.items()))


if __name__ == "__main__":
    main()
