"""`pipeline bench pd`, target (4): the inter-token latency of requests decoding while long
prompts arrive, on a disaggregated pair against one mixed instance serving the same workload.

Workload (same for both setups, same seed): --load-decoders streams kept busy with short
prompts (greedy, ignore_eos, --load-decode-len/2 to --load-decode-len tokens, drawn from the
seed so the decoders do not finish in lockstep; each sends its next request when one ends)
while prompts of 4 x --load-batched-tokens tokens arrive every --load-long-interval s, asking
for --load-long-max-tokens tokens; the decoders stop once the last long prompt is answered.
Measured at the client (serve bench's Sample/_one): gaps between the decoders' streamed deltas
(ITL), time to first token of the long prompts and of the decoders.

Setup A: one `pipeline serve` (mixed). Setup B: `--role prefill --kv-transfer ipc` and
`--role decode` behind `pipeline router` on this host. Both get the same worker threads in all
(A: N, B: N/2 each); every other stage process and the router share the cores with them. Each
run serves an unmeasured warm-up (a short and a long prompt), runs the workload and is stopped
with SIGTERM; exit codes and leftover /dev/shm names and KV sockets come back with the figures.
Owns nothing beyond the run.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

from pipeline.bench.offline import make_prompts
from pipeline.bench.report import percentiles_us
from pipeline.bench.serve import Sample, _one, _start_daemon
from pipeline.config import DEFAULT_MODEL


def add_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("target (4): decode inter-token latency under long prompts")
    g.add_argument("--load-model", default=DEFAULT_MODEL)
    g.add_argument("--load-decoders", type=int, default=4, help="concurrent streaming short requests")
    g.add_argument("--load-decode-len", type=int, default=128,
                   help="most tokens of a decoder request (each asks for half of it to all of it)")
    g.add_argument("--load-long-prompts", type=int, default=8)
    g.add_argument("--load-long-interval", type=float, default=1.5, help="s between long prompts")
    g.add_argument("--load-long-max-tokens", type=int, default=2,
                   help="2 to 4 (1 would not be split: the router sends it whole to decode)")
    g.add_argument("--load-batched-tokens", type=int, default=256,
                   help="--max-num-batched-tokens of every instance; long prompts are 4x this")
    g.add_argument("--load-worker-threads", type=int, default=2,
                   help="worker threads per setup: mixed gets all, prefill and decode half each")
    g.add_argument("--load-rounds", type=int, default=2,
                   help="runs of each setup, alternating which goes first")
    g.add_argument("--load-seed", type=int, default=0)
    g.add_argument("--load-engine-args", default="--dtype float32 --max-num-seqs 64 --num-blocks 2048",
                   help="more flags for every instance, one string (--device cpu is always set)")


def _check(args: argparse.Namespace) -> int:
    """Raise ValueError naming the flag and its limit; return the long prompts' length."""
    for flag, lo in (("decoders", 1), ("decode_len", 4), ("long_prompts", 1), ("batched_tokens", 16),
                     ("worker_threads", 2), ("rounds", 1)):
        if (v := getattr(args, "load_" + flag)) < lo:
            raise ValueError(f"--load-{flag.replace('_', '-')} must be >= {lo}, got {v}")
    if not 2 <= args.load_long_max_tokens <= 4:
        raise ValueError(f"--load-long-max-tokens must be in [2, 4], got {args.load_long_max_tokens}")
    if not args.load_long_interval > 0:
        raise ValueError(f"--load-long-interval must be > 0 s, got {args.load_long_interval}")
    long_len = 4 * args.load_batched_tokens
    limit = json.loads((Path(args.load_model) / "config.json").read_text())["max_position_embeddings"]
    if long_len + args.load_long_max_tokens > limit:
        raise ValueError(f"--load-batched-tokens must be <= {(limit - 4) // 4} (long prompts of 4x it "
                         f"must fit the model's {limit} positions), got {args.load_batched_tokens}")
    return long_len


