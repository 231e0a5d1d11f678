"""End to end, the daemon against clients that misbehave or stall: an oversized frame, a
duplicate id, a client process stopped (SIGSTOP) for longer than any idle time-out, a client
process killed (SIGKILL) with requests in flight. Real `pipeline serve` and client processes.

The daemon runs one sequence at a time (--max-num-seqs 1), so a client's requests queue up
behind each other: what a stall or a kill does to requests still in flight is observable.
"""
from __future__ import annotations

import json
import signal
import subprocess
import sys
import time

import pytest
import zmq
from e2e_helpers import ROOT, Daemon, env, make_tiny_model, shm_entries

from pipeline.client import Client
from pipeline.frontend import protocol as P
from pipeline.messages import RequestDelta, RequestResult

MAX_FRAME = 65536
MAX_TOKENS = 480
# The daemon used to drop a client it had not heard from for 5 s (CLIENT_IDLE_TIMEOUT_S):
# a stopped client is stopped for longer than that.
STOP_S = 7.0
# A client process: N requests at once over one AsyncClient; one JSON line per final answer.
CHILD = """
import asyncio, json, sys
from pipeline.client.async_client import AsyncClient

async def main(address, n, max_tokens):
    async with AsyncClient(address, timeout=60) as c:
        rs = await asyncio.gather(*(c.generate("x", id=f"s{i}", max_tokens=max_tokens,
                                               ignore_eos=True, temperature=0) for i in range(n)))
    for r in rs:
        print(json.dumps({"id": r.id, "finish_reason": r.finish_reason, "tokens": len(r.token_ids)}))

asyncio.run(main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3])))
"""


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.getbasetemp() / "e2e-tiny")  # one per session


@pytest.fixture(scope="module")
def daemon(model):
    d = Daemon(model, "--max-num-seqs", "1", "--max-model-len", "512",
               "--max-frame-bytes", str(MAX_FRAME))
    try:
        d.wait_ready()
        yield d
    finally:
        assert d.stop() == 0, d.output()
    assert shm_entries(d.instance_id) == []


def stats(d: Daemon) -> dict:
    with Client(d.address, timeout=30) as c:
        return c.stats()


def wait_stats(d: Daemon, done, timeout: float = 120.0) -> dict:
    """Poll the daemon's stats (a round trip each) until ``done(stats)``."""
    deadline = time.monotonic() + timeout
    with Client(d.address, timeout=30) as c:
        while not done(s := c.stats()):
            assert time.monotonic() < deadline, s
    return s


def idle(s: dict) -> bool:
    return (s["requests_inflight"], s["running"], s["waiting"], s["kv_blocks_used"]) == (0, 0, 0, 0)


def replies(sock: zmq.Socket, until) -> list:
    """Replies (pings left out) until ``until(replies)``; fails after 120 s of silence."""
    out: list = []
    while not until(out):
        assert sock.poll(120_000), out
        msg = P.decode_reply(sock.recv())
        if not isinstance(msg, P.Ping):
            out.append(msg)
    return out


def test_oversized_frame_is_answered_and_the_connection_lives(daemon):
    """Before: a frame over ZMQ_MAXMSGSIZE made libzmq drop the connection, and with it the
    client's other requests ("connection_lost")."""
    with Client(daemon.address, timeout=120) as c:
        stream = c.stream("x", max_tokens=MAX_TOKENS, ignore_eos=True, temperature=0)
        assert isinstance(next(stream), RequestDelta)  # running
        big = c.generate("y" * 2 * MAX_FRAME)  # over --max-frame-bytes, on the same connection
        assert big.finish_reason == "error" and big.error.code == "invalid_request", big
        assert "max_frame_bytes" in big.error.message and str(MAX_FRAME) in big.error.message
        final = list(stream)[-1]
        assert isinstance(final, RequestResult) and final.error is None, final
        assert len(final.token_ids) == MAX_TOKENS
        assert c.generate("z", max_tokens=3).finish_reason == "length"
    wait_stats(daemon, idle)


