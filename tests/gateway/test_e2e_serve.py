"""End to end, the daemon: `pipeline serve` with its stage processes, driven by many clients.

The acceptance workload of issue 5, scaled down for CI; run the full size with
PIPELINE_E2E_REQUESTS=1000 PIPELINE_E2E_CONCURRENCY=64.
"""
from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import socket
import threading
import time
import urllib.request

import msgspec
import pytest
import zmq
from e2e_helpers import Daemon, free_port, make_tiny_model, run_pipe, shm_entries, wait_for
from prometheus_client.parser import text_string_to_metric_families

from pipeline.client import Client
from pipeline.client.async_client import AsyncClient
from pipeline.frontend import protocol as P
from pipeline.ipc.curve import client_socket_setup, generate_keys
from pipeline.messages import RequestResult

NUM_REQUESTS = int(os.environ.get("PIPELINE_E2E_REQUESTS", "96"))
CONCURRENCY = int(os.environ.get("PIPELINE_E2E_CONCURRENCY", "16"))
WORDS = "the for statement is used to iterate over the elements of a sequence".split()


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.getbasetemp() / "e2e-tiny")  # one per session


@pytest.fixture(scope="module")
def daemon(model, tmp_path_factory):
    # CURVE and Prometheus on: every test of the module goes through them.
    keys = generate_keys(tmp_path_factory.mktemp("keys") / "curve")
    d = Daemon(model, "--drain-timeout", "60", "--metrics-port", str(free_port()),
               curve_keys=keys)
    try:
        d.wait_ready()
        yield d
    finally:
        if d.proc.poll() is None:  # a -k run that skipped the drain test
            d.stop(signal.SIGTERM)
    assert shm_entries(d.instance_id) == []


def dealer(daemon: Daemon) -> zmq.Socket:
    """A raw protocol socket holding the client keys."""
    sock = zmq.Context.instance().socket(zmq.DEALER)
    client_socket_setup(sock, daemon.client_kw["curve_keys_dir"])
    sock.connect(daemon.address)
    return sock


def prompt_for(i: int) -> str:
    rng = random.Random(i)
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 40)))


MALFORMED = [
    {"max_tokens": 0},  # out of range
    {"top_p": 2.0},
    {"prompt_token_ids": [10**6]},  # out of the vocabulary
    {"prompt_token_ids": list(range(3, 303))},  # longer than --max-model-len 256
    {"messages": [{"role": "user", "content": "hi"}]},  # with a prompt too: two sources
]


