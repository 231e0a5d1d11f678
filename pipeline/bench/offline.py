"""`pipeline bench offline`: the same prompts through `pipeline run` and through transformers'
batched `generate`, in one run, on the same checkpoint, dtype and machine.

Throughput is output tokens over the span from the first request's arrival to the last
answer (start-up excluded on both sides: transformers' load is not timed either). Every
request generates exactly --output-len tokens (ignore_eos / min_new_tokens) so both sides do
the same work. Also reports the engine's own overhead per step: the share of each step's
wall time not spent in the worker's execute() (forward + sampling), from the engine stage.
Owns nothing beyond the run.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time

from pipeline.bench.report import Report
from pipeline.config import DEFAULT_MODEL


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--min-prompt-len", type=int, default=16, help="tokens")
    p.add_argument("--max-prompt-len", type=int, default=256, help="tokens")
    p.add_argument("--output-len", type=int, default=64, help="tokens per request")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--skip-transformers", action="store_true")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--engine-args", default="", help="extra `pipeline run` flags, one string")


def make_prompts(model: str, n: int, lo: int, hi: int, seed: int) -> list[list[int]]:
    """Token id prompts of mixed lengths cut from text every CPython ships."""
    import pydoc_data.topics

    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(os.path.join(model, "tokenizer.json"))
    ids = tok.encode("\n\n".join(pydoc_data.topics.topics.values()), add_special_tokens=False).ids
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        length = rng.randint(lo, hi)
        start = rng.randrange(0, len(ids) - length)
        out.append(ids[start:start + length])
    return out


def run_pipeline(args, prompts: list[list[int]]) -> tuple[dict, dict]:
    lines = "".join(json.dumps({"id": str(i), "prompt_token_ids": p, "max_tokens": args.output_len,
                                "temperature": 0, "ignore_eos": True}) + "\n"
                    for i, p in enumerate(prompts))
    with tempfile.TemporaryDirectory() as tmp:
        stats_path = os.path.join(tmp, "stats.json")
        cmd = [sys.executable, "-m", "pipeline", "run", "--model", args.model, "--dtype", args.dtype,
               "--device", args.device, "--stats-json", stats_path, *args.engine_args.split()]
        t0 = time.perf_counter()
        p = subprocess.run(cmd, input=lines, capture_output=True, text=True, check=False)
        wall = time.perf_counter() - t0
        if p.returncode != 0:
            raise RuntimeError(f"pipeline run failed ({p.returncode}):\n{p.stderr[-4000:]}")
        with open(stats_path) as f:
            stats = json.load(f)
    answers = [json.loads(line) for line in p.stdout.splitlines()]
    first = min(a["timings"]["arrival_time"] for a in answers)
    last = max(a["timings"]["finish_time"] for a in answers)
    tokens = sum(len(a["token_ids"]) for a in answers)
    span = last - first
    row = {"output_tokens": tokens, "seconds": span, "output_tok_per_s": tokens / span,
           "requests_per_s": len(answers) / span, "wall_with_startup_s": wall,
           "mean_ttft_s": sum(a["timings"]["ttft"] for a in answers) / len(answers)}
    return row, stats


def run_transformers(args, prompts: list[list[int]]) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    dtype = getattr(torch, args.dtype)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=dtype).to(args.device).eval()
    pad = model.config.pad_token_id if model.config.pad_token_id is not None else 0
    width = max(len(p) for p in prompts)
    # Left padding, as decoder-only batched generation needs.
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts], device=args.device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=args.device)
    with torch.inference_mode():
        t0 = time.perf_counter()
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=args.output_len,
                             min_new_tokens=args.output_len, do_sample=False, pad_token_id=pad)
        span = time.perf_counter() - t0
    tokens = (out.shape[1] - width) * out.shape[0]
    return {"output_tokens": tokens, "seconds": span, "output_tok_per_s": tokens / span,
            "requests_per_s": len(prompts) / span}


def main(args: argparse.Namespace) -> int:
    prompts = make_prompts(args.model, args.num_prompts, args.min_prompt_len,
                           args.max_prompt_len, args.seed)
    rep = Report("offline")
    ours, stats = run_pipeline(args, prompts)
    rep.add("pipeline run", **ours)
    steps = stats.get("engine_steps", 0)
    step_s = stats.get("engine_step_seconds", 0.0)
    rep.add("engine step", steps=steps, mean_step_ms=1e3 * step_s / max(steps, 1),
            mean_worker_ms=1e3 * stats.get("engine_worker_seconds", 0.0) / max(steps, 1),
            engine_overhead_share=stats.get("engine_overhead_share", 0.0),
            preemptions=stats.get("num_preemptions", 0))
    if not args.skip_transformers:
        hf = run_transformers(args, prompts)
        rep.add("transformers generate (batched)", **hf)
        ratio = ours["output_tok_per_s"] / hf["output_tok_per_s"]
        rep.target("output tok/s vs transformers", round(ratio, 2), ">= 4x", ratio >= 4.0)
    return rep.emit(args.json)
