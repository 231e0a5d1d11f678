"""`pipeline bench kvtier`'s workloads: each one on in-process ``LLM``s with the KV disk tier
on and off, the same token-id prompts on both, greedy, ``ignore_eos`` (every request makes
exactly its tokens), prefix caching on everywhere, one warm-up generate per engine before
anything is timed. (TTFT and load bandwidth: ``kvtier_ttft``.)

- ``chat``: conversations that come back turn after turn, their histories 4x the pool.
- ``noreuse``: fresh prompts, nothing to hit; the tier's cost alone (its write-through saves).
- ``shared``: requests at once on one long prefix, computed fresh, and found in the tier.
Pairs of runs alternate ABBA (off, on, on, off, ...): the figure is the median of the pairs'
ratios (``_abba``). Owns: the engines of one workload (closed at its end) and its tier directory under ``base``.
"""
from __future__ import annotations

import os
import random
import resource
import statistics
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


def _abba(pairs: int, run_off, run_on, warm: bool = True) -> dict[str, Any]:
    """With ``warm`` a warm-up pair (``r`` = 0: an engine's first batch of a shape is slow),
    then ``pairs`` pairs (``r`` from 1) alternating which side goes first (off on, on off,
    ...); ``run_*(r)`` returns wall seconds. The figure is the median of the pairs' ratios
    off / on (> 1: the tier is faster): on 2 vCPUs shared with other work one burst of
    load moves a total, a median of pairs much less. Beside it, the ratio of the process's
    CPU seconds (every thread: the engine's, the worker's, the tier's; one side runs at a
    time), what the tier costs in work whatever else the machine runs."""
    if warm:
        run_off(0)
        run_on(0)
    wall = {"off": 0.0, "on": 0.0}
    cpu = {"off": 0.0, "on": 0.0}
    ratios = []
    for r in range(1, pairs + 1):
        pair = {}
        for side in (("off", "on") if r % 2 == 1 else ("on", "off")):
            c0 = _cpu_s()
            s = (run_off if side == "off" else run_on)(r)
            cpu[side] += _cpu_s() - c0
            pair[side] = s
            wall[side] += s
        ratios.append(round(pair["off"] / pair["on"], 4))
    return {"off_s": wall["off"], "on_s": wall["on"], "ratio": statistics.median(ratios),
            "total_ratio": wall["off"] / wall["on"], "pair_ratios": ratios,
            "off_cpu_s": cpu["off"], "on_cpu_s": cpu["on"], "cpu_ratio": cpu["off"] / cpu["on"]}


def _cpu_s() -> float:
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime


def _sides(off: LLM, on: LLM, work) -> tuple[Any, Any, dict[str, dict[str, float]]]:
    """``run_off``, ``run_on`` for _abba (``work(llm, r)`` -> seconds) and the engines'
    stats deltas over the timed runs, filled in as they go."""
    st: dict[str, dict[str, float]] = {"off": {}, "on": {}}

    def side(name: str, llm: LLM):
        def run(r: int) -> float:
            before = llm.stats()
            s = work(llm, r)
            for k, v in delta(llm, before).items() if r else ():  # (not the warm-up's)
                st[name][k] = st[name].get(k, 0) + v
            return s
        return run
    return side("off", off), side("on", on), st


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
        run_off, run_on, st = _sides(off, on, lambda llm, r: work(llm, *data[r]))
        # (no warm-up pair: a round is long, the engines' warm-up generate is enough)
        res = _abba(rounds, run_off, run_on, warm=False)
    return {"convs": convs, "turns": turns, "working_set_blocks": ws, "pool_blocks": nb,
            "working_set_over_pool": ws / nb, "stats": st, **res}


def noreuse(env: Env, n: int, length: int, out: int, pairs: int) -> dict[str, Any]:
    nb = blocks(length + out) * n + 16
    data = [[env.tokens(length) for _ in range(n)] for _ in range(pairs + 1)]
    with env.llm(None, nb, length + out) as off, env.llm(env.tier_dir("noreuse"), nb, length + out) as on:
        run_off, run_on, st = _sides(off, on, lambda llm, r: timed(llm, data[r], out)[0])
        res = _abba(pairs, run_off, run_on)
    return {"requests": n, "prompt_tokens": length, "output_tokens": out, "stats": st, **res}


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
        for name, pre in (("fresh", fresh), ("in_tier", stored)):
            run_off, run_on, st = _sides(off, on, lambda llm, r, pre=pre: timed(llm, batch(pre, r), out)[0])
            res[name] = dict(_abba(rounds, run_off, run_on), stats=st)
    return res
