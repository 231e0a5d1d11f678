"""`pipeline bench tp`: tensor parallelism on CPU over gloo at each ``--tp-sizes`` (default 1
and 2), in the same run: the step time of decode at batch 1, 8, 32 and of one prefill step,
its ratio against the first size (TP=1), and the share of a step that rank 0 spends inside
the collectives (the all-reduces after o and down and of the embedding, the logits
all-gather; the token broadcast too, though greedy steps have none).

Every size's ranks run at once, one process each (a fixed team of ``--threads``), and take
turns window by window, so a machine whose speed drifts (a shared VM) weighs on all sizes
alike. The parent sends each command to every rank of a size; each rank runs the same
deterministic steps (``bench.steps.Steps``, same seed, same order), timing the window and
the seconds inside ``runner.tp``'s collectives (wrappers set on that instance, which the
model shares). Rank 0's figures are the answer, plus the least share of any rank (the rank
that arrives last waits least: nearest to the transfer itself). A failed or dead rank fails
the bench with its error; nothing waits without a deadline.

Owns nothing beyond the run: per size a ``RankGroup`` (its processes, and the instance their
KV segments live under: gone after close(), even a killed rank's).
"""
from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import queue
import socket
import tempfile
import time
import traceback
from collections.abc import Callable
from typing import Any

from pipeline.bench.report import Report
from pipeline.bench.steps import Steps
from pipeline.bench.worker import PROMPT_LEN, bench_model

CTX = mp.get_context("spawn")  # a fresh interpreter per rank: no inherited torch or threads
COLLECTIVES = ("all_reduce", "all_gather_cols", "broadcast")
N_PREFILL_SEQS = 4
Window = tuple[float, float, int]  # seconds, seconds in collectives, collective calls


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="", help="checkpoint dir; default: make a 25.7M-param llama")
    p.add_argument("--batch-sizes", default="1,8,32")
    p.add_argument("--decode-steps", type=int, default=16, help="decode steps per timed window")
    p.add_argument("--repeats", type=int, default=3,
                   help="timed windows per figure; the fastest counts (robust to a busy machine)")
    p.add_argument("--prefill-tokens", type=int, default=512,
                   help=f"tokens in the prefill step ({N_PREFILL_SEQS} sequences)")
    p.add_argument("--tp-sizes", default="1,2", help="tensor-parallel sizes; the first is the baseline")
    p.add_argument("--threads", type=int, default=0, help="torch threads per rank; 0: cores // size")
    p.add_argument("--timeout", type=float, default=600.0,
                   help="seconds the ranks may take to load, or to answer one command")


