"""`pipeline bench kvtier`'s workloads: each one on in-process ``LLM``s with the KV disk tier
on and off, the same token-id prompts on both, greedy, ``ignore_eos`` (every request makes
exactly its tokens), prefix caching on everywhere, one warm-up generate per engine before
anything is timed.

- ``ttft``: a prefix saved to the tier by a filler engine (closed: its saves drained), then a
  fresh engine on the same directory (its pool empty) generates one token after prefix +
  suffix, against an engine without a tier computing the same prompt; page cache warm, then
  cold (``posix_fadvise DONTNEED`` on every tier file). Also a plain sequential read of
  the tier's files, warm and cold, for the load bandwidth.
- ``chat``: conversations that come back turn after turn, their histories 4x the pool.
- ``noreuse``: fresh prompts, nothing to hit; the tier's cost alone (its write-through saves).
- ``shared``: requests at once on one long prefix, computed fresh, and found in the tier.
Pairs of runs alternate ABBA (off, on, on, off, ...): the figure is the ratio of their totals.
Owns: the engines of one workload (closed at its end) and its tier directory under ``base``.
"""
from __future__ import annotations

import os
import random
import time
from dataclasses import dataclass
from typing import Any

from pipeline.llm import LLM
from pipeline.sampling_params import SamplingParams

BS = 16  # the engine's block size on CPU (checked against each engine)


