"""Tensor parallelism across two "hosts" on loopback: `pipeline serve --nnodes 2 --node-rank 0`
(gateway, every stage, rank 0) and `pipeline serve --nnodes 2 --node-rank 1` (rank 1 only,
its plans from rank 0 over ZMQ: worker/remote_plan.py, gateway/worker_node.py). They decode
what one rank decodes; killing node 1 under load makes node 0 answer every request with an
error and exit non-zero within 10 s, and node 1 stops when node 0 stops; nodes started with
different flags refuse to start, naming the field."""
from __future__ import annotations

import concurrent.futures as cf
import json
import os
import random
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest
from e2e_helpers import ENGINE_FLAGS, PIPELINE, ROOT, Daemon, env, make_tiny_model, process_name, run_pipe, shm_entries

from pipeline.client import Client
from pipeline.ipc.sweep import sweep_stale

PROMPTS = [[(13 * i + 7 * j) % 1900 + 40 for j in range(20 + 9 * i)] for i in range(6)]


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tp-nodes") / "model")


def free_port_pair() -> int:
    """A --master-port whose + 1 (node 0's step-plan port) is free too, below the ephemeral
    range: a peer that connects (and retries) before node 0 binds can otherwise be given that
    very port as its source and connect to itself (TCP simultaneous open), taking the port
    node 0 then fails to bind (CI: "Address already in use")."""
    lo = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    rng = random.Random()
    while True:
        port = rng.randrange(10000, max(lo, 10002) - 2)
        try:
            with socket.socket() as a, socket.socket() as b:
                a.bind(("127.0.0.1", port))
                b.bind(("127.0.0.1", port + 1))
        except OSError:
            continue
        return port


class Node:
    """`pipeline serve --node-rank 1` in a subprocess."""

    def __init__(self, model: Path, port: int, *flags: str, env_extra: dict | None = None) -> None:
        self.log = open(f"/tmp/pipeline-e2e-node-{port}.log", "w+")
        self.proc = subprocess.Popen(
            [*PIPELINE, "serve", "--model", str(model), *ENGINE_FLAGS, "--tensor-parallel-size", "2",
             "--nnodes", "2", "--node-rank", "1", "--master-port", str(port), "--worker-threads", "1",
             *flags], stdout=self.log, stderr=subprocess.STDOUT, cwd=ROOT, env=env() | (env_extra or {}),
            start_new_session=True)
        self.instance_id = f"{self.proc.pid:x}"

    output = Daemon.output  # the same log file handling

    def wait(self, timeout: float) -> int:
        try:
            return self.proc.wait(timeout)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait()


def _pair(model: Path, node0_flags: tuple[str, ...] = (), node1_flags: tuple[str, ...] = ()) -> tuple[Daemon, Node]:
    port = free_port_pair()
    node1 = Node(model, port, *node1_flags)
    node0 = Daemon(model, "--tensor-parallel-size", "2", "--nnodes", "2", "--master-port", str(port),
                   "--worker-threads", "1", *node0_flags)
    return node0, node1


def test_two_nodes_decode_what_one_rank_decodes_and_stop_together(model):
    lines = [json.dumps({"id": i, "prompt_token_ids": p, "max_tokens": 24, "temperature": 0,
                         "ignore_eos": True}) for i, p in enumerate(PROMPTS)]
    rc, ref, err = run_pipe(model, lines, "--ordered")
    assert rc == 0, err
    node0, node1 = _pair(model)
    try:
        node0.wait_ready()
        with Client(node0.address, timeout=60) as c:
            got = [c.generate(prompt_token_ids=p, max_tokens=24, temperature=0, ignore_eos=True)
                   for p in PROMPTS]
        assert [list(r.token_ids) for r in got] == [a["token_ids"] for a in ref]
        assert process_name(node1.proc.pid) == "pl-node"
    finally:
        assert node0.stop() == 0, node0.output()
    assert node1.wait(30) == 0, node1.output()  # node 0 told it to stop
    assert "node 0 shut down" in node1.output()
    assert shm_entries(node0.instance_id) == [] and shm_entries(node1.instance_id) == []


def _kill_under_load(node0: Daemon, kill) -> float:
    """8 long requests; once node 0 has produced tokens, ``kill()``; every request must get an
    error answer. Returns when the kill happened."""
    with Client(node0.address, timeout=60) as c, cf.ThreadPoolExecutor(8) as pool:
        futures = [pool.submit(c.generate, prompt_token_ids=PROMPTS[i % 6], max_tokens=200,
                               temperature=0, ignore_eos=True, timeout=60) for i in range(8)]
        deadline = time.monotonic() + 60
        while not c.stats().get("generation_tokens"):
            assert time.monotonic() < deadline, "node 0 never stepped"
            time.sleep(0.05)
        killed = time.monotonic()
        kill()
        results = [f.result(timeout=30) for f in futures]
    assert all(r.error is not None for r in results), [r.error for r in results]
    return killed


def test_killing_node_1_under_load_fails_every_request_and_node_0(model):
    node0, node1 = _pair(model)
    try:
        node0.wait_ready()
        killed = _kill_under_load(node0, lambda: node1.proc.send_signal(signal.SIGKILL))
        assert node0.proc.wait(10 - (time.monotonic() - killed)) != 0
        assert time.monotonic() - killed < 10
        assert "tensor parallel: rank 0 on" in node0.output() and "lost the group" in node0.output()
    finally:
        node0.stop()
        node1.wait(5)
    assert shm_entries(node0.instance_id) == []
    # SIGKILL left node 1 no chance to unlink its KV segment; the next start on its host
    # sweeps what a dead owner left.
    sweep_stale()
    assert shm_entries(node1.instance_id) == []


def test_a_rank_killed_on_one_host_fails_the_instance_and_every_request(model):
    node0 = Daemon(model, "--tensor-parallel-size", "2", "--worker-threads", "1")
    try:
        node0.wait_ready()
        worker1 = node0.stage_pids()["worker1"]
        killed = _kill_under_load(node0, lambda: os.kill(worker1, signal.SIGKILL))
        assert node0.proc.wait(10 - (time.monotonic() - killed)) != 0
        assert "worker" in node0.output() and "died" in node0.output()
    finally:
        node0.stop()
    assert shm_entries(node0.instance_id) == []


def test_nodes_started_with_different_flags_refuse_to_start(model):
    node0, node1 = _pair(model, node1_flags=("--block-size", "32"))
    try:
        with pytest.raises(RuntimeError, match="daemon exited"):
            node0.wait_ready()
        assert "block_size" in node0.output() and "rank 1" in node0.output()
        assert node1.wait(30) == 2, node1.output()
    finally:
        node0.stop()
    assert shm_entries(node0.instance_id) == [] and shm_entries(node1.instance_id) == []
