"""`pipeline bench startup`: time to first token of a one-line `pipeline run` against
`python -c "import torch"` (the same interpreter), both measured in the same run.

The two alternate --repeats times, so a machine that slows down or a cold page cache
weighs on both. Each is timed from just before its process is started: `import torch` to its
exit; the one-line run (the prompt on stdin, `--max-tokens 1`) to its first stdout line (the
answer, with its one token) and to its exit. The target compares the medians.

Where the run's time goes comes from what it already prints, stamped as each stderr line
reaches this process (the stages write their log lines flushed, so the stamp is when the
line was written, give or take a pipe hop): the worker's "loading weights" (its process has
started and imported torch and the model code), weights loaded, the worker ready (KV cache
allocated), the other stages ready, and the gateway's "ready" (all stages up). The stages
start together, so the rows overlap: the token processor is ready long before the worker,
the engine and the tokenizer just after it (they are built from its ModelInfo). The
gateway's own imports are timed apart as `pipeline run --help`, a process of its own in the
same alternation, since the run prints nothing when they end.

Loading against reading: the worker's own "loaded in" figure (meta model to packed weights)
against reading every tensor of the checkpoint with the loader's reader in this process, in
the same alternation (so the page cache is as warm for both: the loader's floor), and the
worker's peak resident memory during loading (VmHWM less its RSS when loading began) against
the checkpoint's size. Both also report their CPU seconds (the worker's: every thread of its
process while loading), and ``floor_x_read`` is the load's CPU work spread over every core
against the read's wall time: the least ``x_read`` the machine allows for the work the load
does. Owns nothing beyond the run.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import IO

from pipeline.bench.report import Report
from pipeline.config import DEFAULT_MODEL
from pipeline.models.loader import checkpoint_files
from pipeline.models.safetensors_read import SafetensorsFile

GOAL_RATIO = 1.5
LOAD_GOAL_RATIO = 1.5  # weights loaded (packed) / the checkpoint read
_LOADED = re.compile(r"model: .* loaded in ([\d.]+)s \(cpu ([\d.]+)s\), "
                     r"peak RSS (\d+) MiB \((\d+) MiB before loading\)")
# (breakdown row, the stderr line that marks it): the worker's in the order it reaches them,
# then the other stages', which start beside it. The lines are the stages' own start-up log;
# a row whose line never came is reported unseen.
# Not anchored: the stages start together and share stderr, where an unbuffered print (python
# -u) can put another stage's text before a line's own.
MILESTONES = (
    ("worker imported torch + model code", re.compile(r"\[worker0\] loading weights")),
    ("weights loaded", re.compile(r"model: .* loaded in")),
    ("worker ready (KV cache allocated)", re.compile(r"\[worker0\] loaded in")),
    ("tokenizer ready", re.compile(r"\[tokenizer\] tokenizer loaded")),
    ("detokenizer ready", re.compile(r"\[output\] detokenizer ready")),
    ("engine ready", re.compile(r"\[engine\] scheduler ready")),
    ("all stages ready", re.compile(r"\[gateway\] ready")),
)


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--repeats", type=int, default=5, help="alternations of the two processes")
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--prompt", default="The for statement", help="the one line on stdin")
    p.add_argument("--engine-args", default="", help="extra `pipeline run` flags, one string")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds per process")


@dataclass(slots=True)
class RunTimes:
    """One one-line run, in seconds since just before its process was started."""
    first_line: float
    exit: float
    stderr: list[tuple[float, str]] = field(default_factory=list)
    engine_ttft: float = 0.0  # the answer's own timings.ttft (arrival to first token)


def _stamp(stream: IO[bytes], t0: float, out: list[tuple[float, str]]) -> None:
    for raw in stream:
        out.append((time.perf_counter() - t0, raw.decode(errors="replace").rstrip("\n")))


def time_to_exit(cmd: list[str], timeout: float) -> float:
    t0 = time.perf_counter()
    p = subprocess.run(cmd, stdin=subprocess.DEVNULL, capture_output=True, timeout=timeout,
                       check=False)
    took = time.perf_counter() - t0
    if p.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} exited {p.returncode}:\n"
                           f"{p.stderr.decode(errors='replace')[-2000:]}")
    return took


def one_line_run(args: argparse.Namespace) -> RunTimes:
    cmd = [sys.executable, "-m", "pipeline", "run", "--model", args.model, "--max-tokens", "1",
           *args.engine_args.split()]
    out: list[tuple[float, str]] = []
    err: list[tuple[float, str]] = []
    t0 = time.perf_counter()
    p = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE)
    assert p.stdin is not None and p.stdout is not None and p.stderr is not None  # all PIPE
    readers = [threading.Thread(target=_stamp, args=(s, t0, sink), daemon=True)
               for s, sink in ((p.stdout, out), (p.stderr, err))]
    for r in readers:
        r.start()
    p.stdin.write(args.prompt.encode() + b"\n")  # as `echo PROMPT | pipeline run` does
    p.stdin.close()
    try:
        p.wait(args.timeout)
    except subprocess.TimeoutExpired:
        p.kill()
        p.wait()
        raise RuntimeError(f"pipeline run took over --timeout {args.timeout:g}s") from None
    exited = time.perf_counter() - t0
    for r in readers:
        r.join()
    log = "\n".join(line for _, line in err)[-2000:]
    answers = [json.loads(line) for _, line in out if line.strip()]
    if p.returncode != 0 or len(answers) != 1 or answers[0].get("error"):
        raise RuntimeError(f"pipeline run exited {p.returncode} with {len(answers)} answer(s) "
                           f"(want 1 without error): {out[-1:]}\n{log}")
    return RunTimes(out[0][0], exited, err, float(answers[0]["timings"]["ttft"]))


def read_checkpoint(model: str) -> tuple[float, int, float]:
    """Seconds to read every tensor of ``model``'s checkpoint as the loader does, its bytes,
    and the CPU seconds (user + system) the read took."""
    t0, cpu0 = time.perf_counter(), time.thread_time()
    files = checkpoint_files(model)
    for path in files:
        with SafetensorsFile(path) as f:
            for key in f.keys():
                f.get_tensor(key)
    return time.perf_counter() - t0, sum(p.stat().st_size for p in files), time.thread_time() - cpu0


def load_figures(run: RunTimes) -> tuple[float, float, float] | None:
    """(seconds, CPU seconds of every thread, MiB the resident memory peaked above its start)
    of the worker's load."""
    m = next((m for _, line in run.stderr if (m := _LOADED.search(line))), None)
    return (float(m[1]), float(m[2]), float(int(m[3]) - int(m[4]))) if m else None