def blocks(tokens: int) -> int:
    return -(-tokens // BS)


@dataclass
class Env:
    model: str
    base: str  # tier directories go under it
    vocab: int
    threads: int  # worker threads; 0: the engine's adaptive default
    rng: random.Random

    def tokens(self, n: int) -> list[int]:
        # Clear of the special ids at both ends (bos/pad low, eos the last).
        return [self.rng.randrange(3, self.vocab - 1) for _ in range(n)]

    def llm(self, tier: str | None, num_blocks: int, max_len: int) -> LLM:
        kw: dict[str, Any] = dict(dtype="bfloat16", num_blocks=num_blocks, enable_prefix_caching=True,
                                  max_model_len=BS * blocks(max_len), skip_tokenizer_init=True)
        if tier is not None:
            kw.update(kv_offload_dir=tier, kv_offload_size="20GiB")
        if self.threads:
            kw["worker_threads"] = self.threads
        llm = LLM(self.model, **kw)
        if llm.scheduler.block_size != BS:
            llm.close()
            raise RuntimeError(f"block size {llm.scheduler.block_size}, the bench sizes pools for {BS}")
        # Warm-up: a prefill of a few hundred tokens and a decode step, untimed.
        llm.generate([self.tokens(min(300, max_len - 3)) for _ in range(2)], _sp(2), use_tqdm=False)
        return llm

    def tier_dir(self, name: str) -> str:
        return os.path.join(self.base, name)


def _sp(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


def timed(llm: LLM, prompts: list[list[int]], max_tokens: int) -> tuple[float, list[list[int]]]:
    """Wall seconds of one generate, and each request's output ids."""
    t = time.perf_counter()
    outs = llm.generate(prompts, _sp(max_tokens), use_tqdm=False)
    dt = time.perf_counter() - t
    ids = [list(o.outputs[0].token_ids) for o in outs]
    if any(len(i) != max_tokens for i in ids):
        raise RuntimeError(f"expected {max_tokens} tokens a request, got {[len(i) for i in ids]}")
    return dt, ids


def delta(llm: LLM, before: dict[str, Any]) -> dict[str, float]:
    now = llm.stats()
    return {k: now[k] - before.get(k, 0) for k in now if isinstance(now[k], (int, float))}


def tier_files(root: str) -> list[str]:
    """Every block file under a tier directory (its namespace subdirectories)."""
    out = []
    for ns in sorted(os.listdir(root)):
        d = os.path.join(root, ns)
        if os.path.isdir(d):
            out += [os.path.join(d, f) for f in sorted(os.listdir(d)) if not f.startswith(".")]
    return out


def drop_cache(paths: list[str]) -> None:
    os.sync()  # dirty pages written back first: DONTNEED drops only clean ones
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


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


def _abba(rounds: int, run_off, run_on, warm: bool = True) -> dict[str, Any]:
    """With ``warm`` a warm-up pair (``r`` = 0: an engine's first batch of a shape is slow),
    then ``rounds`` pairs (``r`` from 1) alternating which side goes first; each
    ``run_*(r)`` returns (seconds, stats delta). The totals' ratio off / on (> 1: the tier is
    faster)."""
    if warm:
        run_off(0)
        run_on(0)
    tot = {"off": 0.0, "on": 0.0}
    pairs = []
    st: dict[str, dict[str, float]] = {"off": {}, "on": {}}
    for r in range(1, rounds + 1):
        pair = {}
        for side in (("off", "on") if r % 2 == 1 else ("on", "off")):
            s, dl = (run_off if side == "off" else run_on)(r)
            pair[side] = s
            tot[side] += s
            for k, v in dl.items():
                st[side][k] = st[side].get(k, 0) + v
        pairs.append(round(pair["off"] / pair["on"], 4))
    return {"off_s": tot["off"], "on_s": tot["on"], "ratio": tot["off"] / tot["on"], "pair_ratios": pairs,
            "stats": st}


def _side(llm: LLM, work) -> tuple[float, dict[str, float]]:
    st = llm.stats()
    s = work(llm)
    return s, delta(llm, st)


def chat(env: Env, convs: int, ctx: int, user: int, out: int, turns: int, rounds: int) -> dict[str, Any]:
    final = ctx + turns * (user + out)
    ws = convs * blocks(final)
    nb = max(ws // 4, blocks(final) + 2)

    def work(llm: LLM, first: list[list[int]], users: list[list[list[int]]]) -> float:
        hist = [list(h) for h in first]
        t = 0.0
        for i in range(turns):
            prompts = [h + u[i] for h, u in zip(hist, users)]
            s, ids = timed(llm, prompts, out)
            t += s
            hist = [p + o for p, o in zip(prompts, ids)]
        return t

    data = [([env.tokens(ctx) for _ in range(convs)],
             [[env.tokens(user) for _ in range(turns)] for _ in range(convs)]) for _ in range(rounds + 1)]
    with env.llm(None, nb, final) as off, env.llm(env.tier_dir("chat"), nb, final) as on:
        # (no warm-up pair: a round is long, the engines' warm-up generate is enough)
        res = _abba(rounds, lambda r: _side(off, lambda llm: work(llm, *data[r])),
                    lambda r: _side(on, lambda llm: work(llm, *data[r])), warm=False)
    return {"convs": convs, "turns": turns, "working_set_blocks": ws, "pool_blocks": nb,
            "working_set_over_pool": ws / nb, **res}


def noreuse(env: Env, n: int, length: int, out: int, rounds: int) -> dict[str, Any]:
    nb = blocks(length + out) * n + 16
    data = [[env.tokens(length) for _ in range(n)] for _ in range(rounds + 1)]
    with env.llm(None, nb, length + out) as off, env.llm(env.tier_dir("noreuse"), nb, length + out) as on:
        res = _abba(rounds, lambda r: _side(off, lambda llm: timed(llm, data[r], out)[0]),
                    lambda r: _side(on, lambda llm: timed(llm, data[r], out)[0]))
    return {"requests": n, "prompt_tokens": length, "output_tokens": out, **res}


def shared(env: Env, n: int, prefix: int, suffix: int, out: int, rounds: int) -> dict[str, Any]:
    """``n`` requests at once on one ``prefix``: fresh (in no cache: the tier only saves), and
    saved to the tier by a filler engine beforehand (the tier engine loads it once)."""
    d = env.tier_dir("shared")
    nb = blocks(prefix) + n * (blocks(suffix + out) + 1) + 16
    ml = prefix + suffix + out
    stored = [env.tokens(prefix) for _ in range(rounds + 1)]
    with env.llm(d, len(stored) * blocks(prefix + 1) + 16, ml) as fill:
        timed(fill, stored, 1)
    fresh = [env.tokens(prefix) for _ in range(rounds + 1)]
    tails = [[env.tokens(suffix) for _ in range(n)] for _ in range(rounds + 1)]
    res: dict[str, Any] = {"requests": n, "prefix_tokens": prefix}
    def batch(pre: list[list[int]], r: int) -> list[list[int]]:
        return [pre[r] + t for t in tails[r]]

    with env.llm(None, nb, ml) as off, env.llm(d, nb, ml) as on:
        res["fresh"] = _abba(rounds, lambda r: _side(off, lambda llm: timed(llm, batch(fresh, r), out)[0]),
                             lambda r: _side(on, lambda llm: timed(llm, batch(fresh, r), out)[0]))
        res["in_tier"] = _abba(rounds, lambda r: _side(off, lambda llm: timed(llm, batch(stored, r), out)[0]),
                               lambda r: _side(on, lambda llm: timed(llm, batch(stored, r), out)[0]))
    return res
