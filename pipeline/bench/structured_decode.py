"""`pipeline bench structured`, its decode part: what a grammar costs a decode step (issue 14).

``--batch`` requests under a JSON schema (`schema`: nested object, enums, integer ranges, a
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

Owns nothing; drives ModelRunners with hand-built SchedulerOutputs, as `bench worker` does.
"""
from __future__ import annotations

import json
import os
import time

import msgspec
import numpy as np

from pipeline.config import EngineConfig
from pipeline.messages import CachedRequestData, NewRequestData, SchedulerOutput, ids_to_bytes
from pipeline.sampling_params import SamplingParams
from pipeline.sampling_params.structured import StructuredOutputsParams

_clock = time.perf_counter


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