def milestone_at(run: RunTimes, pattern: re.Pattern[str]) -> float | None:
    return next((t for t, line in run.stderr if pattern.search(line)), None)


def spread(xs: list[float]) -> dict[str, float]:
    return {"median_s": statistics.median(xs), "min_s": min(xs)}


def check_args(args: argparse.Namespace) -> None:
    """ValueError naming the flag and its limit."""
    if args.repeats < 1:
        raise ValueError(f"--repeats must be >= 1, got {args.repeats}")
    if not args.timeout > 0:
        raise ValueError(f"--timeout must be > 0 seconds, got {args.timeout}")


def measure(args: argparse.Namespace) -> Report:
    torch_cmd = [sys.executable, "-c", "import torch"]
    help_cmd = [sys.executable, "-m", "pipeline", "run", "--help"]
    torch_s: list[float] = []
    help_s: list[float] = []
    runs: list[RunTimes] = []
    read_s: list[float] = []
    read_cpu: list[float] = []
    file_bytes = 0
    for _ in range(args.repeats):
        torch_s.append(time_to_exit(torch_cmd, args.timeout))
        runs.append(one_line_run(args))
        help_s.append(time_to_exit(help_cmd, args.timeout))
        took, file_bytes, cpu = read_checkpoint(args.model)
        read_s.append(took)
        read_cpu.append(cpu)
    first = [r.first_line for r in runs]
    ratio = statistics.median(first) / statistics.median(torch_s)
    rep = Report("startup")
    rep.add('python -c "import torch"', runs=len(torch_s), **spread(torch_s))
    rep.add("pipeline run: first token", runs=len(runs), **spread(first),
            x_import_torch=round(ratio, 2))
    rep.add("pipeline run: exit", runs=len(runs), **spread([r.exit for r in runs]))
    # The breakdown: when each milestone was reached, in seconds since the run's start.
    rep.add("  gateway imports (pipeline run --help, own process)", runs=len(help_s),
            **spread(help_s))
    ready: list[float] = []
    for name, pattern in MILESTONES:
        seen = [t for t in (milestone_at(r, pattern) for r in runs) if t is not None]
        if not seen:
            rep.add(f"  {name}", runs=0)
            continue
        rep.add(f"  {name}", runs=len(seen), **spread(seen))
        if name == "all stages ready":
            ready = seen
    if len(ready) == len(runs):
        rep.add("  first token after all stages ready", runs=len(runs),
                **spread([r.first_line - t for r, t in zip(runs, ready)]))
    rep.add("  engine ttft (answer's timings.ttft)", runs=len(runs),
            **spread([r.engine_ttft for r in runs]))
    rep.target("first token / import torch (medians)", round(ratio, 2), f"<= {GOAL_RATIO}x",
               ratio <= GOAL_RATIO)
    loads = [f for f in map(load_figures, runs) if f is not None]
    rep.add("checkpoint read (the loader's reader, this process)", runs=len(read_s),
            file_mib=round(file_bytes / 2**20, 1), **spread(read_s),
            cpu_s=round(statistics.median(read_cpu), 3))
    if loads:
        load_ratio = statistics.median(t for t, _, _ in loads) / statistics.median(read_s)
        load_cpu = statistics.median(c for _, c, _ in loads)
        peak = statistics.median(m for _, _, m in loads)
        # The least x_read the load's own CPU work allows, spread over every core the
        # worker has: above the goal, only less work (fewer copies, faults, packing) meets it.
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        floor = load_cpu / cores / statistics.median(read_s)
        rep.add("worker: weights loaded (its own figure)", runs=len(loads),
                **spread([t for t, _, _ in loads]), x_read=round(load_ratio, 2), cpu_s=round(load_cpu, 3),
                cpu_x_read_cpu=round(load_cpu / max(statistics.median(read_cpu), 1e-9), 2),
                cores=cores, floor_x_read=round(floor, 2))
        rep.add("worker: peak RSS during load above its start", runs=len(loads), median_mib=peak,
                x_file=round(peak * 2**20 / file_bytes, 2))
        rep.target("weights loaded / checkpoint read (medians)", round(load_ratio, 2),
                   f"<= {LOAD_GOAL_RATIO}x", load_ratio <= LOAD_GOAL_RATIO)
    return rep


def main(args: argparse.Namespace) -> int:
    try:
        check_args(args)
    except ValueError as exc:
        print(f"pipeline bench startup: {exc}", file=sys.stderr)
        return 2
    try:
        rep = measure(args)
    except (RuntimeError, subprocess.TimeoutExpired) as exc:
        print(f"pipeline bench startup: {exc}", file=sys.stderr)
        return 1
    return rep.emit(args.json)
