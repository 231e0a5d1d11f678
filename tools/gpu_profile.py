"""Where a decode step's time goes (issue 29): the worker's host phases and its kernels.

Drives a ModelRunner directly (bench/steps.py, no engine) at one batch size: times each
host phase of ``execute`` per step (applying the step's diff, staging the inputs, the forward
launch or graph replay, sampling with the token read-back, which waits for the GPU), then
records a few steps under torch.profiler: the GPU's busy time per step and its kernels by
time. The step is set against the time to read the weights once at the device's measured
read bandwidth (bench/bandwidth.py). Runs on CUDA (the GPU machine, tools/gpu_check.sh) and on
CPU (its test, with the small model).

Usage: python tools/gpu_profile.py --model DIR [--device cuda] [--dtype bfloat16]
           [--batch 1] [--steps 50] [--json FILE]
Writes the report (tables) to stdout and its figures as JSON to --json.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from collections import defaultdict
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from pipeline.bench.bandwidth import cuda_read_bandwidth, read_bandwidth
from pipeline.bench.steps import Steps
from pipeline.bench.worker import PROMPT_LEN, step_weight_bytes
from pipeline.config import EngineConfig
from pipeline.models.config import load_model_config
from pipeline.worker.model_runner import ModelRunner

PHASES = ("_apply_diff", "prepare_inputs", "_forward_and_sample", "_sample")


def timed_phases(runner: ModelRunner, acc: dict[str, float]) -> None:
    """Wrap the runner's phase methods (instance attributes shadow the class's) so each adds
    its wall time to ``acc``."""
    for name in PHASES:
        fn = getattr(runner, name)

        def wrapper(*a, _fn=fn, _name=name, **kw):
            t = time.perf_counter()
            try:
                return _fn(*a, **kw)
            finally:
                acc[_name] += time.perf_counter() - t
        setattr(runner, name, wrapper)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True)
    p.add_argument("--device", default="cuda", choices=["cpu", "cuda"])
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--profile-steps", type=int, default=10)
    p.add_argument("--json", default="")
    p.add_argument("--dry", action="store_true", help="parse the arguments, run nothing (gpu_check.sh --dry-run)")
    args = p.parse_args(argv)
    if args.dry:
        print("would run: tools/gpu_profile.py", " ".join(argv if argv is not None else sys.argv[1:]))
        return 0
    cuda = args.device == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    total = args.steps + args.profile_steps + 12
    # The checkpoint's max_model_len, as a user's run has it: a CUDA graph's block table (and
    # with it how paged attention splits a context) is as wide as that.
    max_len = load_model_config(args.model).max_position_embeddings
    runner = ModelRunner(EngineConfig.of(
        model=args.model, device=args.device, dtype=args.dtype, block_size=16,
        max_num_seqs=max(args.batch, 4),
        num_blocks=max(args.batch * -(-(PROMPT_LEN + total) // 16), -(-max_len // 16)) + 8,
        max_num_batched_tokens=max(256, args.batch * PROMPT_LEN)))
    runner.load()
    try:
        assert runner.model is not None
        weight_bytes = step_weight_bytes(runner.model, runner.model_config.tie_word_embeddings)
        bw = cuda_read_bandwidth() if cuda else read_bandwidth()
        s = Steps(runner)
        rng = np.random.default_rng(0)
        vocab = min(runner.model_config.vocab_size, 512)
        _, ids = s.admit(rng.integers(3, vocab, (args.batch, PROMPT_LEN)).tolist(), total, "p")
        computed = PROMPT_LEN
        for _ in range(10):  # warm-up (graph capture happened at load)
            s.decode(ids, computed)
            computed += 1
        acc: dict[str, float] = defaultdict(float)
        timed_phases(runner, acc)
        sync()
        t0 = time.perf_counter()
        for _ in range(args.steps):
            s.decode(ids, computed)
            computed += 1
        sync()
        step_s = (time.perf_counter() - t0) / args.steps
        phases_ms = {k: acc[k] / args.steps * 1e3 for k in PHASES}
        activities = [torch.profiler.ProfilerActivity.CPU]
        if cuda:
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        with torch.profiler.profile(activities=activities) as prof:
            for _ in range(args.profile_steps):
                s.decode(ids, computed)
                computed += 1
            sync()
        events = prof.key_averages()
        dev_us = sum(getattr(e, "self_device_time_total", 0.0) for e in events) if cuda else 0.0
        read_ms = weight_bytes / bw * 1e3
        report = {
            "device": torch.cuda.get_device_name() if cuda else "cpu", "dtype": args.dtype,
            "batch": args.batch, "weight_mib": round(weight_bytes / 2**20, 1),
            "read_gb_s": round(bw / 1e9, 1), "weights_read_ms": round(read_ms, 4),
            "step_ms": round(step_s * 1e3, 4), "tok_s": round(args.batch / step_s, 1),
            "fraction_of_read_limit": round(read_ms / (step_s * 1e3), 3),
            "gpu_busy_ms_per_step": round(dev_us / 1e3 / args.profile_steps, 4),
            "graphs": runner.graphs is not None,
            # execute's phases, per step; _sample is inside _forward_and_sample and holds the
            # wait for the GPU (the token read-back)
            "phases_ms": {k: round(v, 4) for k, v in phases_ms.items()},
            "launch_ms": round(phases_ms["_forward_and_sample"] - phases_ms["_sample"], 4),
        }
        print(json.dumps(report, indent=1))
        sort = "self_device_time_total" if cuda else "self_cpu_time_total"
        print(events.table(sort_by=sort, row_limit=25, max_name_column_width=70))
        if args.json:
            Path(args.json).write_text(json.dumps(report, indent=1))
    finally:
        runner.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
