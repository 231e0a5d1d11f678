"""`pipeline bench structured`: what a grammar costs a decode step, and compiling one costs
(issue 14).

Decode (structured_decode.py): ``--batch`` requests under a JSON schema against the same
prompts free, greedy, timed windows alternating between the two; target: constrained/free
<= 1.15, and every constrained output matching its grammar.

Compile: xgrammar's import and tokenizer info once (the first structured request of a process
pays them), then p50 of ``--compile-schemas`` distinct schemas (a field name and an enum vary:
cache misses) and of the same again (hits); CPU-side latencies in ms.

Owns nothing.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

from pipeline.bench.report import Report
from pipeline.bench.structured_decode import bench_decode, schema
from pipeline.config import DEFAULT_MODEL
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
