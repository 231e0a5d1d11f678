"""End-to-end smoke checks of tools/gpu_check.sh that are not pytest (docs/gpu.md).

Owns nothing beyond its runs:
  argv ARGS...   `pipeline ARGS` would parse (flags and choices exist), without running it
  run            `pipeline run` on --device (float32 and its default dtype) and on the CPU
                 (float32), greedy on the same prompts: every answer complete, and the device's
                 float32 tokens equal to the CPU's for at least half the prompts (a broken
                 kernel gives none)
  serve          `pipeline serve --device D --http`: /health, /v1/models, a completion, a
                 streamed one, 16 concurrent ones; then SIGTERM: exit 0 and /dev/shm clean

--dry prints and checks the argv a command would run and runs nothing. With --device cpu
both run on any machine (a local check of this file).
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PIPELINE = [sys.executable, "-m", "pipeline"]
PROMPTS = [
    'The "try" statement specifies', 'The "import" statement', "A function definition defines",
    "The for statement is used to", "Names refer to objects.", 'The "with" statement is used',
    "A class definition defines", "Exceptions are raised", "The while statement is used for",
    "Assignment statements are used to", 'The "return" statement', "A module is",
    "The if statement is used for", "Dictionaries are", 'The "global" statement', "Operators",
]
MAX_TOKENS = 32


def check_argv(argv: list[str]) -> None:
    """SystemExit(2) naming the bad flag when `pipeline argv` would not parse."""
    sys.path.insert(0, str(ROOT))
    from pipeline.cli import build_parser
    build_parser(argv).parse_args(argv)


def env() -> dict[str, str]:
    e = dict(os.environ)
    e["PYTHONPATH"] = os.pathsep.join([str(ROOT)] + [p for p in [e.get("PYTHONPATH")] if p])
    return e


def run_argv(device: str, dtype: str) -> list[str]:
    return ["run", "--device", device, "--dtype", dtype, "--ordered", "--max-tokens", str(MAX_TOKENS),
            "--temperature", "0"]


def pipe(device: str, dtype: str, log: Path, timeout: float) -> dict[str, dict]:
    argv = run_argv(device, dtype)
    lines = "".join(json.dumps({"id": f"p{i}", "prompt": p}) + "\n" for i, p in enumerate(PROMPTS))
    t = time.monotonic()
    with open(log, "w") as err:
        res = subprocess.run([*PIPELINE, *argv], input=lines, stdout=subprocess.PIPE, stderr=err,
                             text=True, timeout=timeout, cwd=ROOT, env=env())
    print(f"pipeline {' '.join(argv)}: exit {res.returncode} in {time.monotonic() - t:.1f}s (log {log})")
    if res.returncode != 0:
        raise SystemExit(f"run --device {device} --dtype {dtype} exited {res.returncode}:\n"
                         + log.read_text()[-3000:])
    answers = {a["id"]: a for a in map(json.loads, res.stdout.splitlines())}
    for i in range(len(PROMPTS)):
        a = answers.get(f"p{i}")
        if a is None or a.get("error") or len(a.get("token_ids", [])) != MAX_TOKENS:
            raise SystemExit(f"run --device {device} --dtype {dtype}: prompt p{i} got {a!r}")
    return answers


def agreement(a: dict[str, dict], b: dict[str, dict]) -> tuple[int, list[int]]:
    """(answers with identical tokens, first differing position of each)."""
    firsts = []
    for k in a:
        x, y = a[k]["token_ids"], b[k]["token_ids"]
        firsts.append(next((i for i, (u, v) in enumerate(zip(x, y)) if u != v), len(x)))
    return sum(f == MAX_TOKENS for f in firsts), firsts


def cmd_run(args: argparse.Namespace) -> int:
    logs = Path(args.logs)
    if args.dry:
        for dev, dt in ((args.device, "float32"), (args.device, "auto"), ("cpu", "float32")):
            print("would run: pipeline", " ".join(run_argv(dev, dt)))
            check_argv(run_argv(dev, dt))
        return 0
    dev32 = pipe(args.device, "float32", logs / f"run_{args.device}_float32.log", args.timeout)
    dev_auto = pipe(args.device, "auto", logs / f"run_{args.device}_auto.log", args.timeout)
    cpu32 = pipe("cpu", "float32", logs / "run_cpu_float32.log", args.timeout)
    (logs / "run_answers.json").write_text(json.dumps(
        {k: [dev32[k]["text"], dev_auto[k]["text"], cpu32[k]["text"]] for k in dev32}, indent=1))
    same, firsts = agreement(dev32, cpu32)
    print(f"{args.device} float32 vs cpu float32: {same}/{len(PROMPTS)} identical; first differences {firsts}")
    same_auto, firsts_auto = agreement(dev_auto, cpu32)
    print(f"{args.device} auto dtype vs cpu float32: {same_auto}/{len(PROMPTS)} identical; first "
          f"differences {firsts_auto}")
    if same * 2 < len(PROMPTS):
        print(f"FAIL: fewer than half of the {args.device} float32 answers equal the CPU's")
        return 1
    # bf16 activations flip near-ties early; a broken kernel gives no common prefix at all.
    if sum(f >= 2 for f in firsts_auto) * 2 < len(PROMPTS):
        print(f"FAIL: fewer than half of the {args.device} default-dtype answers share 2 tokens with the CPU's")
        return 1
    print("ok")
    return 0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http(url: str, body: dict | None = None, timeout: float = 60.0) -> tuple[int, bytes]:
    req = urllib.request.Request(url, data=None if body is None else json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()
    except OSError:
        return 0, b""


def completion_ok(url: str, model: str, prompt: str, n: int) -> str:
    code, raw = http(f"{url}/v1/completions", {"model": model, "prompt": prompt, "max_tokens": n,
                                               "temperature": 0})
    if code != 200:
        raise SystemExit(f"POST /v1/completions: {code} {raw[:500]!r}")
    body = json.loads(raw)
    if body["usage"]["completion_tokens"] != n or not body["choices"][0]["text"]:
        raise SystemExit(f"POST /v1/completions: {body}")
    return body["choices"][0]["text"]


def serve_checks(url: str) -> None:
    code, raw = http(f"{url}/v1/models")
    if code != 200:
        raise SystemExit(f"GET /v1/models: {code} {raw[:500]!r}")
    model = json.loads(raw)["data"][0]["id"]
    print("completion:", repr(completion_ok(url, model, PROMPTS[0], 16)))
    code, raw = http(f"{url}/v1/completions", {"model": model, "prompt": PROMPTS[1], "max_tokens": 8,
                                               "temperature": 0, "stream": True})
    events = [ln for ln in raw.decode().splitlines() if ln.startswith("data: ")]
    if code != 200 or events[-1:] != ["data: [DONE]"] or len(events) < 3:
        raise SystemExit(f"streamed completion: {code} {raw[:800]!r}")
    print(f"streamed: {len(events) - 1} events")
    errors: list[BaseException] = []

    def one(i: int) -> None:
        try:
            completion_ok(url, model, PROMPTS[i % len(PROMPTS)], 24)
        except BaseException as exc:  # noqa: BLE001 - collected and reported below
            errors.append(exc)

    t = time.monotonic()
    threads = [threading.Thread(target=one, args=(i,)) for i in range(16)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    if errors:
        raise SystemExit(f"{len(errors)} of 16 concurrent completions failed: {errors[0]}")
    print(f"16 concurrent completions of 24 tokens: {time.monotonic() - t:.2f}s")


def shm(instance: str) -> list[str]:
    return sorted(n for n in os.listdir("/dev/shm") if f"pipeline.{instance}." in n)


def cmd_serve(args: argparse.Namespace) -> int:
    port, http_port = free_port(), free_port()
    argv = ["serve", "--device", args.device, "--listen", f"tcp://127.0.0.1:{port}",
            "--http", f"127.0.0.1:{http_port}"]
    print("pipeline", " ".join(argv))
    if args.dry:
        check_argv(argv)
        return 0
    log_path = Path(args.logs) / "serve_daemon.log"
    # gpu_check.sh's step timeout sends SIGTERM: stop the daemon (its own session) on the way out.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit("serve smoke: SIGTERM"))
    url = f"http://127.0.0.1:{http_port}"
    t = time.monotonic()
    with open(log_path, "w+") as log:
        proc = subprocess.Popen([*PIPELINE, *argv], stdout=log, stderr=subprocess.STDOUT, cwd=ROOT,
                                env=env(), start_new_session=True)
        instance = f"{proc.pid:x}"  # the gateway's pid names the instance
        try:
            while http(f"{url}/health", timeout=5)[0] != 200:
                if proc.poll() is not None or time.monotonic() - t > args.timeout:
                    raise SystemExit(f"daemon not ready (exit {proc.poll()}); log {log_path}")
                time.sleep(0.25)
            print(f"ready in {time.monotonic() - t:.1f}s")
            serve_checks(url)
        finally:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
            try:
                rc = proc.wait(30)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                rc = proc.wait()
            print(f"daemon exited {rc} after SIGTERM")
    left = shm(instance)
    if rc != 0 or left:
        print(f"FAIL: exit {rc}, /dev/shm left {left}; log {log_path}")
        return 1
    print("ok")
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="tools/gpu_smoke.py", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    sub.add_parser("argv").add_argument("pipeline_args", nargs=argparse.REMAINDER)
    for name in ("run", "serve"):
        sp = sub.add_parser(name)
        sp.add_argument("--device", default="cuda", choices=["cpu", "cuda"])
        sp.add_argument("--logs", default=".", help="folder for the runs' logs")
        sp.add_argument("--timeout", type=float, default=120.0, help="seconds per pipeline run / start")
        sp.add_argument("--dry", action="store_true", help="check the argv, run nothing")
    args = p.parse_args(argv)
    if args.command == "argv":
        print("would run: pipeline", " ".join(args.pipeline_args))
        check_argv(args.pipeline_args)
        return 0
    return cmd_run(args) if args.command == "run" else cmd_serve(args)


if __name__ == "__main__":
    raise SystemExit(main())
