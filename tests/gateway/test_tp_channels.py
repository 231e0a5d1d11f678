"""Issue 25 item 2: who tensor parallelism's channels let in (worker/remote_plan.py,
worker/tp_rendezvous.py).

- A peer that reaches node 0's step-plan port first and claims rank 1 (the old protocol's
  identity "1", or a hello naming rank 1 with a key it cannot know) gets no plan; the real
  node 1 still takes rank 1's place and the pair decodes what one rank decodes.
- With --curve-keys on both nodes the plans are CURVE-secured; node 1 without the keys is
  never welcomed: it never says ready, and fails naming the keys.
- --master-addr beyond loopback without keys is refused before anything starts.
- One host: nothing of the ranks' group listens beyond loopback (psutil).
- PlanSender itself: a wrong key, a replayed hello for a rank already in, and an oversized
  frame get nothing.
"""
from __future__ import annotations

import ipaddress
import json
import threading
from pathlib import Path

import psutil
import pytest
import zmq
from e2e_helpers import Daemon, make_tiny_model, run_pipe, shm_entries
from test_tp_nodes import PROMPTS, Node, free_port_pair
from zmq.utils.monitor import recv_monitor_message

from pipeline.client import Client
from pipeline.config import EngineConfig
from pipeline.ipc.curve import client_socket_setup, generate_keys
from pipeline.worker.remote_plan import PlanReceiver, PlanSender, hello

TIMEOUT = {"PIPELINE_TP_TIMEOUT_S": "20"}


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tp-channels") / "model")


def _reference(model: Path) -> list[list[int]]:
    lines = [json.dumps({"id": i, "prompt_token_ids": p, "max_tokens": 16, "temperature": 0,
                         "ignore_eos": True}) for i, p in enumerate(PROMPTS)]
    rc, ref, err = run_pipe(model, lines, "--ordered")
    assert rc == 0, err
    return [a["token_ids"] for a in ref]


def _generate(d: Daemon) -> list[list[int]]:
    with Client(d.address, timeout=60, **d.client_kw) as c:
        return [list(c.generate(prompt_token_ids=p, max_tokens=16, temperature=0,
                                ignore_eos=True).token_ids) for p in PROMPTS]


def _impostors(ctx: zmq.Context, port: int) -> list[zmq.Socket]:
    """Peers that reach the step-plan port before node 1 and claim rank 1."""
    socks = []
    for ident, msg in ((b"1", b"hello"), (None, b"hello 1 " + b"0" * 32)):
        s = ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.LINGER, 0)
        if ident:
            s.setsockopt(zmq.IDENTITY, ident)
        s.connect(f"tcp://127.0.0.1:{port + 1}")
        s.send(msg)
        socks.append(s)
    return socks


def test_a_peer_claiming_rank_1_first_gets_no_plan_and_node_1_still_serves(model):
    ref = _reference(model)
    ctx = zmq.Context()
    node0 = node1 = None
    try:
        port = free_port_pair()
        impostors = _impostors(ctx, port)  # they connect (and retry) before node 0 binds
        node0 = Daemon(model, "--tensor-parallel-size", "2", "--nnodes", "2", "--master-port",
                       str(port), "--worker-threads", "1", extra_env=TIMEOUT)
        node1 = Node(model, port)
        node0.wait_ready()
        assert _generate(node0) == ref
        assert node0.stop() == 0
        assert node1.wait(30) == 0, node1.output()  # node 0's stop reached node 1, sent with the plans
        # Every plan and the stop went out before node 0 exited; none of them to an impostor.
        assert [s.poll(0) for s in impostors] == [0, 0]
    finally:
        ctx.destroy(linger=0)
        if node0 is not None:
            node0.stop()
        if node1 is not None:
            node1.wait(5)
    assert shm_entries(node0.instance_id) == [] and shm_entries(node1.instance_id) == []


def test_curve_keys_secure_the_plans_and_a_node_without_them_is_never_ready(model, tmp_path):
    keys = generate_keys(tmp_path / "keys")
    ref = _reference(model)
    port = free_port_pair()
    node0 = Daemon(model, "--tensor-parallel-size", "2", "--nnodes", "2", "--master-port", str(port),
                   "--worker-threads", "1", curve_keys=keys, extra_env=TIMEOUT)
    node1 = Node(model, port, "--curve-keys", str(keys))
    try:
        node0.wait_ready()
        assert _generate(node0) == ref
    finally:
        assert node0.stop() == 0, node0.output()
        assert node1.wait(30) == 0, node1.output()

    # Node 0 with keys, node 1 without: node 1 joins the group but is never welcomed.
    port = free_port_pair()
    short = {"PIPELINE_TP_TIMEOUT_S": "5"}
    node0 = Daemon(model, "--tensor-parallel-size", "2", "--nnodes", "2", "--master-port", str(port),
                   "--worker-threads", "1", curve_keys=keys, extra_env=short)
    node1 = Node(model, port, env_extra=short)
    try:
        assert node1.wait(120) == 2
        out = node1.output()
        assert "did not take rank 1's step-plan hello" in out and "no --curve-keys" in out, out
        assert "ready:" not in out, out
        assert node0.proc.wait(120) != 0
        assert "did not ask for step plans" in node0.output()
    finally:
        node0.stop()


