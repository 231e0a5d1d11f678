"""`pipeline bench serve --http`: the same streamed workload over the OpenAI HTTP front end
(``POST /v1/completions``, SSE, read by ``sse_client``) and over ZMQ (``AsyncClient``), against one daemon, and the
ratios HTTP/ZMQ of issue 11: TTFT p50 (goal <= 1.10) and output tok/s (goal >= 0.95, i.e.
no more than 5 % throughput lost) at --max-concurrency streams (64 by default).

Fairness. Both transports send the same prompts with the same arrivals, and a token
arrives, on both, with each piece of text (the front end sends a chunk only for a delta
with text; ZMQ deltas are counted the same way); token counts are the engine's (ZMQ's final
answer, HTTP's usage chunk). Each run has its own ``cache_salt``, so every run prefills
cold: a later run does not profit from an earlier one's prefix cache. A warm-up on each
transport first (the model's first steps, the front end's imports, the connection pool
filled to --max-concurrency keep-alive connections, as a long-running OpenAI client holds).
Then --rounds runs per transport in ABBA order (ZMQ HTTP HTTP ZMQ ...): the other load on a
shared machine, which drifts, falls on both alike, where alternating ZMQ HTTP ZMQ HTTP would
favour whichever runs second in each pair. Each transport's figures pool its rounds
(latency percentiles over all their requests, throughput = tokens / summed run time); the
per-round figures are reported too, to show the spread.

Where the time goes: the CPU seconds, during each run, of this process (the bench client),
of the HTTP front end, of the daemon's gateway and of each stage (pids from ``health``, read
with psutil; none for a daemon on another host), as cores used over the run.
Owns nothing beyond the run.
"""
from __future__ import annotations

import argparse
import asyncio
import os
import signal
import sys
import time
from typing import Any

import httptools
import msgspec

from pipeline.bench.offline import make_prompts
from pipeline.bench.report import Report, format_table
from pipeline.bench.serve import Sample, _one, pct, run_arrivals, start_daemon
from pipeline.bench.sse_client import SSEClient

WARMUP_TOKENS = 4


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--http", action="store_true",
                   help="compare HTTP (/v1/completions) with ZMQ on one daemon started with both")
    p.add_argument("--http-url", default=None,
                   help="a running daemon's HTTP front end (http://HOST:PORT), with --address")
    p.add_argument("--api-key", default=os.environ.get("PIPELINE_API_KEY"),
                   help="bearer key of the HTTP front end (default: $PIPELINE_API_KEY)")
    p.add_argument("--rounds", type=int, default=4,
                   help="measured runs per transport (--http); one round's TTFT p50 varies +-20%% at 64 streams")


def check_args(args: argparse.Namespace) -> None:
    if args.rounds < 1:
        raise ValueError(f"--rounds must be >= 1, got {args.rounds}")
    if bool(args.address) != bool(args.http_url):
        raise ValueError("--address and --http-url go together (one running daemon); neither: --http starts one")
    if args.http_url and not args.http_url.startswith(("http://", "https://")):
        raise ValueError(f"--http-url must start with http:// or https://, got {args.http_url!r}")


class _Choice(msgspec.Struct):
    text: str = ""
    finish_reason: str | None = None


class _Usage(msgspec.Struct):
    completion_tokens: int = 0


class _Chunk(msgspec.Struct):
    """What the bench reads of a completion chunk (other fields are skipped)."""
    choices: list[_Choice] = []
    usage: _Usage | None = None
    error: dict[str, Any] | None = None


_chunk = msgspec.json.Decoder(_Chunk)


async def _one_http(client: SSEClient, prompt: list[int], out_len: int, s: Sample, sem, salt: str,
                    errors: list[str], model: str | None = None) -> None:
    """One streamed /v1/completions request. A token arrives with each chunk whose
    choices[0].text is non-empty; the count is the usage chunk's; ok once a finish_reason,
    the usage and ``data: [DONE]`` came."""
    body: dict[str, Any] = {"model": model} if model else {}
    body |= {"prompt": prompt, "max_tokens": out_len, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}, "cache_salt": salt}
    state = {"finished": False, "done": False}

    def on_event(data: bytes) -> None:
        now = time.perf_counter()
        if data == b"[DONE]":
            state["done"] = True
            return
        ev = _chunk.decode(data)
        if ev.error is not None:
            errors.append(str(ev.error.get("message")))
        for c in ev.choices:
            if c.text:
                s.token_times.append(now)
            state["finished"] = state["finished"] or c.finish_reason is not None
        if ev.usage is not None:
            s.tokens = ev.usage.completion_tokens

    async with sem:
        s.sent = time.perf_counter()
        try:
            status, text = await client.post("/v1/completions", body, on_event)
        except (OSError, httptools.HttpParserError) as exc:  # counted as failed; the run goes on
            errors.append(f"{type(exc).__name__}: {exc}")
            return
    s.done = time.perf_counter()
    if status != 200:
        errors.append(f"HTTP {status}: {text[:200]!r}")
        return
    s.tokens = s.tokens or len(s.token_times)  # no usage chunk: count the chunks
    s.ok = state["done"] and state["finished"] and bool(s.token_times)


