"""`pipeline bench serve`: Poisson (or burst) arrivals against a running daemon, like vLLM's
serving benchmark. Reports request and token throughput, TTFT, TPOT, ITL and end-to-end
latency (mean, p50, p99) measured at the client, goodput under TTFT/TPOT SLOs, and the
engine's overhead share per step from the daemon's stats.

Without --address it starts `pipeline serve` itself (same flags as a user would pass) and
stops it at the end. Every request streams and generates exactly --output-len tokens.
With --http (or --http-url) it compares the OpenAI HTTP front end with ZMQ instead
(``serve_http``). Owns nothing beyond the run.
"""
from __future__ import annotations

import argparse
import asyncio
import random
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any

from pipeline.bench.offline import make_prompts
from pipeline.bench.report import Report
from pipeline.config import DEFAULT_MODEL


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--address", default=None, help="a running daemon; default: start one")
    p.add_argument("--model", default=DEFAULT_MODEL, help="checkpoint (prompts; own daemon)")
    p.add_argument("--num-prompts", type=int, default=None, help="default 200; 256 with --http")
    p.add_argument("--request-rate", type=float, default=float("inf"),
                   help="mean requests/s of the Poisson arrivals; inf: all at once (burst)")
    p.add_argument("--max-concurrency", type=int, default=None,
                   help="0: unlimited; default 0, 64 with --http")
    p.add_argument("--min-prompt-len", type=int, default=16)
    p.add_argument("--max-prompt-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--slo-ttft-ms", type=float, default=2000.0)
    p.add_argument("--slo-tpot-ms", type=float, default=200.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--curve-keys", default=None, help="client keys dir of a CURVE daemon")
    p.add_argument("--engine-args", default="--dtype float32",
                   help="flags for the daemon this bench starts, one string")
    from pipeline.bench import serve_http
    serve_http.add_args(p)


@dataclass(slots=True)
class Sample:
    prompt_tokens: int
    sent: float = 0.0
    token_times: list[float] = field(default_factory=list)  # arrival of each delta
    tokens: int = 0
    done: float = 0.0
    ok: bool = False

    @property
    def ttft(self) -> float:
        return self.token_times[0] - self.sent

    @property
    def e2e(self) -> float:
        return self.done - self.sent

    @property
    def tpot(self) -> float:
        return (self.e2e - self.ttft) / (self.tokens - 1) if self.tokens > 1 else 0.0


async def _one(client, prompt: list[int], out_len: int, s: Sample, sem, salt: str | None = None,
               by_text: bool = False) -> None:
    """One streamed request over ZMQ. ``by_text``: a token arrives with each delta that has
    text, as the HTTP front end sends a chunk only for those (a fair comparison)."""
    from pipeline.messages import RequestResult

    kw = {"cache_salt": salt} if salt is not None else {}
    async with sem:
        s.sent = time.perf_counter()
        async for item in client.stream(prompt_token_ids=prompt, max_tokens=out_len,
                                        temperature=0, ignore_eos=True, **kw):
            now = time.perf_counter()
            if isinstance(item, RequestResult):
                s.done, s.tokens, s.ok = now, len(item.token_ids), item.error is None
            elif item.text if by_text else item.token_ids:
                s.token_times.append(now)


OneRequest = Callable[[list[int], Sample], Coroutine[Any, Any, None]]


async def run_arrivals(args, prompts: list[list[int]], one: OneRequest) -> tuple[list[Sample], float]:
    """The arrival process (Poisson at --request-rate, or a burst) over ``prompts``, each
    request run by ``one``; returns the samples and the wall time of the whole run."""
    rng = random.Random(args.seed)
    samples = [Sample(len(p)) for p in prompts]
    t0 = time.perf_counter()
    tasks: list[asyncio.Task[None]] = []
    at = 0.0
    for p, s in zip(prompts, samples):
        if args.request_rate != float("inf"):
            at += rng.expovariate(args.request_rate)
            await asyncio.sleep(max(0.0, t0 + at - time.perf_counter()))
        tasks.append(asyncio.create_task(one(p, s)))
    await asyncio.gather(*tasks)
    return samples, time.perf_counter() - t0


async def _drive(args, address: str, prompts: list[list[int]]) -> tuple[list[Sample], float, dict]:
    from pipeline.client.async_client import AsyncClient

    sem = asyncio.Semaphore(args.max_concurrency or len(prompts))
    kw = {"curve_keys_dir": args.curve_keys} if args.curve_keys else {}
    client = AsyncClient(address, timeout=1800, **kw)
    try:
        await client.health()
        samples, duration = await run_arrivals(
            args, prompts, lambda p, s: _one(client, p, args.output_len, s, sem))
        stats = await client.stats()
    finally:
        await client.close()
    return samples, duration, stats


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q / 100 * (len(xs) - 1))))] if xs else 0.0


