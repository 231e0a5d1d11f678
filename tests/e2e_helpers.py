"""Helpers of the end-to-end tests (tests/test_e2e_*.py): a tiny checkpoint, `pipeline run`
as a subprocess, a `pipeline serve` daemon as a subprocess, and the /dev/shm check.

Everything here drives the real stage processes; nothing is mocked. Every `pipeline` command
started with ``env()`` gets SIGTERM when the process that started it dies
(PIPELINE_DIE_WITH, ``runtime.process.die_with_parent_env``), so a killed test run leaves no
daemon behind: start them from the main thread (the kernel watches the starting thread).
"""
from __future__ import annotations

import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

from pipeline.runtime.process import DIE_WITH_ENV

ROOT = Path(__file__).resolve().parent.parent
PIPELINE = [sys.executable, "-m", "pipeline"]
# Small and fast on 2 shared cores: the tests are about the processes, not the model.
ENGINE_FLAGS = ["--device", "cpu", "--dtype", "float32", "--max-num-seqs", "32",
                "--max-model-len", "256", "--num-blocks", "256"]


def make_tiny_model(out: Path, max_positions: int = 512) -> Path:
    """A random-initialised 2-layer Llama with its BPE tokenizer, via `pipeline make-model`
    (PIPELINE_E2E_MODEL=DIR runs the tests on that checkpoint instead)."""
    if os.environ.get("PIPELINE_E2E_MODEL"):
        return Path(os.environ["PIPELINE_E2E_MODEL"])
    if not (out / "config.json").exists():
        subprocess.run([*PIPELINE, "make-model", "--arch", "llama", "--out", str(out),
                        "--hidden-size", "64", "--num-layers", "2", "--num-heads", "4",
                        "--num-kv-heads", "2", "--intermediate-size", "128",
                        "--max-position-embeddings", str(max_positions), "--seed", "0"],
                       check=True, cwd=ROOT, capture_output=True, timeout=300)
    return out


def env() -> dict:
    e = dict(os.environ)
    e["PYTHONPATH"] = str(ROOT) + os.pathsep + e.get("PYTHONPATH", "")
    e.setdefault("OMP_NUM_THREADS", "1")
    e[DIE_WITH_ENV] = str(os.getpid())  # a `pipeline` command does not outlive this process
    return e


def run_pipe(model: Path, lines: list[str], *flags: str, timeout: float = 240) \
        -> tuple[int, list[dict], str]:
    p = subprocess.run([*PIPELINE, "run", "--model", str(model), *ENGINE_FLAGS, *flags],
                       input="\n".join(lines) + "\n", capture_output=True, text=True,
                       timeout=timeout, cwd=ROOT, env=env())
    answers = [json.loads(line) for line in p.stdout.splitlines() if line.strip()]
    return p.returncode, answers, p.stderr


