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
        llm.generate([self.tokens(2 * BS + 3)], _sp(2), use_tqdm=False)  # warm-up
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
    preallocated buffer, close): what a load is set against."""
    size = max(os.path.getsize(p) for p in paths)
    mv = memoryview(bytearray(size))
    n = 0
    t = time.perf_counter()
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            n += os.readv(fd, [mv])
        finally:
            os.close(fd)
    return n, time.perf_counter() - t


def ttft(env: Env, prefix: int, suffix: int, rounds: int) -> dict[str, Any]:
    d = env.tier_dir("ttft")
    nb, ml = 2 * blocks(prefix + suffix + 1) + 8, prefix + suffix + 1
    prefixes = [env.tokens(prefix) for _ in range(2 * rounds)]
    with env.llm(d, nb, ml) as fill:
        timed(fill, prefixes, 1)
    files = tier_files(d)
    res: dict[str, Any] = {"prefix_tokens": prefix, "suffix_tokens": suffix, "files": len(files)}
    with env.llm(None, nb, ml) as off, env.llm(d, nb, ml) as on:
        plain_read(files)  # the fill's files warm, whatever ran since
        for mode, half in (("warm", prefixes[:rounds]), ("cold", prefixes[rounds:])):
            t_on = t_off = 0.0
            st = on.stats()
            for p in half:
                prompt = p + env.tokens(suffix)
                if mode == "cold":
                    drop_cache(files)
                t_on += timed(on, [prompt], 1)[0]
                t_off += timed(off, [prompt], 1)[0]
            dl = delta(on, st)
            if dl["kv_tier_loaded_tokens"] != len(half) * BS * (prefix // BS):
                raise RuntimeError(f"{mode}: {dl['kv_tier_loaded_tokens']} tokens loaded from the tier, "
                                   f"expected {len(half) * BS * (prefix // BS)}")
            res[f"{mode}_ttft_on_ms"] = 1e3 * t_on / len(half)
            res[f"{mode}_ttft_off_ms"] = 1e3 * t_off / len(half)
            res[f"{mode}_ttft_ratio"] = t_off / t_on
            res[f"{mode}_load_GBps"] = dl["kv_tier_load_bytes"] / dl["kv_tier_load_seconds"] / 1e9
            res[f"{mode}_load_wait_ms"] = 1e3 * dl["kv_tier_load_wait_seconds"] / dl["kv_tier_load_waits"]
    plain_read(files)
    for mode in ("warm", "cold"):
        if mode == "cold":
            drop_cache(files)
        n, s = plain_read(files)
        res[f"{mode}_plain_GBps"] = n / s / 1e9
        res[f"{mode}_bw_ratio"] = res[f"{mode}_load_GBps"] / res[f"{mode}_plain_GBps"]
    return res


def _abba(rounds: int, run_off, run_on) -> dict[str, Any]:
    """``rounds`` pairs, alternating which side goes first; each ``run_*(r)`` returns
    (seconds, stats delta). The totals' ratio off / on (> 1: the tier is faster)."""
    tot = {"off": 0.0, "on": 0.0}
    pairs = []
    st: dict[str, dict[str, float]] = {"off": {}, "on": {}}
    for r in range(rounds):
        pair = {}
        for side in (("off", "on") if r % 2 == 0 else ("on", "off")):
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
             [[env.tokens(user) for _ in range(turns)] for _ in range(convs)]) for _ in range(rounds)]
    with env.llm(None, nb, final) as off, env.llm(env.tier_dir("chat"), nb, final) as on:
        res = _abba(rounds, lambda r: _side(off, lambda llm: work(llm, *data[r])),
                    lambda r: _side(on, lambda llm: work(llm, *data[r])))
    tokens = rounds * convs * turns * (user + out) + rounds * convs * ctx
    return {"convs": convs, "turns": turns, "working_set_blocks": ws, "pool_blocks": nb,
            "working_set_over_pool": ws / nb, "prompt_and_output_tokens": tokens // rounds, **res}


def noreuse(env: Env, n: int, length: int, out: int, rounds: int) -> dict[str, Any]:
    nb = blocks(length + out) * n + 16
    data = [[env.tokens(length) for _ in range(n)] for _ in range(rounds)]
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
    stored = [env.tokens(prefix) for _ in range(rounds)]
    with env.llm(d, nb, ml) as fill:
        timed(fill, stored, 1)
    fresh = [env.tokens(prefix) for _ in range(rounds)]
    tails = [[env.tokens(suffix) for _ in range(n)] for _ in range(rounds)]
    res: dict[str, Any] = {"requests": n, "prefix_tokens": prefix}
    with env.llm(None, nb, ml) as off, env.llm(d, nb, ml) as on:
        for name, pre in (("fresh", fresh), ("in_tier", stored)):
            res[name] = _abba(
                rounds, lambda r: _side(off, lambda llm: timed(llm, [pre[r] + t for t in tails[r]], out)[0]),
                lambda r: _side(on, lambda llm: timed(llm, [pre[r] + t for t in tails[r]], out)[0]))
    return res