class _RankSteps:
    """A rank's side: the step recipe, one command at a time (``admit``, ``window``,
    ``finish``, ``prefill``), and the clock of its collectives."""

    def __init__(self, runner: Any, spec: dict) -> None:
        import numpy as np
        self.spec, self.steps = spec, Steps(runner)
        self.rng = np.random.default_rng(0)  # the same prompts on every rank
        self.ids: list[str] = []
        self.computed = 0
        self.coll_s, self.coll_calls = 0.0, 0
        for name in COLLECTIVES if runner.tp is not None else ():
            setattr(runner.tp, name, self._clocked(getattr(runner.tp, name)))

    def _clocked(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        def wrapper(*a: Any, **kw: Any) -> Any:
            t = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                self.coll_s += time.perf_counter() - t
                self.coll_calls += 1
        return wrapper

    def _timed(self, fn: Callable[[], object]) -> Window:
        c0, n0, t = self.coll_s, self.coll_calls, time.perf_counter()
        fn()
        return time.perf_counter() - t, self.coll_s - c0, self.coll_calls - n0

    def admit(self, b: int) -> None:
        """Batch ``b`` decoding, warmed up by two steps."""
        prompts = self.rng.integers(3, self.spec["vocab"], (b, PROMPT_LEN)).tolist()
        extra = self.spec["repeats"] * self.spec["decode_steps"] + 2
        self.ids, self.computed = self.steps.admit(prompts, extra, f"d{b}-")[1], PROMPT_LEN
        self.window(2)

    def window(self, n: int) -> Window:
        def run() -> None:
            for i in range(n):
                self.steps.decode(self.ids, self.computed + i)
        out = self._timed(run)
        self.computed += n
        return out

    def finish(self) -> None:
        self.steps.finish(self.ids)

    def prefill(self, rep: int) -> Window:
        prompts = self.rng.integers(3, self.spec["vocab"], (N_PREFILL_SEQS, self.spec["plen"])).tolist()
        ids: list[str] = []
        out = self._timed(lambda: ids.extend(self.steps.admit(prompts, 1, f"p{rep}-")[1]))
        self.steps.finish(ids)
        return out


def _rank_main(rank: int, spec: dict, cmds: Any, results: Any) -> None:
    """One rank's process: load its shard, say so, run commands until None; or report its error."""
    runner = None
    try:
        from pipeline.config import EngineConfig
        from pipeline.worker.model_runner import ModelRunner
        max_b = max(spec["batches"])
        decode_blocks = max_b * -(-(PROMPT_LEN + spec["repeats"] * spec["decode_steps"] + 4) // 16)
        runner = ModelRunner(EngineConfig.of(
            model=spec["model"], device="cpu", dtype="float32", block_size=16,
            max_num_seqs=max(max_b, N_PREFILL_SEQS), max_model_len=spec["max_len"],
            num_blocks=max(decode_blocks, N_PREFILL_SEQS * -(-(spec["plen"] + 2) // 16)) + 8,
            max_num_batched_tokens=max(spec["prefill_tokens"], 256),
            tensor_parallel_size=spec["size"], master_port=spec["port"],
            worker_threads=spec["threads"], instance_id=spec["instance_id"]), rank)
        runner.load()
        steps = _RankSteps(runner, spec)
        results.put(("ok", rank, None))
        while (cmd := cmds.get()) is not None:
            results.put(("ok", rank, getattr(steps, cmd[0])(*cmd[1:])))
    except BaseException:  # noqa: BLE001 - reported to the parent, which fails the bench
        results.put(("error", rank, traceback.format_exc()))
    finally:
        if runner is not None:
            runner.close()


class RankGroup:
    """The rank processes of one TP size. ``call`` returns every rank's answer in rank order,
    or raises RuntimeError naming the rank that failed (and any that died without a word: the
    usual cause of the others' failures) or did not answer within ``timeout``."""

    def __init__(self, spec: dict, timeout: float) -> None:
        from pipeline.ipc.instance import Instance
        self.size, self.timeout = spec["size"], timeout
        self.inst = Instance()  # the ranks' KV caches join it as views
        with socket.socket() as sock:  # the group's rendezvous port
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        spec = {**spec, "port": port, "instance_id": self.inst.id}
        self.results = CTX.Queue()
        self.cmds = [CTX.Queue() for _ in range(self.size)]
        self.procs = [CTX.Process(target=_rank_main, args=(r, spec, self.cmds[r], self.results),
                                  daemon=True, name=f"bench-tp{self.size}-rank{r}")
                      for r in range(self.size)]
        for p in self.procs:
            p.start()

    def _dead(self, got: dict) -> str:
        gone = [f"rank {r} exited with code {p.exitcode} without a report"
                for r, p in enumerate(self.procs) if r not in got and p.exitcode is not None]
        return f" ({'; '.join(gone)})" if gone else ""

    def call(self, *cmd: object) -> list:
        """Run ``cmd`` on every rank (no command: wait until they have loaded)."""
        for q in self.cmds if cmd else ():
            q.put(cmd)
        got: dict[int, Any] = {}
        deadline, dead_since = time.monotonic() + self.timeout, 0.0
        while len(got) < self.size:
            try:
                status, rank, payload = self.results.get(timeout=0.5)
            except queue.Empty:
                if self._dead(got):  # a report already on its way gets two seconds
                    dead_since = dead_since or time.monotonic()
                    if time.monotonic() - dead_since > 2.0:
                        raise RuntimeError(f"bench tp: a rank of {self.size} died{self._dead(got)}") from None
                elif time.monotonic() > deadline:
                    raise RuntimeError(f"bench tp: the {self.size} rank(s) did not answer "
                                       f"{cmd or 'load'} within --timeout {self.timeout:.0f} s") from None
                continue
            if status != "ok":
                raise RuntimeError(f"bench tp: rank {rank} of {self.size} failed{self._dead(got)}:\n{payload}")
            got[rank] = payload
        return [got[r] for r in range(self.size)]

    def close(self) -> None:
        from pipeline.ipc.instance import unlink_instance
        for q in self.cmds:
            q.put(None)
        for p in self.procs:
            p.join(timeout=10)
            if p.is_alive():  # a peer of a failed rank, stuck in a collective
                p.terminate()
                p.join(timeout=5)
            if p.is_alive():
                p.kill()
                p.join()
        unlink_instance(self.inst.id)  # what a killed rank left
        self.inst.cleanup()


def _best(windows: list[list[Window]], per: int = 1) -> list[tuple[float, float, float]]:
    """Every rank's figures (per step: divided by ``per``) in the window rank 0 ran fastest."""
    return [(t / per, c / per, n / per) for t, c, n in min(windows, key=lambda w: w[0][0])]


def _drive(groups: dict[int, RankGroup], batches: list[int], repeats: int, steps: int) -> dict:
    """Per size: {"decode": {batch: per rank (step s, collective s, calls)}, "prefill": per
    rank (s, collective s, calls)}, the sizes taking turns window by window."""
    for g in groups.values():
        g.call()
    out: dict[int, dict] = {n: {"decode": {}} for n in groups}
    for b in batches:
        wins: dict[int, list] = {n: [] for n in groups}
        for g in groups.values():
            g.call("admit", b)
        for _ in range(repeats):
            for n, g in groups.items():
                wins[n].append(g.call("window", steps))
        for n, g in groups.items():
            g.call("finish")
            out[n]["decode"][b] = _best(wins[n], steps)
    wins = {n: [] for n in groups}
    for rep in range(-1, repeats):  # -1: warm-up (the first step of this shape)
        for n, g in groups.items():
            w = g.call("prefill", rep)
            if rep >= 0:
                wins[n].append(w)
    for n in groups:
        out[n]["prefill"] = _best(wins[n])
    return out


def _ints(flag: str, text: str) -> list[int]:
    try:
        vals = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        vals = []
    if not vals or min(vals) < 1:
        raise SystemExit(f"{flag} must be a comma-separated list of integers >= 1, got {text!r}")
    return vals


def main(args: argparse.Namespace) -> int:
    from pipeline.models.config import load_model_config
    from pipeline.models.parallel import TPShard
    batches, sizes = _ints("--batch-sizes", args.batch_sizes), _ints("--tp-sizes", args.tp_sizes)
    for flag, value, least in (("--decode-steps", args.decode_steps, 1), ("--repeats", args.repeats, 1),
                               ("--prefill-tokens", args.prefill_tokens, N_PREFILL_SEQS),
                               ("--threads", args.threads, 0), ("--timeout", args.timeout, 1)):
        if value < least:
            raise SystemExit(f"{flag} must be >= {least}, got {value}")
    cores, rep = len(os.sched_getaffinity(0)), Report("tp")
    plen = args.prefill_tokens // N_PREFILL_SEQS
    with tempfile.TemporaryDirectory(prefix="pipeline-bench-tp-") as tmp:
        model_dir, vocab = bench_model(args.model, tmp)
        mc = load_model_config(model_dir)
        for n in (n for n in sizes if n > 1):
            try:
                TPShard.of(mc, 0, n)
            except ValueError as exc:
                raise SystemExit(f"--tp-sizes: {exc}") from None
        # the longest sequence: a decode request's, or a prefill one's and its sampled token
        max_len = max(PROMPT_LEN + args.repeats * args.decode_steps + 4, plen + 2)
        if max_len > mc.max_position_embeddings:
            raise SystemExit(f"--decode-steps x --repeats or --prefill-tokens / {N_PREFILL_SEQS} make "
                             f"{max_len}-token sequences; the checkpoint's max_position_embeddings "
                             f"is {mc.max_position_embeddings}")
        spec = {"model": model_dir, "max_len": max_len, "vocab": vocab, "batches": batches,
                "repeats": args.repeats, "decode_steps": args.decode_steps,
                "prefill_tokens": args.prefill_tokens, "plen": plen}
        groups: dict[int, RankGroup] = {}
        try:
            for n in sizes:
                threads = args.threads or max(1, cores // n)
                rep.machine[f"threads_per_rank_tp{n}"] = threads
                groups[n] = RankGroup({**spec, "size": n, "threads": threads}, args.timeout)
            figs = _drive(groups, batches, args.repeats, args.decode_steps)
        except RuntimeError as exc:  # a rank's own traceback is in the message
            raise SystemExit(str(exc)) from None
        finally:
            for g in groups.values():
                g.close()
    rep.machine.update(loadavg_1m=round(os.getloadavg()[0], 2), hidden_size=mc.hidden_size,
                       num_layers=mc.num_layers, vocab_size=mc.vocab_size)
    base = sizes[0]
    for b in [*batches, None]:  # None: the prefill step
        row: dict[str, float] = {}
        per_rank = {n: figs[n]["decode"][b] if b else figs[n]["prefill"] for n in sizes}
        for n in sizes:
            step, coll, calls = per_rank[n][0]  # rank 0's
            row[f"step_ms_tp{n}"] = step * 1e3
            if n != base:
                row[f"speedup_tp{n}"] = per_rank[base][0][0] / step
            row[f"collective_share_tp{n}"] = coll / step
            if n > 1:  # what the shards' compute alone would give: the step less its collectives
                row[f"speedup_excl_collectives_tp{n}"] = per_rank[base][0][0] / (step - coll)
                row[f"min_rank_share_tp{n}"] = min(c / s for s, c, _ in per_rank[n])
                row[f"collectives_per_step_tp{n}"] = calls
        if b:
            rep.add(f"decode batch {b}", **row)
        else:
            rep.add(f"prefill {args.prefill_tokens} tokens ({N_PREFILL_SEQS} seqs)", **row,
                    **{f"tok_s_tp{n}": N_PREFILL_SEQS * plen / per_rank[n][0][0] for n in sizes})
    return rep.emit(args.json)
