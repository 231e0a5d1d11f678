"""Issue 25, items 3 and 4 on real processes: `pipeline router --curve-keys DIR` in front of
`pipeline serve --curve-keys DIR` daemons (the one key setup of a deployment), and what one
peer's oversized multipart messages make the daemon and the router hold (psutil RSS).

Before: the router refused --curve-keys ("cannot use keys yet") and showed a CURVE instance
as "not reached yet" forever; 6 x 100 MB took a daemon to 887 MB and 10 x 100 MB the router
to 1.13 GB.
"""
from __future__ import annotations

import shutil
import threading
import time
from pathlib import Path

import psutil
import pytest
import zmq
from e2e_helpers import Daemon, RouterProc, make_tiny_model, shm_entries, wait_for

from pipeline.client import Client
from pipeline.frontend import protocol as P
from pipeline.ipc.curve import client_socket_setup, generate_keys

BOUND = 200 << 20  # what an attack may add to a process's RSS
SEND_TIMEOUT_MS = 10_000  # one frame of the attack queued (SNDHWM 0), or the peer refused us
ANSWER_WAIT_S = 120.0


@pytest.fixture(scope="module")
def keys(tmp_path_factory) -> Path:
    return generate_keys(tmp_path_factory.mktemp("keys") / "deploy")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, keys):
    model = make_tiny_model(tmp_path_factory.getbasetemp() / "router-tiny", max_positions=2048)
    # The same server key, but its authorized_clients holds a stranger's key, not the router's.
    strict = tmp_path_factory.mktemp("keys") / "strict"
    shutil.copytree(keys, strict)
    for k in (strict / "authorized_clients").iterdir():
        k.unlink()
    stranger = generate_keys(tmp_path_factory.mktemp("keys") / "stranger")
    shutil.copy(stranger / "client.key", strict / "authorized_clients" / "stranger.key")
    good, refusing = Daemon(model, curve_keys=keys), Daemon(model, curve_keys=strict)
    router = None
    try:
        refusing.client_kw = {"curve_keys_dir": stranger, "curve_server_key": strict / "server.key"}
        good.wait_ready()
        refusing.wait_ready()
        router = RouterProc("--curve-keys", str(keys), "--instance", good.address, refusing.address)
        wait_for(lambda: "serving on" in router.output(), "the router listening", 60)
        yield router, good, refusing
    finally:
        if router is not None:
            assert router.stop() == 0, router.output()
        for d in (good, refusing):
            assert d.stop() == 0
            assert shm_entries(d.instance_id) == []


def instances(router: RouterProc, keys: Path) -> dict:
    with Client(router.address, timeout=10, curve_keys_dir=keys) as c:
        return c.health().detail["instances"]


def test_a_client_with_the_keys_is_served_through_curve_on_both_sides(cluster, keys):
    router, good, refusing = cluster
    wait_for(lambda: instances(router, keys)[good.address]["up"], "the CURVE instance up")
    with Client(router.address, timeout=60, curve_keys_dir=keys) as c:
        res = c.generate("the for statement", max_tokens=4, ignore_eos=True, temperature=0)
    assert res.error is None and len(res.token_ids) == 4
    with Client(good.address, timeout=10, curve_keys_dir=keys) as c:
        assert int(c.stats()["requests_received"]) >= 1  # it ran there


def test_an_instance_refusing_the_routers_keys_says_so(cluster, keys):
    router, _, refusing = cluster
    wait_for(lambda: "refused the router's CURVE keys" in (instances(router, keys)[refusing.address]
                                                             ["why_down"] or ""), "the refusal shown")
    assert not instances(router, keys)[refusing.address]["up"]


@pytest.mark.parametrize("who", ["no keys", "a stranger's keys"])
def test_a_client_without_the_keys_gets_nothing(cluster, tmp_path, who):
    router, _, _ = cluster
    kw = {} if who == "no keys" else {"curve_keys_dir": generate_keys(tmp_path / "k"),
                                      "curve_server_key": router_keys(cluster)}
    with Client(router.address, timeout=10, connect_timeout=5, **kw) as c:
        res = c.generate("hello", max_tokens=2)
    assert res.error is not None and res.error.code in ("handshake_failed", "unreachable"), res