def start_daemon(args, http: bool = False) -> tuple[subprocess.Popen, str, str | None]:
    """`pipeline serve` on a free loopback port (and, with ``http``, its OpenAI front end on
    another, the kernel's pick); returns it, its ZMQ address and its HTTP base URL."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    address = f"tcp://127.0.0.1:{port}"
    extra = ["--http", "127.0.0.1:0"] if http else []
    proc = subprocess.Popen([sys.executable, "-m", "pipeline", "serve", "--model", args.model,
                             "--listen", address, *extra, *args.engine_args.split()],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    assert proc.stderr is not None  # stderr=PIPE
    for line in proc.stderr:  # start-up log; "serving on" means it is ready
        if "serving on" in line:
            # Keep draining its log so the daemon never blocks on a full pipe.
            threading.Thread(target=proc.stderr.read, daemon=True).start()
            url = re.search(r"http://\S+", line) if http else None
            return proc, address, url.group(0) if url else None
    raise RuntimeError(f"pipeline serve exited with {proc.wait()} before serving")


def _start_daemon(args) -> tuple[subprocess.Popen, str]:
    """The daemon and its ZMQ address (pd_load's)."""
    proc, address, _ = start_daemon(args)
    return proc, address


def check_args(args: argparse.Namespace, http: bool) -> None:
    """Fills the mode's defaults; ValueError naming the flag and its limit."""
    if args.num_prompts is None:
        args.num_prompts = 256 if http else 200
    if args.max_concurrency is None:
        args.max_concurrency = 64 if http else 0
    for flag, v, lo in (("--num-prompts", args.num_prompts, 1), ("--output-len", args.output_len, 1),
                        ("--max-concurrency", args.max_concurrency, 0),
                        ("--min-prompt-len", args.min_prompt_len, 1)):
        if v < lo:
            raise ValueError(f"{flag} must be >= {lo}, got {v}")
    if args.max_prompt_len < args.min_prompt_len:
        raise ValueError(f"--max-prompt-len must be >= --min-prompt-len ({args.min_prompt_len}), "
                         f"got {args.max_prompt_len}")
    if not args.request_rate > 0:
        raise ValueError(f"--request-rate must be > 0 (inf: a burst), got {args.request_rate}")


def main(args: argparse.Namespace) -> int:
    http = bool(args.http or args.http_url)
    try:
        check_args(args, http)
        if http:
            from pipeline.bench import serve_http
            serve_http.check_args(args)
    except ValueError as exc:
        print(f"pipeline bench serve: {exc}", file=sys.stderr)
        return 2
    if http:
        return serve_http.main(args)
    prompts = make_prompts(args.model, args.num_prompts, args.min_prompt_len,
                           args.max_prompt_len, args.seed)
    proc, address = (None, args.address) if args.address else _start_daemon(args)
    try:
        samples, duration, stats = asyncio.run(_drive(args, address, prompts))
    finally:
        if proc is not None:
            proc.send_signal(signal.SIGTERM)
            proc.wait(60)
    ok = [s for s in samples if s.ok and s.token_times]
    rep = Report("serve")
    out_tokens = sum(s.tokens for s in ok)
    rep.add("throughput", requests=len(samples), completed=len(ok), duration_s=duration,
            request_rate=args.request_rate, requests_per_s=len(ok) / duration,
            output_tok_per_s=out_tokens / duration,
            total_tok_per_s=(out_tokens + sum(s.prompt_tokens for s in ok)) / duration)
    itl = [b - a for s in ok for a, b in zip(s.token_times, s.token_times[1:])]
    for name, xs in (("ttft", [s.ttft for s in ok]), ("tpot", [s.tpot for s in ok if s.tokens > 1]),
                     ("itl", itl), ("e2e", [s.e2e for s in ok])):
        rep.add(name, mean_ms=1e3 * sum(xs) / max(len(xs), 1), p50_ms=1e3 * pct(xs, 50),
                p99_ms=1e3 * pct(xs, 99))
    good = [s for s in ok if s.ttft * 1e3 <= args.slo_ttft_ms and s.tpot * 1e3 <= args.slo_tpot_ms]
    rep.add("goodput", slo_ttft_ms=args.slo_ttft_ms, slo_tpot_ms=args.slo_tpot_ms,
            good_requests=len(good), goodput_req_per_s=len(good) / duration)
    rep.add("engine", steps=stats.get("engine_steps", 0),
            engine_overhead_share=stats.get("engine_overhead_share", 0.0),
            preemptions=stats.get("num_preemptions", 0),
            prefix_cache_hit_rate=stats.get("prefix_cache_hit_rate", 0.0))
    rep.target("all requests completed", len(ok), f"== {len(samples)}", len(ok) == len(samples))
    return rep.emit(args.json)