async def _workload(address: str, short: list[tuple[list[int], int]], long: list[list[int]],
                    args: argparse.Namespace) -> tuple[list[tuple[Sample, int]], list[Sample], float]:
    from pipeline.client.async_client import AsyncClient

    client = AsyncClient(address, timeout=600)
    sem = asyncio.Semaphore(1 << 20)  # serve._one takes a concurrency limit; this load paces itself
    try:
        await client.health()
        # Unmeasured warm-up: first forward passes of both shapes, and on B the whole KV path.
        for prompt, n in ((short[-1][0], 4), (long[-1], args.load_long_max_tokens)):
            s = Sample(len(prompt))
            await _one(client, prompt, n, s, sem)
            if not s.ok:
                raise RuntimeError(f"warm-up request of {len(prompt)} prompt tokens failed")
        stop = asyncio.Event()
        decoded: list[tuple[Sample, int]] = []  # with the tokens it asked for

        async def decoder(k: int) -> None:
            j = 0
            while not stop.is_set():
                prompt, n = short[(j * args.load_decoders + k) % (len(short) - 1)]
                decoded.append((s := Sample(len(prompt)), n))
                await _one(client, prompt, n, s, sem)
                j += 1

        async def arrive(i: int, s: Sample) -> None:
            await asyncio.sleep(max(0.0, t0 + (i + 1) * args.load_long_interval - time.perf_counter()))
            await _one(client, long[i], args.load_long_max_tokens, s, sem)

        longs = [Sample(len(p)) for p in long[:-1]]
        t0 = time.perf_counter()
        decoders = [asyncio.create_task(decoder(k)) for k in range(args.load_decoders)]
        await asyncio.gather(*(arrive(i, s) for i, s in enumerate(longs)))
        stop.set()
        await asyncio.gather(*decoders)
        return decoded, longs, time.perf_counter() - t0
    finally:
        await client.close()


def _summary(decoded: list[tuple[Sample, int]], longs: list[Sample], duration: float) -> dict:
    ok = [s for s, _ in decoded if s.ok and s.token_times]
    itl = [b - a for s in ok for a, b in zip(s.token_times, s.token_times[1:])]
    out: dict = {"decoder_requests": len(decoded), "long_requests": len(longs),
                 "failed": sum(not (s.ok and s.token_times) for s in [d for d, _ in decoded] + longs),
                 "short_answers": sum(s.ok and s.tokens != n for s, n in decoded), "itl_gaps": len(itl),
                 "duration_s": round(duration, 2)}
    for name, xs in (("itl", itl), ("ttft_long", [s.ttft for s in longs if s.ok and s.token_times]),
                     ("ttft_decoder", [s.ttft for s in ok])):
        p50, p99 = percentiles_us([int(x * 1e9) for x in xs]) if xs else (0.0, 0.0)
        out |= {f"{name}_p50_ms": round(p50 / 1e3, 2), f"{name}_p99_ms": round(p99 / 1e3, 2),
                f"{name}_max_ms": round(max(xs, default=0.0) * 1e3, 2)}
    return out


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start_router(procs: dict[str, subprocess.Popen], prefill: str, decode: str) -> str:
    from pipeline.client import Client

    address = f"tcp://127.0.0.1:{_port()}"
    cmd = [sys.executable, "-m", "pipeline", "router", "--listen", address, "--prefill", prefill,
           "--decode", decode]
    proc = procs["router"] = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    assert proc.stderr is not None  # stderr=PIPE
    for line in proc.stderr:
        if "serving on" in line:
            threading.Thread(target=proc.stderr.read, daemon=True).start()  # never block on its log
            break
    else:
        raise RuntimeError(f"pipeline router exited with {proc.wait()} before serving")
    deadline = time.monotonic() + 60
    with Client(address, timeout=10) as c:  # serving is not routing: wait for both health checks
        while not all(i["up"] for i in c.health().detail["instances"].values()):
            if time.monotonic() > deadline:
                raise RuntimeError("pipeline router: its instances were not up within 60 s")
            time.sleep(0.1)
    return address


def _stop(procs: dict[str, subprocess.Popen]) -> dict[str, int]:
    codes = {}
    for name in sorted(procs, key=lambda k: k != "router"):  # the router before its instances
        p = procs[name]
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
        try:
            codes[name] = p.wait(60)
        except subprocess.TimeoutExpired:
            p.kill()
            codes[name] = p.wait()
    return codes


def _leftovers(serve_pids: list[int]) -> list[str]:
    """/dev/shm names and KV sockets of these instances (named after their gateway's pid)."""
    from pipeline.gateway.stages import KV_SOCKET_DIR
    run_dir = Path(os.environ.get("XDG_RUNTIME_DIR") or KV_SOCKET_DIR)
    left = []
    for pid in serve_pids:
        want = (f"pipeline.{pid:x}.", f"sem.pipeline.{pid:x}.")
        left += sorted(n for n in os.listdir("/dev/shm") if n.startswith(want))
        left += [str(p) for p in run_dir.glob(f"pipeline-{pid:x}.kv")]
    return left