def router_keys(cluster) -> Path:
    return Path(cluster[0].proc.args[cluster[0].proc.args.index("--curve-keys") + 1]) / "server.key"


# ---- item 4: memory before trust ----

def attack(address: str, frames: int, size: int, keys: Path | None) -> None:
    """Send one multipart message of ``frames`` x ``size`` bytes; return once the process
    dropped the connection, refused the handshake, or answered.

    Every wait is bounded. A DEALER's send blocks while it has no pipe to a peer, and libzmq
    removes the pipe for good when the server refuses the handshake (no keys against a CURVE
    server: no reconnect after a protocol error): on a loaded machine that refusal can come
    between two frames, and an unbounded send then waited forever (the 850 s hang of
    `pytest tests/router`). A send that times out means the peer took nothing more."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.SNDHWM, 0)
    sock.setsockopt(zmq.SNDTIMEO, SEND_TIMEOUT_MS)
    if keys is not None:
        client_socket_setup(sock, keys)
    mon = sock.get_monitor_socket(zmq.EVENT_DISCONNECTED | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
                                  | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_AUTH
                                  | zmq.EVENT_CONNECT_RETRIED | zmq.EVENT_CLOSED)
    try:
        sock.connect(address)
        payload = bytearray(size)  # one buffer, sent zero-copy `frames` times
        try:
            for i in range(frames):
                sock.send(payload, copy=False, flags=zmq.SNDMORE if i < frames - 1 else 0)
        except zmq.Again:
            assert keys is None, "a peer with the keys could not send its message"
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        poller.register(mon, zmq.POLLIN)
        deadline = time.monotonic() + ANSWER_WAIT_S
        while True:
            left = deadline - time.monotonic()
            events = dict(poller.poll(max(0, int(left * 1000))))
            assert events, f"neither an answer nor a dropped connection within {ANSWER_WAIT_S:g} s"
            if mon in events:
                return
            if not isinstance(P.decode_reply(sock.recv()), P.Ping):
                return
    finally:
        sock.disable_monitor()
        mon.close(0)
        sock.close(0)
        ctx.term()


def peak_rss_during(pid: int, work) -> tuple[int, int, int]:
    """(RSS before, peak RSS while ``work`` runs, RSS after) of process ``pid``."""
    proc = psutil.Process(pid)
    before = proc.memory_info().rss
    peak = [before]
    done = threading.Event()

    def sample() -> None:
        while not done.wait(0.01):
            peak[0] = max(peak[0], proc.memory_info().rss)

    t = threading.Thread(target=sample)
    t.start()
    try:
        work()
    finally:
        done.set()
        t.join()
    return before, peak[0], proc.memory_info().rss


@pytest.mark.parametrize("target,frames,size", [("daemon", 6, 100_000_000), ("router", 10, 100_000_000),
                                                ("router", 6, 12 << 20)])
@pytest.mark.parametrize("keyed", [True, False])
def test_oversized_multipart_messages_leave_rss_bounded_and_serving(cluster, keys, target, frames, size, keyed):
    """6 x 12 MiB frames are each under the frame limit: read whole, refused (one frame per
    message), and released at once. 100 MB frames end the connection unread. A peer
    without the keys never gets past the handshake."""
    router, good, _ = cluster
    proc = router if target == "router" else good
    address = router.address if target == "router" else good.address
    before, peak, after = peak_rss_during(proc.proc.pid, lambda: attack(address, frames, size,
                                                                       keys if keyed else None))
    assert peak - before < BOUND, (before, peak)
    assert after - before < BOUND // 4, (before, after)
    with Client(address, timeout=60, curve_keys_dir=keys) as c:
        assert c.generate("hello", max_tokens=2, ignore_eos=True).error is None