def figures(samples: list[Sample], duration: float) -> dict[str, Any]:
    ok = [s for s in samples if s.ok and s.token_times]
    ttft = [s.ttft for s in ok]
    toks = sum(s.tokens for s in ok)
    return {"requests": len(samples), "completed": len(ok), "duration_s": duration,
            "requests_per_s": len(ok) / duration, "output_tok_per_s": toks / duration,
            "ttft_p50_ms": 1e3 * pct(ttft, 50), "ttft_p99_ms": 1e3 * pct(ttft, 99),
            "tpot_p50_ms": 1e3 * pct([s.tpot for s in ok if s.tokens > 1], 50),
            "e2e_p50_ms": 1e3 * pct([s.e2e for s in ok], 50)}


class CpuMeter:
    """CPU seconds (user + system, threads included) of a server's process tree, summed by
    process name (ours name themselves pl-gateway, pl-http, pl-worker0, ...; vLLM's show as
    VLLM::Worker and VLLM::EngineCore), and of this process as ``client``; ``wait:`` keys: the
    seconds their threads were runnable but waiting for a CPU (Linux's
    /proc/PID/task/*/schedstat), where the cores went short on a shared machine. No root (a
    server on another host): the client alone."""

    def __init__(self, root: int | None) -> None:
        self.root = root

    @classmethod
    def of_daemon(cls, health_detail: dict | None) -> CpuMeter:
        """The meter of a daemon on this host: its stages' parent (the gateway, which started
        them) is the root."""
        import psutil
        stages = (health_detail or {}).get("stages") or ()
        try:
            return cls(psutil.Process(stages[0]["pid"]).ppid() if stages else None)
        except psutil.Error:
            return cls(None)

    def read(self) -> dict[str, float]:
        import psutil
        me = psutil.Process()
        procs: list[tuple[str, Any]] = [("client", me)]
        if self.root is not None:
            try:
                root = psutil.Process(self.root)
                procs += [(p.name(), p) for p in (root, *root.children(recursive=True))]
            except psutil.Error:
                pass
        out: dict[str, float] = {}
        for name, p in procs:
            try:
                t = p.cpu_times()
                wait = sum(int(open(f"/proc/{p.pid}/task/{tid.id}/schedstat").read().split()[1])
                           for tid in p.threads()) / 1e9
            except (psutil.Error, OSError, IndexError, ValueError):  # it ended between the listing and the look
                continue
            out[name] = out.get(name, 0.0) + t.user + t.system
            out[f"wait:{name}"] = out.get(f"wait:{name}", 0.0) + wait
        return out