def _run_setup(pd: bool, args: argparse.Namespace, short: list[tuple[list[int], int]],
               long: list[list[int]]) -> dict:
    """Start one setup, run the workload once, stop it: raw samples, exit codes, leftovers."""
    common = ["--device", "cpu", "--max-num-batched-tokens", str(args.load_batched_tokens),
              *args.load_engine_args.split()]
    n = args.load_worker_threads
    roles = ([("decode", ["--role", "decode"], n - n // 2),
              ("prefill", ["--role", "prefill", "--kv-transfer", "ipc"], n // 2)] if pd else [("mixed", [], n)])
    procs: dict[str, subprocess.Popen] = {}
    load = os.getloadavg()[0]  # other work on this host skews the figures: say how much
    try:
        addrs = {}
        for name, flags, threads in roles:
            cfg = SimpleNamespace(model=args.load_model,
                                  engine_args=" ".join([*common, *flags, "--worker-threads", str(threads)]))
            procs[name], addrs[name] = _start_daemon(cfg)
        address = _start_router(procs, addrs["prefill"], addrs["decode"]) if pd else addrs["mixed"]
        decoded, longs, duration = asyncio.run(_workload(address, short, long, args))
    finally:
        codes = _stop(procs)
    return {"decoded": decoded, "longs": longs, "duration": duration, "load": round(load, 2),
            "codes": codes, "left": _leftovers([p.pid for k, p in procs.items() if k != "router"])}


def itl_under_long_prompts(args: argparse.Namespace) -> dict:
    """Run the workload --load-rounds times on each setup (a mixed instance; prefill + decode +
    router), alternating which goes first so that other load on the host drifts over both
    alike; return each setup's figures over all its rounds, the pd / mixed ratios of ITL
    p50/p99 and TTFT p50, each round's ITL p99, and the CPU budget."""
    long_len = _check(args)
    # One spare of each for the warm-up, never reused in the measured part.
    long = make_prompts(args.load_model, args.load_long_prompts + 1, long_len, long_len, args.load_seed)
    rng = random.Random(args.load_seed)
    short = [(p, rng.randint(args.load_decode_len // 2, args.load_decode_len))
             for p in make_prompts(args.load_model, 257, 16, 64, args.load_seed + 1)]
    runs: dict[str, list[dict]] = {"mixed": [], "pd": []}
    for r in range(args.load_rounds):
        for pd in ((False, True) if r % 2 == 0 else (True, False)):
            runs["pd" if pd else "mixed"].append(_run_setup(pd, args, short, long))
    res: dict = {}
    for setup, rs in runs.items():
        res[setup] = _summary([d for x in rs for d in x["decoded"]], [s for x in rs for s in x["longs"]],
                              sum(x["duration"] for x in rs))
        res[setup]["itl_p99_ms_rounds"] = [_summary(x["decoded"], [], 0)["itl_p99_ms"] for x in rs]
        res[setup]["loadavg_1m_before"] = [x["load"] for x in rs]
        # the worst exit code of each process over the rounds (0 only if every stop was clean)
        res[setup]["exit_codes"] = {k: max((x["codes"][k] for x in rs), key=abs) for k in rs[0]["codes"]}
        res[setup]["leftovers"] = [name for x in rs for name in x["left"]]
    m, d = res["mixed"], res["pd"]
    for key in ("itl_p99_ms", "itl_p50_ms", "ttft_long_p50_ms", "ttft_decoder_p50_ms"):
        res[key.replace("_ms", "_ratio")] = round(d[key] / m[key], 3) if m[key] else float("nan")
    n = args.load_worker_threads
    res["cpu_budget"] = (f"{n} worker threads each setup: mixed --worker-threads {n}; prefill {n // 2} + decode "
                         f"{n - n // 2}; {os.cpu_count()} cores shared with every stage process and the router")
    res["workload"] = {k[len("load_"):]: v for k, v in vars(args).items() if k.startswith("load_")} | {
        "long_prompt_tokens": long_len, "kv_transfer": "ipc", "itl": "client-side gaps between streamed deltas"}
    return res
