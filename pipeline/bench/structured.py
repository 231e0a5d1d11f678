"""`pipeline bench structured`: what a grammar costs a decode step, and compiling one costs
(issue 14).

Decode: ``--batch`` requests under a JSON schema (nested object, enums, integer ranges, a
pattern, arrays with maxItems, optional fields) against the same prompts free; greedy and
``ignore_eos`` both. Each batch has its own ModelRunner (the worker's plain-argmax shortcut
holds only while no resident row needs the sampler: free rows beside constrained ones would
pay for them). Timed windows alternate between the two (a VM's drifting speed weighs on both
alike) and each keeps its best; the constrained one only among windows that ended with every
answer unfinished (a finished answer's mask is the stop row, cheaper than a live grammar's),
so ``--rounds`` admit both batches afresh (answers run ~120-170 tokens; the grammar then comes
from the cache). Target: constrained/free <= 1.15. The constrained step's parts (waiting for
the pool's bitmasks, ``apply_masks``, ``accept``, the fill overlapping the forward) are timed
by wrapping the worker's own methods. Each round the answers then run to their end, untimed,
and every output replays on a fresh matcher (the free ones too, which must fail it).

Compile: xgrammar's import and tokenizer info once (the first structured request of a process
pays them), then p50 of ``--compile-schemas`` distinct schemas (a field name and an enum vary:
cache misses) and of the same again (hits); CPU-side latencies in ms.

Owns nothing; drives ModelRunners with hand-built SchedulerOutputs, as `bench worker` does.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import msgspec
import numpy as np

from pipeline.bench.report import Report
from pipeline.config import DEFAULT_MODEL, EngineConfig
from pipeline.messages import CachedRequestData, NewRequestData, SchedulerOutput, ids_to_bytes
from pipeline.sampling_params import SamplingParams
from pipeline.sampling_params.structured import StructuredOutputsParams

_clock = time.perf_counter


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=DEFAULT_MODEL, help="checkpoint dir (needs tokenizer.json)")
    p.add_argument("--batch", type=int, default=32, help="requests in each batch")
    p.add_argument("--prompt-len", type=int, default=16)
    p.add_argument("--decode-steps", type=int, default=8, help="decode steps per timed window")
    p.add_argument("--windows", type=int, default=6,
                   help="timed windows per batch and round, alternating; the best counts")
    p.add_argument("--rounds", type=int, default=4, help="admissions of both batches")
    p.add_argument("--compile-schemas", type=int, default=20,
                   help="distinct schemas compiled for the compile-time p50")
    p.add_argument("--threads", type=int, default=0,
                   help="worker threads of both runners; 0: the worker's default (adaptive team)")


def schema(i: int = 0) -> dict:
    """A user record whose answers run past 100 tokens (so the timed steps mask live
    grammars); ``i`` renames one field and changes an enum, so each ``i`` is a new spec."""
    return {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 16},
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
            "role": {"enum": ["admin", "user", "guest", f"role{i}"]},
            "email": {"type": "string", "pattern": "^[a-z]{1,12}@[a-z]{1,12}\\.(com|org|net)$"},
            "bio": {"type": "string", "maxLength": 48},
            "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 3},
            "scores": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 100},
                       "maxItems": 4},
            "address": {"type": "object",
                        "properties": {"city": {"type": "string", "maxLength": 16},
                                       "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                        "required": ["city"]},
            f"active{i}": {"type": "boolean"},
        },
        "required": ["name", "age", "role", "email", "bio", "address"],
    }


class _Batch:
    """One ModelRunner decoding one batch: all blocks reserved at admission."""

    def __init__(self, runner, prompts: list[list[int]], seq_len: int, params: SamplingParams,
                 tag: str, step_id: int = 0) -> None:
        self.runner, self.step_id = runner, step_id
        bs = runner.block_size
        self.ids = [f"{tag}-{i}" for i in range(len(prompts))]
        new, nb = [], -(-seq_len // bs)
        for i, (rid, p) in enumerate(zip(self.ids, prompts, strict=True)):
            new.append(NewRequestData(rid, ids_to_bytes(p), len(p), params,
                                      list(range(i * nb, (i + 1) * nb)), 0))
        self.computed = len(prompts[0])
        self._run(new, [], {r: len(p) for r, p in zip(self.ids, prompts, strict=True)})

    def _run(self, new, cached, sched, finished=()) -> None:
        self.step_id += 1
        self.runner.execute(SchedulerOutput(self.step_id, new, cached, sched, sum(sched.values()),
                                            list(finished), []))

    def decode(self, steps: int) -> float:
        t = _clock()
        for _ in range(steps):
            self._run([], [CachedRequestData(r, [], self.computed) for r in self.ids],
                      dict.fromkeys(self.ids, 1))
            self.computed += 1
        return _clock() - t

    def outputs(self) -> list[list[int]]:
        b = self.runner.batch
        rows = [b.index[r] for r in self.ids]
        return [b.token_ids[i, int(b.num_prompt_tokens[i]):int(b.num_tokens[i])].tolist() for i in rows]

    def finish(self) -> int:
        """Drop the requests (their blocks are free for the next round); the next step id."""
        self._run([], [], {}, self.ids)
        return self.step_id


class _Timed:
    """Seconds spent in a StructuredBatch's ``apply_masks`` (of it: waiting for the pool's
    bitmasks), ``accept`` and, in the pool, ``_fill``: its own methods, wrapped."""

    def __init__(self, so) -> None:
        self.s = dict.fromkeys(("wait", "apply", "accept", "fill"), 0.0)
        apply = so.apply_masks

        def wait_then_apply(logits):
            if so._masks is not None:  # the wait; apply_masks' own result() then returns at once
                self._time("wait", so._masks.result)
            apply(logits)

        so.apply_masks = lambda logits: self._time("apply", wait_then_apply, logits)
        for part, fn in (("accept", so.accept), ("fill", so._fill)):
            setattr(so, "_fill" if part == "fill" else part,
                    lambda *a, part=part, fn=fn: self._time(part, fn, *a))

    def _time(self, part: str, fn, *args):
        t = _clock()
        try:
            return fn(*args)
        finally:
            self.s[part] += _clock() - t

    def reset(self) -> None:
        self.s = dict.fromkeys(self.s, 0.0)


def check_outputs(grammars, so: StructuredOutputsParams, outputs: list[list[int]],
                  stop: set[int], decode) -> tuple[int, int]:
    """(outputs a fresh matcher accepts token by token, with only stop tokens after the
    answer ends; of them, complete answers that parse as JSON with every required field)."""
    compiled = grammars.compile(so)
    required = set(schema()["required"]) if so.kind == "json" else set()
    valid = complete = 0
    for out in outputs:
        m = grammars.matcher(compiled)
        ok = True
        for i, t in enumerate(out):
            if m.is_terminated():
                ok = all(x in stop for x in out[i:])
                break
            if not m.accept_token(t):
                ok = False
                break
        valid += ok
        if ok and m.is_terminated():
            text = decode([t for t in out if t not in stop])
            try:
                obj = json.loads(text)
            except ValueError:
                continue
            complete += isinstance(obj, dict) and required <= obj.keys()
    return valid, complete


def bench_decode(model: str, batch: int, prompt_len: int, steps: int, windows: int, rounds: int,
                 threads: int = 0, finish: int = 384) -> dict:
    """Step times of the two batches (best window each), the constrained step's parts (s per
    step, in its best window), and the outputs' check (after up to ``finish`` untimed steps
    more in each round)."""
    from tokenizers import Tokenizer

    from pipeline.worker.model_runner import ModelRunner
    so = StructuredOutputsParams(json=schema())
    seq_len = 16 * -(-(prompt_len + (windows + 1) * steps + finish + 1) // 16)  # whole blocks
    cfg = EngineConfig.of(model=model, device="cpu", block_size=16, max_num_seqs=batch,
                       max_model_len=seq_len, num_blocks=batch * seq_len // 16 + 8,
                       max_num_batched_tokens=max(batch * prompt_len, 256), worker_threads=threads)
    runners = {k: ModelRunner(cfg) for k in ("free", "json")}
    try:
        for r in runners.values():
            r.load()
        structured = runners["json"].structured
        assert structured is not None  # rank 0
        timed = _Timed(structured)
        tok = Tokenizer.from_file(os.path.join(model, "tokenizer.json"))
        stop = set(runners["json"].eos_token_ids)
        vocab = min(runners["json"].vocab_size, 512)
        rng = np.random.default_rng(0)
        free = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=seq_len)
        params = {"free": free, "json": msgspec.structs.replace(free, structured_outputs=so)}
        best = dict.fromkeys(runners, float("inf"))
        team = dict.fromkeys(runners, threads)  # the worker's team in the best window
        parts: dict[str, float] = {}
        live_windows = 0
        checked = {k: [0, 0] for k in runners}
        step_ids = dict.fromkeys(runners, 0)

        def live() -> int:
            return sum(not f.result().is_terminated() for f in structured._matchers.values())

        for rnd in range(rounds):
            prompts = rng.integers(3, vocab, (batch, prompt_len)).tolist()
            batches = {k: _Batch(runners[k], prompts, seq_len, params[k], f"{k}{rnd}", step_ids[k])
                       for k in runners}
            for b in batches.values():
                b.decode(steps)  # warm-up (first round: xgrammar loads, the grammar compiles)
            for w in range(windows):
                for k in (("free", "json") if (rnd + w) % 2 == 0 else ("json", "free")):
                    timed.reset()
                    dt = batches[k].decode(steps)
                    if k == "json":
                        if live() < batch:
                            continue  # some answers ended: their masks are the stop row, cheaper
                        live_windows += 1
                    if dt < best[k]:
                        best[k] = dt
                        gov = runners[k].thread_governor
                        team[k] = gov.threads if gov is not None else threads
                        if k == "json":
                            parts = {p: v / steps for p, v in timed.s.items()}
            for _ in range(finish):  # untimed: let the answers end, to check them whole
                if not live():
                    break
                batches["json"].decode(1)
            assert structured._grammars is not None  # loaded by the first constrained request
            grammars = structured._grammars.result()
            for k, b in batches.items():
                valid, complete = check_outputs(grammars, so, b.outputs(), stop, tok.decode)
                checked[k][0] += valid
                checked[k][1] += complete
                step_ids[k] = b.finish()
        if not live_windows:
            raise SystemExit("every timed window ended with some answers complete; lower "
                             "--decode-steps or --windows")
        json_step = best["json"] / steps
        return {"free_step_s": best["free"] / steps, "json_step_s": json_step,
                "ratio": best["json"] / best["free"], "parts_s": parts,
                "parts": {k: v / json_step for k, v in parts.items()}, "threads": team,
                "live_windows": live_windows, "windows": windows * rounds,
                "json_valid": checked["json"][0], "json_complete": checked["json"][1],
                "free_valid": checked["free"][0], "dtype": str(runners["json"].dtype).split(".")[-1]}
    finally:
        for r in runners.values():
            r.close()


def bench_compile(model: str, n: int) -> dict:
    """xgrammar's import and tokenizer info (once), then the p50 of ``n`` cache misses and
    of their hits, in ms."""
    import torch  # noqa: F401  (the worker has imported it before its first grammar)

    from pipeline.models.config import load_model_config
    mc = load_model_config(model)
    fresh = "xgrammar" not in sys.modules
    t = _clock()
    import xgrammar  # noqa: F401
    import_s = _clock() - t
    from pipeline.structured_outputs import Grammars
    t = _clock()
    g = Grammars(model, mc.vocab_size, list(mc.eos_token_ids))
    info_s = _clock() - t
    specs = [StructuredOutputsParams(json=schema(1000 + i)) for i in range(n)]
    miss, hit = [], []
    for so in specs:
        t = _clock()
        g.compile(so)
        miss.append(_clock() - t)
    for so in specs:
        t = _clock()
        g.compile(so)
        hit.append(_clock() - t)
    return {"import_ms": import_s * 1e3 if fresh else None, "tokenizer_info_ms": info_s * 1e3,
            "compile_p50_ms": statistics.median(miss) * 1e3, "compile_max_ms": max(miss) * 1e3,
            "hit_p50_ms": statistics.median(hit) * 1e3}


def main(args: argparse.Namespace) -> int:
    for name in ("batch", "prompt_len", "decode_steps", "windows", "rounds", "compile_schemas"):
        if getattr(args, name) < 1:
            raise SystemExit(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if not os.path.isfile(os.path.join(args.model, "tokenizer.json")):
        raise SystemExit(f"--model: {args.model} has no tokenizer.json (grammars need it)")
    comp = bench_compile(args.model, args.compile_schemas)  # first: xgrammar not yet imported
    dec = bench_decode(args.model, args.batch, args.prompt_len, args.decode_steps, args.windows,
                       args.rounds, args.threads)
    from pipeline.worker.device import worker_threads
    rep = Report("structured")
    rep.machine.update(model=args.model, dtype=dec["dtype"], worker_threads=worker_threads() or "adaptive",
                       loadavg_1m=round(os.getloadavg()[0], 2))
    b, ms = args.batch, 1e3
    # threads: the worker's team in the best window (each runner's governor adapts alone)
    rep.add(f"decode batch {b} free", step_ms=dec["free_step_s"] * ms, threads=dec["threads"]["free"])
    rep.add(f"decode batch {b} json schema", step_ms=dec["json_step_s"] * ms, vs_free=dec["ratio"],
            threads=dec["threads"]["json"], live_windows=f"{dec['live_windows']}/{dec['windows']}")
    for part, what in (("wait", "waiting for the masks"), ("apply", "apply_masks (wait + kernel)"),
                       ("accept", "accept (matchers advance)"),
                       ("fill", "bitmask fill in the pool (overlaps the forward)")):
        rep.add(f"  json step: {what}", step_ms=dec["parts_s"][part] * ms, share=dec["parts"][part])
    n = b * args.rounds
    rep.add("outputs matching the json schema", json=dec["json_valid"], json_complete=dec["json_complete"],
            free=dec["free_valid"], of=n)
    if comp["import_ms"] is not None:
        rep.add("xgrammar import (once per process)", ms=comp["import_ms"])
    rep.add("tokenizer info (once per model)", ms=comp["tokenizer_info_ms"])
    rep.add(f"compile json schema (p50 of {args.compile_schemas} misses)", ms=comp["compile_p50_ms"],
            max_ms=comp["compile_max_ms"])
    rep.add("compile json schema (cache hit p50)", ms=comp["hit_p50_ms"])
    r = dec["ratio"]
    rep.target(f"batch-{b} json-schema decode step vs free", round(r, 3), "<= 1.15x", r <= 1.15)
    rep.target("constrained outputs matching their grammar", dec["json_valid"], f"== {n}",
               dec["json_valid"] == n)
    return rep.emit(args.json)