def cpu_spent(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """What each name of two ``CpuMeter.read`` looks spent between them, largest first (a
    process that started in between counts from 0; one that ended, not at all)."""
    spent = {k: v - before.get(k, 0.0) for k, v in after.items()}
    return dict(sorted(spent.items(), key=lambda kv: -kv[1]))


async def _compare(args, address: str, url: str, prompts: list[list[int]]) -> dict[str, Any]:
    from pipeline.client.async_client import AsyncClient

    conc = args.max_concurrency or len(prompts)
    sem = asyncio.Semaphore(conc)
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    zc = AsyncClient(address, timeout=1800,
                     **({"curve_keys_dir": args.curve_keys} if args.curve_keys else {}))
    hc = SSEClient(url, headers)  # at most `conc` connections: the semaphore bounds the requests
    errors: dict[str, list[str]] = {"zmq": [], "http": []}

    def runner(transport: str, salt: str, out_len: int):
        if transport == "zmq":
            return lambda p, s: _one(zc, p, out_len, s, sem, salt, by_text=True)
        return lambda p, s: _one_http(hc, p, out_len, s, sem, salt, errors["http"])

    try:
        from pipeline.bind import is_loopback
        # Pids mean something only on this host.
        meter = CpuMeter.of_daemon((await zc.health()).detail if is_loopback(address) else None)
        warm = prompts[:conc]
        for t in ("zmq", "http"):
            await run_arrivals(argparse.Namespace(request_rate=float("inf"), seed=args.seed), warm,
                               runner(t, f"bench-warmup-{t}", min(WARMUP_TOKENS, args.output_len)))
        order = [t for r in range(args.rounds) for t in (("zmq", "http") if r % 2 == 0 else ("http", "zmq"))]
        runs = []
        for i, t in enumerate(order):
            cpu0 = meter.read()
            samples, duration = await run_arrivals(args, prompts, runner(t, f"bench-run-{i}", args.output_len))
            cpu1 = meter.read()
            runs.append((t, samples, duration, cpu_spent(cpu0, cpu1)))
        stats = await zc.stats()
    finally:
        await hc.aclose()
        await zc.close()
    return {"order": order, "runs": runs, "stats": stats, "errors": errors}


def _report(args, res: dict[str, Any], daemon: dict[str, Any]) -> Report:
    rep = Report("serve --http")
    pooled: dict[str, dict[str, Any]] = {}
    for t in ("zmq", "http"):
        mine = [r for r in res["runs"] if r[0] == t]
        dur = sum(r[2] for r in mine)
        row = pooled[t] = rep.add(t, **figures([s for r in mine for s in r[1]], dur))
        cpu: dict[str, float] = {}
        for r in mine:
            for k, v in r[3].items():
                cpu[k] = cpu.get(k, 0.0) + v
        row["cpu_cores"] = {k: round(v / dur, 3) for k, v in cpu.items() if not k.startswith("wait:")}
        row["cpu_wait_cores"] = {k[5:]: round(v / dur, 3) for k, v in cpu.items() if k.startswith("wait:")}
        row["round_output_tok_per_s"] = [round(figures(r[1], r[2])["output_tok_per_s"], 1) for r in mine]
        row["round_ttft_p50_ms"] = [round(figures(r[1], r[2])["ttft_p50_ms"], 1) for r in mine]
        row["first_errors"] = res["errors"][t][:3]
    z, h = pooled["zmq"], pooled["http"]
    ttft = h["ttft_p50_ms"] / z["ttft_p50_ms"] if z["ttft_p50_ms"] else float("inf")
    tput = h["output_tok_per_s"] / z["output_tok_per_s"] if z["output_tok_per_s"] else 0.0
    rep.add("http/zmq", ttft_p50_ratio=round(ttft, 4),
            ttft_p99_ratio=round(h["ttft_p99_ms"] / max(z["ttft_p99_ms"], 1e-9), 4),
            output_tok_per_s_ratio=round(tput, 4),
            requests_per_s_ratio=round(h["requests_per_s"] / max(z["requests_per_s"], 1e-9), 4))
    rep.add("run", prompts=args.num_prompts, output_len=args.output_len, max_concurrency=args.max_concurrency,
            request_rate=args.request_rate, rounds=args.rounds, order=" ".join(res["order"]),
            engine_steps=res["stats"].get("engine_steps", 0), **daemon)
    at = f"at {args.max_concurrency or args.num_prompts} streams"
    rep.target(f"HTTP/ZMQ TTFT p50 {at}", round(ttft, 4), "<= 1.10", ttft <= 1.10)
    rep.target(f"HTTP/ZMQ output tok/s {at}", round(tput, 4), ">= 0.95", tput >= 0.95)
    for t, row in pooled.items():
        n = row["requests"]
        rep.target(f"{t}: all requests completed", row["completed"], f"== {n}", row["completed"] == n)
    return rep


def _text(rep: Report) -> str:
    rows = {r["case"]: r for r in rep.results}
    keys = ("requests", "completed", "duration_s", "requests_per_s", "output_tok_per_s",
            "ttft_p50_ms", "ttft_p99_ms", "tpot_p50_ms", "e2e_p50_ms", "round_output_tok_per_s",
            "round_ttft_p50_ms")
    out = [f"# pipeline bench {rep.bench}  ({rep.machine.get('cpu_model', '')}, {rep.machine.get('cpus')} cpus)",
           format_table([{"case": t} | {k: rows[t][k] for k in keys} for t in ("zmq", "http")]),
           "", "cores used during the runs (CPU s / run s):",
           format_table([{"case": t} | rows[t]["cpu_cores"] for t in ("zmq", "http")]),
           "", "runnable but waiting for a CPU (s / run s):",
           format_table([{"case": t} | rows[t]["cpu_wait_cores"] for t in ("zmq", "http")]),
           "", format_table([rows["http/zmq"]]), "", format_table([rows["run"]]), "", "targets:",
           format_table([{"target": t["name"], "measured": t["measured"], "goal": t["goal"],
                          "met": "yes" if t["met"] else "NO"} for t in rep.targets])]
    errs = [f"{t}: {e}" for t in ("zmq", "http") for e in rows[t]["first_errors"]]
    return "\n".join(out + ["", "first errors:", *errs] * bool(errs)) + "\n"


def main(args: argparse.Namespace) -> int:
    prompts = make_prompts(args.model, args.num_prompts, args.min_prompt_len, args.max_prompt_len, args.seed)
    proc, address, url = (None, args.address, args.http_url) if args.address else start_daemon(args, http=True)
    daemon: dict[str, Any] = {}
    try:
        assert url is not None, "the daemon did not report its HTTP URL"
        res = asyncio.run(_compare(args, address, url.rstrip("/"), prompts))
    finally:
        if proc is not None:
            proc.send_signal(signal.SIGTERM)
            daemon = {"daemon_pid": proc.pid, "daemon_exit_code": proc.wait(60)}
    rep = _report(args, res, daemon)
    if args.json:
        return rep.emit(True)
    sys.stdout.write(_text(rep))
    return 0
