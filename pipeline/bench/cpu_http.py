"""`pipeline bench cpu`, HTTP part: each engine's OpenAI server on one checkpoint under the same
streamed load, rounds alternating ABBA between the engines (a shared machine drifts).

Ours: `pipeline serve --http` (ready at its "serving on" line); vLLM's: `vllm serve` from
--vllm-env (ready when /health answers 200). Both with bf16 weights, the same worker threads,
max_model_len and max_num_seqs (= the concurrency). Every round sends --http-requests
streamed /v1/completions (token-id prompts, greedy, ignore_eos, usage in the stream) at most
--http-concurrency at a time, with prompts of its own (no prefix-cache hit across rounds),
read by ``bench serve --http``'s client; one short warm-up round per server first.
Figures per engine, pooled over its rounds: output tok/s, TTFT p50/p99, inter-token p50/p99,
the share of inter-token gaps held by prefills, and where the CPU went in the timed rounds:
seconds per process of the server's tree by process name (ours are named pl-<stage>) and the
load generator's own, against the cores x duration there were.
Owns the servers it starts, for the length of the run.
"""
from __future__ import annotations

import argparse
import asyncio
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from typing import Any

from pipeline.bench.cpu_limits import peak_for, served_flops
from pipeline.bench.report import Report
from pipeline.bench.serve import Sample, pct, run_arrivals
from pipeline.bench.serve_http import CpuMeter, _one_http, cpu_spent
from pipeline.bench.sse_client import SSEClient

SERVED = "bench"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _flags(args, model: str) -> tuple[int, int]:
    return args.prompt_len + args.output_len + 16, args.http_concurrency


def start_ours(args, model: str) -> tuple[subprocess.Popen, str]:
    max_len, seqs = _flags(args, model)
    cmd = [sys.executable, "-m", "pipeline", "serve", "--model", model, "--listen",
           f"tcp://127.0.0.1:{_free_port()}", "--http", "127.0.0.1:0", "--served-model-name", SERVED,
           "--dtype", "bfloat16", "--worker-threads", str(args.threads), "--max-model-len", str(max_len),
           "--max-num-seqs", str(seqs), *args.serve_args.split()]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    assert proc.stderr is not None
    for line in proc.stderr:
        if "serving on" in line:
            threading.Thread(target=proc.stderr.read, daemon=True).start()
            url = re.search(r"http://\S+", line)
            if url is None:
                break
            return proc, url.group(0).rstrip("/")
    proc.kill()
    raise RuntimeError(f"pipeline serve exited with {proc.wait()} before serving")


# vllm-cpu.sh finds tcmalloc with `ldconfig -p | awk '{...; exit}'` under pipefail: when awk
# exits before ldconfig has written everything, the script dies of SIGPIPE (141) at once,
# before vLLM starts. A start that ends so is tried again.
SIGPIPE_EXIT = 141


