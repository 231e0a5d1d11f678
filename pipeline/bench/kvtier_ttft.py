"""`pipeline bench kvtier`, part 1 and 5: time to first token of a prompt whose first 2k
tokens are in the KV disk tier but not in the pool, loaded against computed, and the
tier's load bandwidth against a plain read of the same files.

A filler engine (its pool large enough that nothing is evicted before its save) saves the
prefixes and closes (its saves drained); then an engine on the same directory, whose pool
never saw them, generates one token after prefix + suffix, and an engine without a tier
the same prompt, in alternating order; page cache warm, then cold (``posix_fadvise
DONTNEED`` on every tier file before each run: no root needed). After each pair, a plain
sequential read of the files that load read (a load stamps its chain newest), warm or
dropped likewise. Owns: its two engines and the tier directory ``ttft`` under the run's.
"""
from __future__ import annotations

import os
import time
from typing import Any

from pipeline.bench.kvtier_runs import BS, Env, blocks, delta, timed
from pipeline.bench.kvtier_store import drop_cache
from pipeline.llm import LLM


def tier_files(root: str) -> list[str]:
    """Every block file under a tier directory (its namespace subdirectories)."""
    out = []
    for ns in sorted(os.listdir(root)):
        d = os.path.join(root, ns)
        if os.path.isdir(d):
            out += [os.path.join(d, f) for f in sorted(os.listdir(d)) if not f.startswith(".")]
    return out


def plain_read(paths: list[str]) -> tuple[int, float]:
    """Bytes and seconds of reading every file whole, one after the other (open, readv into a
    preallocated buffer, close): what a load is set against. Each file into its own part of
    the buffer, its pages touched beforehand, as a load writes distinct pool blocks (one
    reused buffer would stay in the CPU's cache: not a fair comparison)."""
    size = max(os.path.getsize(p) for p in paths)
    mv = memoryview(bytearray(len(paths) * size))  # (zero-filled: its pages touched)
    n = 0
    t = time.perf_counter()
    for i, p in enumerate(paths):
        fd = os.open(p, os.O_RDONLY)
        try:
            n += os.readv(fd, [mv[i * size:(i + 1) * size]])
        finally:
            os.close(fd)
    return n, time.perf_counter() - t


def touch_pool(llm: LLM, env: Env, num_blocks: int, max_len: int) -> None:
    """Prompts that fill the whole pool, untimed: its pages touched (a fresh pool's first
    writes fault its shared-memory pages in: that cost is the pool's, once, not the tier's)
    and whatever it cached evicted."""
    n = -(-num_blocks * BS // (max_len - 1))
    timed(llm, [env.tokens(max_len - 1) for _ in range(n)], 1)


def ttft(env: Env, prefix: int, suffix: int, rounds: int) -> dict[str, Any]:
    """Per round and page-cache mode: the same prompt on the tier engine (its prefix loaded)
    and on the one without (computed), in alternating order; then a plain read of the very
    files that load read (the chain's files are the newest: a load stamps them)."""
    d = env.tier_dir("ttft")
    nb, ml = 2 * blocks(prefix + suffix + 1) + 8, prefix + suffix + 1
    prefixes = [env.tokens(prefix) for _ in range(2 * rounds)]
    fill_blocks = len(prefixes) * blocks(prefix + 1) + 16  # all at once: nothing evicted before its save
    with env.llm(d, fill_blocks, ml) as fill:
        timed(fill, prefixes, 1)
    files = tier_files(d)
    chain = prefix // BS
    res: dict[str, Any] = {"prefix_tokens": prefix, "suffix_tokens": suffix, "blocks": chain}
    with env.llm(None, nb, ml) as off, env.llm(d, nb, ml) as on:
        touch_pool(off, env, nb, ml)
        touch_pool(on, env, nb, ml)
        for mode, half in (("warm", prefixes[:rounds]), ("cold", prefixes[rounds:])):
            t = {"on": 0.0, "off": 0.0}
            plain_n = plain_s = 0.0
            st = on.stats()
            for i, p in enumerate(half):
                prompt = p + env.tokens(suffix)
                for side in ("on", "off") if i % 2 == 0 else ("off", "on"):
                    if mode == "cold":
                        drop_cache(files)
                    elif side == "on":
                        plain_read(files)  # every file warm, whatever ran since
                    t[side] += timed(on if side == "on" else off, [prompt], 1)[0]
                read = sorted(files, key=os.path.getmtime)[-chain:]
                if mode == "cold":
                    drop_cache(read)
                n, sec = plain_read(read)
                plain_n, plain_s = plain_n + n, plain_s + sec
            dl = delta(on, st)
            if dl["kv_tier_loaded_tokens"] != len(half) * BS * chain:
                raise RuntimeError(f"{mode}: {dl['kv_tier_loaded_tokens']} tokens loaded from the tier, "
                                   f"expected {len(half) * BS * chain}")
            res[f"{mode}_ttft_on_ms"] = 1e3 * t["on"] / len(half)
            res[f"{mode}_ttft_off_ms"] = 1e3 * t["off"] / len(half)
            res[f"{mode}_ttft_ratio"] = t["off"] / t["on"]
            res[f"{mode}_load_GBps"] = dl["kv_tier_load_bytes"] / dl["kv_tier_load_seconds"] / 1e9
            res[f"{mode}_load_wait_ms"] = 1e3 * dl["kv_tier_load_wait_seconds"] / dl["kv_tier_load_waits"]
            res[f"{mode}_plain_GBps"] = plain_n / plain_s / 1e9
            res[f"{mode}_bw_ratio"] = res[f"{mode}_load_GBps"] / res[f"{mode}_plain_GBps"]
    return res