def wait_for(cond, what: str, timeout: float = 30.0) -> None:
    """Poll a condition the system reaches by itself (no fixed sleep stands in for it)."""
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def alive(pid: int) -> bool:
    """Whether process ``pid`` runs (a zombie does not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except FileNotFoundError:
        return False


def process_name(pid: int) -> str:
    """What top, ps -o comm and `bench cpu` show for process ``pid`` (pipeline.ipc.prctl)."""
    with open(f"/proc/{pid}/comm") as f:
        return f.read().strip()


def shm_entries(instance_id: str) -> list[str]:
    want = f"pipeline.{instance_id}."
    return sorted(n for n in os.listdir("/dev/shm")
                  if n.startswith(want) or n.startswith("sem." + want))


class Daemon:
    """`pipeline serve` in a subprocess; `address` is where clients connect."""

    def __init__(self, model: Path, *flags: str, curve_keys: Path | None = None,
                 extra_env: dict | None = None, http: bool = False) -> None:
        self.port = free_port()
        self.address = f"tcp://127.0.0.1:{self.port}"
        # http=True: the OpenAI API too, on a free loopback port (`http_url`, e.g. for openai).
        self.http_url: str | None = None
        if http:
            http_port = free_port()
            self.http_url = f"http://127.0.0.1:{http_port}"
            flags = (*flags, "--http", f"127.0.0.1:{http_port}")
        # What a client needs to get in (CURVE daemons admit only known client keys).
        self.client_kw = {"curve_keys_dir": curve_keys} if curve_keys else {}
        if curve_keys:
            flags = (*flags, "--curve-keys", str(curve_keys))
        self.log = open(f"/tmp/pipeline-e2e-{self.port}.log", "w+")
        self.proc = subprocess.Popen(
            [*PIPELINE, "serve", "--model", str(model), "--listen", self.address,
             *ENGINE_FLAGS, *flags],
            stdout=self.log, stderr=subprocess.STDOUT, cwd=ROOT, env=env() | (extra_env or {}),
            start_new_session=True)  # its own process group, as under systemd
        # config_from_args names the instance after the gateway's pid.
        self.instance_id = f"{self.proc.pid:x}"

    def wait_ready(self, timeout: float = 120.0) -> None:
        from pipeline.client import Client

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"daemon exited {self.proc.returncode}:\n{self.output()}")
            if "serving on" in self.output():
                with Client(self.address, timeout=10, **self.client_kw) as c:
                    assert c.health().status == "ok"
                return
            time.sleep(0.2)
        raise TimeoutError(f"daemon not ready within {timeout}s:\n{self.output()}")

    def stage_pids(self) -> dict[str, int]:
        from pipeline.client import Client

        with Client(self.address, timeout=10, **self.client_kw) as c:
            return {s["stage"]: s["pid"] for s in c.health().detail["stages"]}

    def output(self) -> str:
        self.log.flush()
        self.log.seek(0)
        return self.log.read()

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 60.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            return self.proc.wait(timeout)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait()
            self.log.close()


class RouterProc:
    """`pipeline router --listen ADDR <flags>` in a subprocess, with its log."""

    def __init__(self, *flags: str, extra_env: dict | None = None) -> None:
        self.address = f"tcp://127.0.0.1:{free_port()}"
        self.log = open(f"/tmp/pipeline-router-{os.getpid()}-{free_port()}.log", "w+")
        self.proc = subprocess.Popen([*PIPELINE, "router", "--listen", self.address, *flags],
                                     stdout=self.log, stderr=subprocess.STDOUT, cwd=ROOT,
                                     env=env() | (extra_env or {}))

    def output(self) -> str:
        self.log.flush()
        self.log.seek(0)
        return self.log.read()

    def stop(self) -> int:
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(30)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait()
            self.log.close()


def pd_prompts(vocab: int, n: int = 64, seed: int = 0) -> list[list[int]]:
    """Mixed lengths: short ones, long ones (over 4 chunks of 32), and groups sharing a long
    prefix (prefix-cache hits on both sides once the first of a group has run)."""
    rng = random.Random(seed)
    shared = [[rng.randrange(3, vocab) for _ in range(96)] for _ in range(3)]
    out = []
    for i in range(n):
        if i % 4 == 0:
            length = rng.randrange(140, 200)  # 5 to 7 chunks
            out.append([rng.randrange(3, vocab) for _ in range(length)])
        elif i % 4 == 1:
            out.append(shared[i % 3] + [rng.randrange(3, vocab) for _ in range(rng.randrange(1, 40))])
        else:
            out.append([rng.randrange(3, vocab) for _ in range(rng.randrange(3, 60))])
    return out


def serving(model: Path | str, *flags: str, **kw: object) -> Iterator[Daemon]:
    """A module fixture's body: `pipeline serve` ready, then stopped by SIGTERM with exit 0 and
    no shared memory left behind."""
    d = Daemon(Path(model), *flags, **kw)  # type: ignore[arg-type]
    try:
        d.wait_ready()
        yield d
    finally:
        code = d.stop(signal.SIGTERM)
    assert code == 0
    assert shm_entries(d.instance_id) == []