def test_master_addr_beyond_loopback_needs_keys_or_the_insecure_flag(tmp_path):
    cfg = EngineConfig.of(model="m", tensor_parallel_size=2, nnodes=2, master_addr="10.1.2.3",
                          master_port=29500)
    with pytest.raises(ValueError, match="--master-addr tcp://10.1.2.3:29500 is beyond loopback"):
        cfg.check()
    cfg.allow_insecure_network = True
    cfg.check()
    cfg.allow_insecure_network = False
    cfg.curve_keys = str(generate_keys(tmp_path / "keys"))
    cfg.check()


def _listening(pid: int) -> list[tuple[str, str, int]]:
    procs = [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)]
    return [(p.name(), c.laddr.ip, c.laddr.port) for p in procs
            for c in p.net_connections(kind="inet") if c.status == psutil.CONN_LISTEN]


def test_one_host_group_listens_on_loopback_only(model):
    d = Daemon(model, "--tensor-parallel-size", "2", "--worker-threads", "1")
    try:
        d.wait_ready()
        listening = _listening(d.proc.pid)
        # The gateway's --listen, the rendezvous store and gloo's pair listeners at least.
        assert len(listening) >= 3, listening
        assert all(ipaddress.ip_address(ip).is_loopback for _, ip, _ in listening), listening
    finally:
        assert d.stop() == 0, d.output()


def test_plan_sender_welcomes_only_the_rank_that_holds_its_key():
    port = free_port_pair()
    got: list = []
    t = threading.Thread(target=lambda: got.append(PlanSender("127.0.0.1", port, {1: "k" * 32}, 30)))
    t.start()
    ctx = zmq.Context()
    try:
        socks = []
        for msg in (b"x" * 100_000, hello(1, "w" * 32), hello(2, "k" * 32), b"hello 1"):
            s = ctx.socket(zmq.DEALER)
            s.setsockopt(zmq.LINGER, 0)
            s.connect(f"tcp://127.0.0.1:{port + 1}")
            s.send(msg)
            socks.append(s)
        real = PlanReceiver("127.0.0.1", port, 1, "k" * 32, 30)  # welcomed: the constructor returns
        t.join()
        replay = ctx.socket(zmq.DEALER)  # rank 1's place is taken: its own hello again gets nothing
        replay.setsockopt(zmq.LINGER, 0)
        replay.connect(f"tcp://127.0.0.1:{port + 1}")
        replay.send(hello(1, "k" * 32))
        sender = got[0]
        sender.close()  # the stop goes to rank 1's connection only
        assert real.recv() is None
        real.close()
        assert [s.poll(200) for s in (*socks, replay)] == [0] * 5
    finally:
        ctx.destroy(linger=0)


def test_with_keys_no_new_peer_gets_past_the_handshake_once_every_rank_is_in(tmp_path):
    keys = str(generate_keys(tmp_path / "keys"))
    port = free_port_pair()
    got: list = []
    t = threading.Thread(target=lambda: got.append(PlanSender("127.0.0.1", port, {1: "k" * 32}, 30, keys)))
    t.start()
    real = PlanReceiver("127.0.0.1", port, 1, "k" * 32, 30, keys)
    t.join()
    ctx = zmq.Context()
    try:  # the deployment's own client key, after the ranks are in: refused at the handshake
        late = ctx.socket(zmq.DEALER)
        late.setsockopt(zmq.LINGER, 0)
        client_socket_setup(late, keys)
        events = late.get_monitor_socket(zmq.EVENT_HANDSHAKE_FAILED_AUTH | zmq.EVENT_HANDSHAKE_SUCCEEDED)
        late.connect(f"tcp://127.0.0.1:{port + 1}")
        assert events.poll(30_000)
        assert recv_monitor_message(events)["event"] == zmq.EVENT_HANDSHAKE_FAILED_AUTH
        late.disable_monitor()
        events.close()
        got[0].close()
        assert real.recv() is None  # rank 1 itself still gets node 0's stop
        real.close()
    finally:
        ctx.destroy(linger=0)