def start_vllm(args, model: str, tries: int = 3) -> tuple[subprocess.Popen, str]:
    from pipeline.bench.cpu import _DTYPE, VLLM_SH
    max_len, seqs = _flags(args, model)
    port = _free_port()
    # its first --vllm-formats (float32 where an AVX2-only core would emulate bf16)
    dtype = _DTYPE[args.vllm_formats.split(",")[0]][0]
    env = dict(os.environ, VLLM_CPU_OMP_THREADS_BIND=f"0-{args.threads - 1}")
    log = open(os.path.join(args.models_dir, "vllm-serve.log"), "w")
    proc = subprocess.Popen(["bash", str(VLLM_SH), "serve", args.vllm_env, model, "--host", "127.0.0.1",
                             "--port", str(port), "--dtype", dtype, "--max-model-len", str(max_len),
                             "--max-num-seqs", str(seqs), "--served-model-name", SERVED],
                            stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 900
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            if proc.returncode == SIGPIPE_EXIT and tries > 1:  # see SIGPIPE_EXIT
                return start_vllm(args, model, tries - 1)
            raise RuntimeError(f"vllm serve exited with {proc.returncode}; see {log.name}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as r:
                if r.status == 200:
                    return proc, url
        except OSError:
            time.sleep(1.0)
    _stop(proc, group=True)
    raise RuntimeError(f"vllm serve not ready in 900 s; see {log.name}")


def _stop(proc: subprocess.Popen, group: bool = False) -> None:
    """SIGTERM (to the whole session with ``group``: vLLM's server and its engine process)."""
    try:
        os.killpg(proc.pid, signal.SIGTERM) if group else proc.send_signal(signal.SIGTERM)
        proc.wait(60)
    except (subprocess.TimeoutExpired, ProcessLookupError):
        proc.kill()
        proc.wait()


async def _round(args, url: str, prompts: list[list[int]], out_len: int,
                 tag: str) -> tuple[list[Sample], float, list[str]]:
    sem = asyncio.Semaphore(args.http_concurrency)
    client = SSEClient(url)
    errors: list[str] = []
    try:
        samples, dur = await run_arrivals(
            argparse.Namespace(request_rate=float("inf"), seed=args.seed), prompts,
            lambda p, s: _one_http(client, p, out_len, s, sem, tag, errors, model=SERVED))
    finally:
        await client.aclose()
    return samples, dur, errors


def figures(samples: list[Sample], dur: float, model: str | None = None,
            peak: float | None = None) -> dict[str, Any]:
    """``itl_held_pct``: the share of inter-token gaps over 4x the median, in percent: the gaps
    in which a stream waited for other requests' prefill. ITL p99 is one of those once this
    passes 1, a decode step's gap below it, so the two read together say how near the edge a
    run was (docs/benchmarks.md, 12-04). With the model: ``served_gflop_s``, the products of
    the completed requests (``cpu_limits.served_flops``) over the duration, and with the
    peak FLOP/s of the engine's instructions, ``served_peak_fraction``: how far both engines
    are from the compute limit of the whole serving path (HTTP, tokenizer, scheduler and
    client share the cores). ``ttft_mean_ms`` beside the p50: a burst of 32 prompts of 128
    tokens under a 2048-token budget gets its first tokens in two groups of about 16, one step
    apart, so the p50 of a round lands on either group by one request; the mean does not
    (docs/benchmarks.md, 12-05)."""
    ok = [s for s in samples if s.ok]
    phys: dict[str, Any] = {}
    if model is not None and dur > 0:
        flop_s = sum(served_flops(model, s.prompt_tokens, s.tokens) for s in ok) / dur
        phys["served_gflop_s"] = round(flop_s / 1e9, 1)
        if peak:
            phys["served_peak_fraction"] = round(flop_s / peak, 3)
    ttft = [s.ttft for s in ok]
    gaps = [b - a for s in ok for a, b in zip(s.token_times, s.token_times[1:])]
    p50 = pct(gaps, 50)
    held = 100 * sum(g > 4 * p50 for g in gaps) / len(gaps) if gaps else float("nan")
    return {"requests": len(samples), "completed": len(ok), "duration_s": round(dur, 3),
            "output_tok_per_s": round(sum(s.tokens for s in ok) / dur, 1),
            "ttft_p50_ms": round(1e3 * pct(ttft, 50), 1),
            "ttft_mean_ms": round(1e3 * sum(ttft) / len(ttft), 1) if ttft else float("nan"),
            "ttft_p99_ms": round(1e3 * pct(ttft, 99), 1),
            "itl_p50_ms": round(1e3 * p50, 2), "itl_p99_ms": round(1e3 * pct(gaps, 99), 2),
            "itl_held_pct": round(held, 2)} | phys


def run_http(args, rep: Report, shape: str, model: str, lim: dict[str, Any]) -> None:
    from pipeline.bench.cpu import prompts as make_prompts
    from pipeline.models.config import load_model_config
    vocab = load_model_config(model).vocab_size
    engines = {"pipeline": start_ours} | ({"vllm": start_vllm} if args.vllm_env else {})
    order = [e for r in range(args.rounds) for e in (list(engines) if r % 2 == 0 else list(engines)[::-1])]
    pooled: dict[str, list] = {e: [[], 0.0, [], {}] for e in engines}
    for i, eng in enumerate(order):
        # One server at a time: the other engine's threads would take the cores.
        proc, url = engines[eng](args, model)
        try:
            warm = make_prompts(vocab, args.http_concurrency, args.prompt_len, 10_000 + i)
            asyncio.run(_round(args, url, warm, 4, f"warm-{i}"))
            ps = make_prompts(vocab, args.http_requests, args.prompt_len, args.seed + 1 + i)
            meter = CpuMeter(proc.pid)
            before = meter.read()
            samples, dur, errs = asyncio.run(_round(args, url, ps, args.output_len, f"run-{i}"))
            spent = {k: v for k, v in cpu_spent(before, meter.read()).items() if not k.startswith("wait:")}
        finally:
            _stop(proc, group=eng == "vllm")
        pooled[eng][0] += samples
        pooled[eng][1] += dur
        pooled[eng][2] += errs
        for name, secs in spent.items():
            pooled[eng][3][name] = round(pooled[eng][3].get(name, 0.0) + secs, 2)
    rows = {}
    for eng, (samples, dur, errs, cpu) in pooled.items():
        fmt = "bf16" if eng == "pipeline" else args.vllm_formats.split(",")[0]
        cores_s = max(dur * (os.cpu_count() or 1), 1e-9)
        rows[eng] = rep.add(f"{shape} http {eng}", **figures(samples, dur, model, peak_for(fmt, lim)),
                            cpu_s=cpu, cpu_of_cores=round(sum(cpu.values()) / cores_s, 3),
                            first_errors=errs[:3])
        n = rows[eng]["requests"]
        rep.target(f"{shape} http {eng}: all requests completed", rows[eng]["completed"], f"== {n}",
                   rows[eng]["completed"] == n)
    if "vllm" in rows:
        o, v = rows["pipeline"], rows["vllm"]
        r = o["output_tok_per_s"] / max(v["output_tok_per_s"], 1e-9)
        rep.target(f"{shape} http output tok/s vs vLLM CPU", round(r, 3), ">= 1.2", r >= 1.2)
        for k in ("ttft_p50_ms", "itl_p99_ms"):
            r = o[k] / max(v[k], 1e-9)
            rep.target(f"{shape} http {k} vs vLLM CPU", round(r, 3), "<= 1.0", r <= 1.0)
        o["ttft_mean_vs_vllm"] = round(o["ttft_mean_ms"] / max(v["ttft_mean_ms"], 1e-9), 3)