def test_duplicate_id_is_refused_without_touching_the_original(daemon):
    """Before: the refusal was a final keyed by the id in flight, so it read as the running
    request's answer (and that request then got a second final)."""
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.connect(daemon.address)
    try:
        sock.send(P.encode(P.Generate(id="d", prompt="x", max_tokens=MAX_TOKENS, ignore_eos=True,
                                      temperature=0, stream=True)))
        assert isinstance(replies(sock, len)[0], P.Delta)  # "d" is running
        sock.send(P.encode(P.Generate(id="d", prompt="again", max_tokens=3)))
        sock.send(P.encode(P.Generate(id="d", prompt="y" * 2 * MAX_FRAME)))  # oversized too
        # Both refusals and the original's one final, in whatever order a loaded machine
        # delivers them (the original may finish before the refusals are read).
        got = replies(sock, lambda r: any(isinstance(m, P.Final) for m in r)
                      and sum(isinstance(m, P.Error) for m in r) >= 2)
    finally:
        sock.close(0)
    errors = [m for m in got if isinstance(m, P.Error)]
    finals = [m.result for m in got if isinstance(m, P.Final)]
    assert [(e.id, e.error.code) for e in errors] == [(None, "duplicate_id"), (None, "invalid_request")], got
    assert "'d'" in errors[0].error.message and "max_frame_bytes" in errors[1].error.message
    assert len(finals) == 1 and finals[0].id == "d" and finals[0].error is None, finals
    assert len(finals[0].token_ids) == MAX_TOKENS
    s = wait_stats(daemon, idle)
    assert s["requests_rejected"]["duplicate_id"] >= 1


def child(d: Daemon, n: int) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", CHILD, d.address, str(n), str(MAX_TOKENS)], cwd=ROOT, env=env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_stopped_client_gets_every_answer(daemon):
    """Before: a client silent for 5 s (a stalled event loop, a stopped process) had its
    requests aborted while still connected, and then waited for answers that never came."""
    n = 24  # queued one after the other: still in flight long after the client stops
    before = stats(daemon)
    p = child(daemon, n)
    try:
        wait_stats(daemon, lambda s: s["requests_inflight"] == n)
        p.send_signal(signal.SIGSTOP)
        stopped = time.monotonic()
        wait_stats(daemon, idle)  # the daemon finished them all while the client was stopped
        time.sleep(max(0.0, STOP_S - (time.monotonic() - stopped)))  # the stall under test
        assert stats(daemon)["clients_dropped"] == before["clients_dropped"]
        p.send_signal(signal.SIGCONT)
        out, err = p.communicate(timeout=120)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    assert p.returncode == 0, err
    finals = [json.loads(line) for line in out.splitlines()]
    assert finals == [{"id": f"s{i}", "finish_reason": "length", "tokens": MAX_TOKENS}
                      for i in range(n)], err


def test_killed_client_requests_are_aborted_and_freed(daemon):
    n = 24
    before = stats(daemon)
    p = child(daemon, n)
    try:
        wait_stats(daemon, lambda s: s["requests_inflight"] == n)
        p.kill()
        p.wait()
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    # Every request answered (the answers are counted in the daemon's loop, a moment after
    # the gateway's in-flight count drops) and every block freed.
    answered = sum(before["requests_finished"].values()) + n
    after = wait_stats(daemon, lambda s: idle(s) and sum(s["requests_finished"].values()) == answered)
    aborted = after["requests_finished"]["abort"] - before["requests_finished"]["abort"]
    finished = after["requests_finished"]["length"] - before["requests_finished"]["length"]
    assert aborted >= 1 and aborted + finished == n, (aborted, finished)
    assert after["clients_dropped"] == before["clients_dropped"] + 1
    with Client(daemon.address, timeout=60) as c:
        assert c.generate("after", max_tokens=3).finish_reason == "length"