async def one_request(c: AsyncClient, i: int) -> dict:
    """Returns what the test checks: kind, the final answer, deltas seen."""
    rid = f"r{i}"
    kind = ("malformed", "stream", "abort", "greedy", "greedy", "greedy", "greedy", "greedy")[i % 8]
    max_tokens = 4 + i % 21
    if kind == "malformed":
        fields = {"prompt": prompt_for(i), "max_tokens": 8} | MALFORMED[(i // 8) % len(MALFORMED)]
        if "prompt_token_ids" in fields:
            del fields["prompt"]
        prompt = fields.pop("prompt", None)
        return {"kind": kind, "final": await c.generate(prompt, id=rid, **fields)}
    if kind == "greedy":
        res = await c.generate(prompt_for(i), id=rid, max_tokens=max_tokens, temperature=0,
                               ignore_eos=True)
        return {"kind": kind, "final": res, "max_tokens": max_tokens}
    deltas, final = [], None
    aborted = False
    stream_max = 150 if kind == "abort" else max_tokens
    async for item in c.stream(prompt_for(i), id=rid, max_tokens=stream_max, temperature=0,
                               ignore_eos=True):
        if isinstance(item, RequestResult):
            final = item
        else:
            deltas.append(item)
            if kind == "abort" and not aborted and len(deltas) >= 2:
                await c.abort(rid)
                aborted = True
    return {"kind": kind, "final": final, "deltas": deltas, "max_tokens": stream_max}


async def run_workload(daemon: Daemon) -> tuple[list[dict], dict]:
    """NUM_REQUESTS requests from CONCURRENCY tasks sharing one AsyncClient."""
    c = AsyncClient(daemon.address, timeout=300, **daemon.client_kw)
    try:
        todo = iter(range(NUM_REQUESTS))
        results: dict[int, dict] = {}

        async def task() -> None:
            for i in todo:
                results[i] = await one_request(c, i)

        await asyncio.gather(*(task() for _ in range(CONCURRENCY)))
        # Aborted requests freed their blocks: all free or cached once idle. The engine
        # publishes stats a few times a second, hence the short wait for "idle".
        deadline = time.monotonic() + 10
        while True:
            stats = await c.stats()
            if stats.get("running") == 0 and stats.get("waiting") == 0 or time.monotonic() > deadline:
                break
            await asyncio.sleep(0.1)
    finally:
        await c.close()
    return [results[i] for i in range(NUM_REQUESTS)], stats


def test_acceptance_mixed_workload(daemon, model):
    results, stats = asyncio.run(run_workload(daemon))
    for i, r in enumerate(results):
        final = r["final"]
        assert final is not None and final.id == f"r{i}", r
        if r["kind"] == "malformed":
            assert final.finish_reason == "error" and final.error is not None, final
            assert final.error.code == "invalid_request" and "`" in final.error.message
        elif r["kind"] == "abort" and final.finish_reason != "abort":
            # The abort lost the race to the last token (a loaded machine): a whole answer.
            assert final.error is None and final.finish_reason == "length", final
        elif r["kind"] == "abort":
            assert final.error is not None and final.error.code == "aborted", final
            assert len(final.token_ids) < r["max_tokens"]
        else:
            assert final.error is None and final.finish_reason == "length", final
            assert len(final.token_ids) == r["max_tokens"]
        if r.get("deltas"):
            assert "".join(d.text for d in r["deltas"]) == final.text
            assert [t for d in r["deltas"] for t in d.token_ids] == final.token_ids
    assert any(r["kind"] == "abort" and r["final"].finish_reason == "abort" for r in results)
    assert stats["running"] == 0 and stats["waiting"] == 0, stats
    assert stats["kv_blocks_used"] == 0, stats
    assert stats["requests_inflight"] == 0, stats

    # Greedy answers through the daemon equal `pipeline run`'s for the same prompts.
    greedy = [(i, r) for i, r in enumerate(results) if r["kind"] in ("greedy", "stream")]
    lines = [json.dumps({"id": f"r{i}", "prompt": prompt_for(i), "max_tokens": r["max_tokens"],
                         "temperature": 0, "ignore_eos": True}) for i, r in greedy]
    rc, answers, err = run_pipe(model, lines)
    assert rc == 0, err
    piped = {a["id"]: a["token_ids"] for a in answers}
    for i, r in greedy:
        assert piped[f"r{i}"] == r["final"].token_ids, f"r{i}"


def test_malformed_frames_each_get_one_answer(daemon):
    sock = dealer(daemon)
    frames = [
        b"\xc1not msgpack",
        msgspec.msgpack.encode({"op": "generate", "v": 1, "id": "a", "prompt": "x",
                                "max_tokens": "many"}),
        msgspec.msgpack.encode({"op": "generate", "v": 99, "id": "b", "prompt": "x"}),
        msgspec.msgpack.encode({"op": "nonsense", "v": 1, "id": "c"}),
        msgspec.msgpack.encode({"op": "generate", "v": 1, "id": "d", "prompt": "x",
                                "surprise": True}),
        msgspec.msgpack.encode({"op": "generate", "v": 1, "id": "e", "prompt": "hello",
                                "max_tokens": 3, "temperature": 0}),
    ]
    for f in frames:
        sock.send(f)
    replies = []
    poller = zmq.Poller()
    poller.register(sock, zmq.POLLIN)
    deadline = time.monotonic() + 60
    while len(replies) < len(frames) and time.monotonic() < deadline:
        if poller.poll(500) and not isinstance(reply := P.decode_reply(sock.recv()), P.Ping):
            replies.append(reply)  # the daemon pings a client with requests in flight
    sock.close(0)
    finals = {r.result.id: r.result for r in replies if isinstance(r, P.Final)}
    errors = [r for r in replies if isinstance(r, P.Error)]
    assert len(replies) == len(frames), replies
    assert "msgpack" in errors[0].error.message if errors else False
    assert "max_tokens" in finals["a"].error.message
    assert finals["b"].error.code == "unsupported_version"
    assert "surprise" in finals["d"].error.message
    assert finals["e"].error is None and len(finals["e"].token_ids) == 3
    assert daemon.proc.poll() is None  # still serving


def test_curve_keys_and_prometheus(daemon, tmp_path):
    # A client with other keys is not let in.
    strangers = generate_keys(tmp_path / "other")
    with pytest.raises((TimeoutError, RuntimeError)):
        with Client(daemon.address, timeout=3, curve_keys_dir=strangers,
                    curve_server_key=daemon.client_kw["curve_keys_dir"] / "server.key") as c:
            c.health()
    port = int(daemon_flag(daemon, "--metrics-port"))

    def scrape() -> dict[tuple[str, str], float]:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as r:
            fams = text_string_to_metric_families(r.read().decode())
            return {(s.name, next(iter(s.labels.values()), "")): s.value for f in fams for s in f.samples}

    before = scrape()
    # One refused by the tokenizer's validation, one refused by the daemon, one malformed frame.
    with Client(daemon.address, timeout=60, **daemon.client_kw) as c:
        assert c.generate("x", temperature=500.0).error.code == "invalid_request"
        assert c.generate("x", max_tokens=2).finish_reason == "length"
    sock = dealer(daemon)
    sock.send(b"\xc1not msgpack")
    assert sock.poll(60_000) and isinstance(P.decode_reply(sock.recv()), P.Error)
    sock.close(0)
    after = scrape()

    def grew(name: str, label: str = "") -> float:
        return after[(name, label)] - before.get((name, label), 0.0)

    assert grew("pipeline_requests_rejected_total", "invalid_request") == 1
    assert grew("pipeline_requests_received_total") == 2
    assert grew("pipeline_malformed_frames_total") == 1
    assert grew("pipeline_requests_finished_total", "length") == 1
    assert after[("pipeline_requests_inflight", "")] == 0
    assert ("pipeline_clients_dropped_total", "") in after and after[("pipeline_kv_blocks_total", "")] > 0


def daemon_flag(daemon: Daemon, flag: str) -> str:
    args = daemon.proc.args
    return args[args.index(flag) + 1]


def test_client_gone_mid_request_aborts(daemon):
    """A client that vanishes (no bye, socket closed) gets its requests aborted, not leaked."""
    with Client(daemon.address, timeout=30, **daemon.client_kw) as c:
        dropped_before = c.stats()["clients_dropped"]
    sock = dealer(daemon)
    sock.send(P.encode(P.Generate(id="gone", prompt="x", max_tokens=240, temperature=0,
                                  ignore_eos=True, stream=True)))
    assert sock.poll(60_000), "no first delta"
    while isinstance(reply := P.decode_reply(sock.recv()), P.Ping):
        assert sock.poll(60_000), "no first delta"
    assert isinstance(reply, P.Delta)
    # The engine is held (SIGSTOP) while the client goes, so its request is certainly still
    # in flight when the daemon finds the client gone, whichever process the machine favours.
    engine = daemon.stage_pids()["engine"]
    os.kill(engine, signal.SIGSTOP)
    try:
        sock.close(0)  # ZMQ drops the peer; the daemon's next send (its ping) to it fails
        with Client(daemon.address, timeout=30, **daemon.client_kw) as c:
            wait_for(lambda: c.stats()["clients_dropped"] == dropped_before + 1,
                     "the daemon to find the client gone")
    finally:
        os.kill(engine, signal.SIGCONT)
    with Client(daemon.address, timeout=30, **daemon.client_kw) as c:
        wait_for(lambda: (s := c.stats())["requests_inflight"] == 0 and s["running"] == 0
                 and s["kv_blocks_used"] == 0, "its request aborted and its blocks freed", 20)


def test_sigterm_drains_then_exits_clean(daemon):
    """Last in the module: SIGTERM to the process group drains: in-flight requests finish,
    new ones are refused, shm is gone."""
    with Client(daemon.address, timeout=120, **daemon.client_kw) as c:
        running = threading.Semaphore(0)
        out: list[RequestResult] = []

        def long_one(i: int) -> None:
            first = True
            for item in c.stream("x", id=f"d{i}", max_tokens=250, temperature=0,
                                 ignore_eos=True):
                if first:
                    running.release()
                    first = False
                if isinstance(item, RequestResult):
                    out.append(item)

        threads = [threading.Thread(target=long_one, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        for _ in threads:
            assert running.acquire(timeout=60)  # all four are decoding
        # To the whole process group, as systemd's control-group kill, `timeout` or
        # `kill -TERM -PGID` send it: the stages must leave the drain to the gateway.
        os.killpg(daemon.proc.pid, signal.SIGTERM)
        while c.health(timeout=10).status != "draining":
            pass
        late = c.generate("too late", id="late", max_tokens=4)
        for t in threads:
            t.join(120)
    assert late.finish_reason == "error", late
    assert [r.finish_reason for r in out] == ["length"] * 4, out
    assert daemon.proc.wait(60) == 0, daemon.output()
    assert shm_entries(daemon.instance_id) == []


def test_systemd_notify_protocol(model, tmp_path):
    """Type=notify: READY=1 once serving, WATCHDOG=1 keep-alives, STOPPING=1 on SIGTERM."""
    path = str(tmp_path / "notify.sock")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(path)
    sock.settimeout(120)
    d = Daemon(model, extra_env={"NOTIFY_SOCKET": path, "WATCHDOG_USEC": "400000"})
    seen: list[str] = []
    try:
        while not any(m.startswith("READY=1") for m in seen):
            seen.append(sock.recv(4096).decode())
        while "WATCHDOG=1" not in seen:
            seen.append(sock.recv(4096).decode())
        d.proc.send_signal(signal.SIGTERM)
        while not any(m.startswith("STOPPING=1") for m in seen):
            seen.append(sock.recv(4096).decode())
        assert d.proc.wait(60) == 0, d.output()
    finally:
        if d.proc.poll() is None:
            d.stop(signal.SIGKILL)
        sock.close()
    assert seen[0].startswith("STATUS=") and "serving on" in next(m for m in seen if "READY=1" in m)
    assert shm_entries(d.instance_id) == []
