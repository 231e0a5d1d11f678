"""End to end, `pipeline router` over mixed replicas: two `pipeline serve` daemons on the tiny
model and a router subprocess in front of them, driven by the unchanged clients.

The instance SIGKILL test runs last: it kills and restarts one of the module's daemons.
"""
from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import msgspec
import pytest
import zmq
from e2e_helpers import (
    ENGINE_FLAGS,
    PIPELINE,
    ROOT,
    Daemon,
    RouterProc,
    env,
    free_port,
    make_tiny_model,
    process_name,
    shm_entries,
    wait_for,
)
from hypothesis import given
from hypothesis import strategies as st
from router_fakes import FakeInstance, delta, result

from pipeline.client import Client
from pipeline.client.async_client import AsyncClient
from pipeline.frontend import protocol as P
from pipeline.messages import RequestDelta, RequestResult
from pipeline.router.policy import MAX_IMBALANCE, PREFIX_BYTES, MixedPolicy
from pipeline.router.stats import merge

WORDS = "the for statement is used to iterate over the elements of a sequence".split()
PROMPTS = [" ".join(WORDS[i % 5:i % 5 + 3 + i % 7]) for i in range(12)]
LONG_PREFIX = " ".join(WORDS * 4)
# Stays in flight a while: the tests abort, drop or kill such requests mid-way, so they must
# not end first. A 2-layer model makes 200 tokens in well under a second on a loaded machine
# (both races were lost in CI); 2000 take several. The cluster runs them (CLUSTER_FLAGS).
LONG = {"max_tokens": 2000, "ignore_eos": True, "temperature": 0.0}
CLUSTER_FLAGS = ("--max-model-len", "2048", "--num-blocks", "1200")


class Router(RouterProc):
    """`pipeline router --instance ...` in a subprocess, with its log."""

    def __init__(self, *instances: str, extra_env: dict | None = None) -> None:
        super().__init__("--instance", *instances, extra_env=extra_env)

    def wait_listening(self, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while "serving on" not in self.output():
            assert self.proc.poll() is None, self.output()
            assert time.monotonic() < deadline, self.output()
            time.sleep(0.1)


def daemon_at(model: Path, port: int) -> Daemon:
    """A Daemon on a given port (a restarted instance keeps its address)."""
    d = Daemon.__new__(Daemon)
    d.port, d.address, d.client_kw = port, f"tcp://127.0.0.1:{port}", {}
    d.log = open(f"/tmp/pipeline-e2e-{port}-restart.log", "w+")
    d.proc = subprocess.Popen([*PIPELINE, "serve", "--model", str(model), "--listen", d.address,
                               *ENGINE_FLAGS, *CLUSTER_FLAGS], stdout=d.log, stderr=subprocess.STDOUT, cwd=ROOT,
                              env=env(), start_new_session=True)
    d.instance_id = f"{d.proc.pid:x}"
    return d


def received(d: Daemon) -> int:
    """Generates the daemon itself counted (which instance the router picked)."""
    with Client(d.address, timeout=10) as c:
        return int(c.stats()["requests_received"])


def instances_up(router: Router) -> dict[str, bool]:
    with Client(router.address, timeout=10) as c:
        return {a: i["up"] for a, i in c.health().detail["instances"].items()}


# ---- the policy and the stats merge, in-process ----

class FakeTarget:
    def __init__(self, address: str, load: int, free: float, tier: str = "") -> None:
        self.address, self._load, self._free, self._tier = address, load, free, tier

    def load(self) -> int:
        return self._load

    def free_share(self) -> float:
        return self._free

    def tier_group(self) -> str:
        return self._tier


@given(st.lists(st.tuples(st.lists(st.integers(0, 20), min_size=1, max_size=4),
                          st.sampled_from([None, b"k1", b"k2"])), min_size=1, max_size=30))
def test_policy_stays_within_the_imbalance_bound(steps):
    policy = MixedPolicy()
    for loads, key in steps:
        targets = [FakeTarget(f"i{n}", load, 0.5) for n, load in enumerate(loads)]
        chosen = policy.choose(targets, key)
        assert chosen in targets
        assert chosen.load() <= min(loads) + (MAX_IMBALANCE if key is not None else 0)
        if key is not None:
            assert policy.affinity[key] == (chosen.address, "")


def test_policy_keeps_a_prefix_on_its_instance_and_skips_full_ones():
    policy = MixedPolicy()
    a, b = FakeTarget("a", 0, 0.5), FakeTarget("b", 0, 0.5)
    first = policy.choose([a, b], b"p")
    assert all(policy.choose([a, b], b"p") is first for _ in range(5))
    assert {policy.choose([a, b], None).address for _ in range(4)} == {"a", "b"}  # round robin
    full = FakeTarget("full", 0, 0.01)
    assert policy.choose([full, FakeTarget("busy", 3, 0.5)], None).address == "busy"


def test_stats_merge_adds_counters_and_recomputes_ratios():
    one = {"kv_blocks_used": 1, "kv_blocks_total": 10, "kv_usage": 0.1, "timestamp": 5.0,
           "requests_finished": {"stop": 2}, "ttft": {"count": 1, "sum": 0.5, "buckets": {"1.0": 1}}}
    two = {"kv_blocks_used": 9, "kv_blocks_total": 10, "kv_usage": 0.9, "timestamp": 7.0,
           "requests_finished": {"stop": 1, "abort": 1}, "ttft": {"count": 2, "sum": 1.0, "buckets": {"1.0": 2}}}
    m = merge([one, two])
    assert m["kv_blocks_used"] == 10 and m["kv_blocks_total"] == 20 and m["kv_usage"] == 0.5
    assert m["timestamp"] == 7.0 and m["requests_finished"] == {"stop": 3, "abort": 1}
    assert m["ttft"] == {"count": 3, "sum": 1.5, "buckets": {"1.0": 3}}


# ---- the router alone ----

def test_bad_flags_and_busy_listen_exit_2_with_one_line():
    bad = subprocess.run([*PIPELINE, "router", "--listen", "nowhere", "--instance", "tcp://127.0.0.1:1"],
                         capture_output=True, text=True, cwd=ROOT, env=env(), timeout=60)
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1 and "--listen 'nowhere'" in bad.stderr
    dup = subprocess.run([*PIPELINE, "router", "--listen", "tcp://127.0.0.1:1", "--instance",
                          "tcp://127.0.0.1:2", "tcp://127.0.0.1:2"],
                         capture_output=True, text=True, cwd=ROOT, env=env(), timeout=60)
    assert dup.returncode == 2 and "given twice" in dup.stderr
    with zmq.Context.instance().socket(zmq.ROUTER) as taken:
        port = taken.bind_to_random_port("tcp://127.0.0.1")
        busy = subprocess.run([*PIPELINE, "router", "--listen", f"tcp://127.0.0.1:{port}",
                               "--instance", "tcp://127.0.0.1:2"],
                              capture_output=True, text=True, cwd=ROOT, env=env(), timeout=60)
    assert busy.returncode == 2 and busy.stderr.count("\n") == 1
    assert "cannot start: --listen" in busy.stderr and "in use" in busy.stderr


def test_no_instance_is_not_fatal_and_requests_get_unavailable(tmp_path):
    nobody = f"tcp://127.0.0.1:{free_port()}"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as systemd:
        systemd.bind(str(tmp_path / "notify"))
        systemd.settimeout(60)
        r = Router(nobody, extra_env={"NOTIFY_SOCKET": str(tmp_path / "notify")})
        try:
            assert b"READY=1" in systemd.recv(4096).split(b"\n")  # Type=notify
            assert process_name(r.proc.pid) == "pl-router"
            with Client(r.address, timeout=30) as c:
                assert c.health().status == "starting"
                res = c.generate("hello", max_tokens=2)
                assert res.error is not None and res.error.code == "unavailable"
                assert "no instance available" in res.error.message and nobody in res.error.message
                assert c.health().status == "starting"  # still up, still answering
        finally:
            assert r.stop() == 0
        while b"STOPPING=1" not in systemd.recv(4096).split(b"\n"):
            pass


# ---- two daemons and a router ----

@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.getbasetemp() / "router-tiny", max_positions=2048)


@pytest.fixture(scope="module")
def cluster(model):
    daemons = [Daemon(model, *CLUSTER_FLAGS), Daemon(model, *CLUSTER_FLAGS)]
    router: Router | None = None
    try:
        for d in daemons:
            d.wait_ready()
        router = Router(*(d.address for d in daemons))
        router.wait_listening()
        wait_for(lambda: all(instances_up(router).values()), "both instances up")
        yield router, daemons
    finally:
        if router is not None:
            assert router.stop() == 0, router.output()
        for d in daemons:
            if d.proc.poll() is None:
                assert d.stop() == 0
            assert shm_entries(d.instance_id) == []


async def _generate_all(address: str, prompts: list[str], **kw) -> list[RequestResult]:
    async with AsyncClient(address, timeout=120) as c:
        return await asyncio.gather(*(c.generate(p, **kw) for p in prompts))


def test_greedy_through_router_equals_one_daemon_and_both_get_work(cluster):
    router, (a, b) = cluster
    before = [received(a), received(b)]
    via_router = asyncio.run(_generate_all(router.address, PROMPTS, max_tokens=8, temperature=0.0))
    split = [received(a) - before[0], received(b) - before[1]]
    direct = asyncio.run(_generate_all(a.address, PROMPTS, max_tokens=8, temperature=0.0))
    assert [r.error for r in via_router] == [None] * len(PROMPTS)
    assert [(r.text, r.token_ids) for r in via_router] == [(r.text, r.token_ids) for r in direct]
    assert sum(split) == len(PROMPTS) and min(split) > 0, split


def test_64_mixed_length_prompts_through_router_equal_one_daemon(cluster, model):
    """Issue 10's acceptance over mixed replicas: the prompts of the disaggregated pair's
    parity test (long ones, shared long prefixes), greedy, through the router."""
    import json

    from e2e_helpers import pd_prompts as prompts

    GREEDY = {"max_tokens": 8, "temperature": 0.0, "ignore_eos": True}

    router, (a, _) = cluster
    ids = prompts(json.loads((model / "config.json").read_text())["vocab_size"])

    async def run(address: str) -> list[RequestResult]:
        async with AsyncClient(address, timeout=180) as c:
            return await asyncio.gather(*(c.generate(prompt_token_ids=p, **GREEDY) for p in ids))

    via_router, direct = asyncio.run(run(router.address)), asyncio.run(run(a.address))
    assert [r.error for r in via_router] == [None] * len(ids)
    assert [r.token_ids for r in via_router] == [r.token_ids for r in direct]


def test_repeated_long_prefix_goes_back_to_the_same_instance(cluster):
    router, daemons = cluster
    assert len(LONG_PREFIX.encode()) >= PREFIX_BYTES

    def counters() -> list[tuple[int, int]]:
        out = []
        for d in daemons:
            with Client(d.address, timeout=10) as c:
                s = c.stats()
            out.append((int(s["requests_received"]), int(s["prefix_cache_hit_tokens"])))
        return out
    before = counters()
    with Client(router.address, timeout=60) as c:
        for i in range(4):  # one at a time: equal loads, so only the prefix decides
            assert c.generate(f"{LONG_PREFIX} {WORDS[i]}", max_tokens=2).error is None
    after = counters()
    got = [x[0] - y[0] for x, y in zip(after, before, strict=True)]
    assert sorted(got) == [0, 4], got
    # and that instance served the prefix from its cache
    hits = [x[1] - y[1] for x, y in zip(after, before, strict=True)]
    assert hits[got.index(4)] > 0, hits


def test_stream_and_abort_through_the_router(cluster):
    router, _ = cluster
    with Client(router.address, timeout=60) as c:
        items = list(c.stream(PROMPTS[0], max_tokens=8, temperature=0.0))
        final = items[-1]
        assert isinstance(final, RequestResult) and final.error is None
        assert all(isinstance(x, RequestDelta) for x in items[:-1]) and len(items) > 1
        assert final.text == c.generate(PROMPTS[0], max_tokens=8, temperature=0.0).text
        it = c.stream(PROMPTS[1], id="to-abort", **LONG)
        assert isinstance(next(it), RequestDelta)
        c.abort("to-abort")
        rest = list(it)
        assert isinstance(rest[-1], RequestResult) and rest[-1].finish_reason == "abort"
        assert len(rest[-1].token_ids) < LONG["max_tokens"]


def test_health_and_stats_aggregate_the_instances(cluster):
    router, daemons = cluster
    with Client(router.address, timeout=30) as c:
        h = c.health()
        assert h.status == "ok" and set(h.detail["instances"]) == {d.address for d in daemons}
        stats = c.stats()
    each = []
    for d in daemons:
        with Client(d.address, timeout=30) as dc:
            each.append(dc.stats())
    assert stats["kv_blocks_total"] == sum(s["kv_blocks_total"] for s in each) > 0
    assert stats["requests_received"] == sum(s["requests_received"] for s in each)
    assert set(stats["instances"]) == {d.address for d in daemons}


def test_bad_frames_and_duplicate_ids_get_the_daemons_answers(cluster):
    router, _ = cluster
    with zmq.Context.instance().socket(zmq.DEALER) as s:
        s.setsockopt(zmq.RCVTIMEO, 60_000)  # a missing answer fails the test, never hangs it
        s.setsockopt(zmq.SNDTIMEO, 60_000)
        s.connect(router.address)
        s.send(b"\xc1 not msgpack")
        err = P.decode_reply(s.recv())
        assert isinstance(err, P.Error) and err.id is None and "msgpack" in err.error.message
        s.send(msgspec.msgpack.encode({"op": "generate", "v": 1, "id": "x", "max_tokens": "ten"}))
        bad = P.decode_reply(s.recv())
        assert isinstance(bad, P.Final) and bad.result.id == "x" and "max_tokens" in bad.result.error.message
        run = P.encode(P.Generate(id="d", prompt=PROMPTS[0], stream=True, **LONG))
        s.send(run)
        s.send(run)
        seen: list[P.ReplyMsg] = []
        while not any(isinstance(m, P.Error) for m in seen):
            seen.append(P.decode_reply(s.recv()))
        dup = next(m for m in seen if isinstance(m, P.Error))
        assert dup.error.code == "duplicate_id" and "'d'" in dup.error.message
        s.send(P.encode(P.Abort(id="d")))
        while not isinstance(m := P.decode_reply(s.recv()), P.Final):
            pass
        assert m.result.id == "d" and m.result.finish_reason == "abort"


def test_a_client_gone_aborts_its_requests_on_the_instances(cluster):
    router, daemons = cluster

    def aborted() -> int:
        total = 0
        for d in daemons:
            with Client(d.address, timeout=10) as c:
                total += int(c.stats()["requests_finished"].get("abort", 0))
        return total
    before = aborted()
    s = zmq.Context.instance().socket(zmq.DEALER)
    s.connect(router.address)
    s.setsockopt(zmq.RCVTIMEO, 60_000)
    for i in range(2):
        s.send(P.encode(P.Generate(id=f"g{i}", prompt=PROMPTS[i], stream=True, **LONG)))
    while True:  # the router's pings come too; then a Delta: one is running on an instance
        reply = P.decode_reply(s.recv())
        assert not isinstance(reply, P.Error), reply
        if isinstance(reply, P.Delta):
            break
    s.close(linger=0)
    # Both end as aborted on their instances, not run to max_tokens for nobody.
    wait_for(lambda: aborted() - before == 2, "the instances to abort the gone client's requests")


def test_sigterm_drains_the_router():
    """Over a scripted instance (``router_fakes``), so the request in flight ends when the test
    says: over a real one it could end, and the drained router exit, before the late request
    was sent (a race lost on a loaded machine: the late request then found nobody)."""
    inst = FakeInstance("mixed")
    r = Router(inst.address)

    def first_token() -> P.Generate:
        g = inst.expect(P.Generate, timeout=60)
        inst.send(delta(g.id, [7], " a"))
        return g

    try:
        with Client(r.address, timeout=60) as c, ThreadPoolExecutor(1) as pool:
            wait_for(lambda: c.health().status == "ok", "the router to see an instance")
            it = c.stream(PROMPTS[0], max_tokens=3, ignore_eos=True)
            running = pool.submit(first_token)
            assert next(it).token_ids == [7]  # sends the request; its first delta came back
            g = running.result(60)
            r.proc.send_signal(signal.SIGTERM)
            wait_for(lambda: c.health().status == "draining", "the router to drain")
            late = c.generate(PROMPTS[1], max_tokens=2)
            assert late.error is not None and late.error.code == "draining"
            assert inst.got.empty()  # the late one never reached the instance
            inst.send(P.Final(result=result(g.id, [7, 8, 9], " a b c")))
            final = list(it)[-1]  # the one in flight finishes
            assert isinstance(final, RequestResult) and final.error is None
            assert final.token_ids == [7, 8, 9]
    finally:
        assert r.proc.wait(30) == 0, r.output()
        r.log.close()
        inst.close()


async def _stream_until_started(c: AsyncClient, i: int, started: asyncio.Queue):
    first = True
    async for item in c.stream(PROMPTS[i], **LONG):
        if first:
            first = False
            await started.put(i)
        if isinstance(item, RequestResult):
            return item, time.monotonic()


def test_sigkill_of_an_instance_under_load(cluster, model):
    router, (a, b) = cluster
    n = 8

    async def run() -> tuple[list, float]:
        async with AsyncClient(router.address, timeout=120) as c:
            started: asyncio.Queue = asyncio.Queue()
            tasks = [asyncio.create_task(_stream_until_started(c, i, started)) for i in range(n)]
            async with asyncio.timeout(120):  # bounded: a request that never starts fails the test
                for _ in range(n):
                    await started.get()  # every request is running somewhere
            os.killpg(b.proc.pid, signal.SIGKILL)
            killed = time.monotonic()
            return await asyncio.wait_for(asyncio.gather(*tasks), 60), killed

    before = received(a)
    results, killed = asyncio.run(run())
    b.proc.wait(10)
    b.log.close()
    failed = [(r, t) for r, t in results if r.error is not None]
    ok = [r for r, _ in results if r.error is None]
    assert failed and ok and received(a) - before == len(ok)
    for r, t in failed:
        assert r.error.code == "instance_failed" and b.address in r.error.message
        assert t - killed < 5.0
    # Later requests go to the survivor, and succeed.
    res = asyncio.run(_generate_all(router.address, PROMPTS[:4], max_tokens=4))
    assert [r.error for r in res] == [None] * 4
    assert instances_up(router) == {a.address: True, b.address: False}
    # Restarted on the same address, the instance is used again.
    old = b.instance_id
    b2 = daemon_at(model, b.port)
    try:
        b2.wait_ready()
        assert shm_entries(old) == []  # the killed instance's debris, swept at start-up
        wait_for(lambda: instances_up(router)[b.address], "the restarted instance to be up")
        before_b2 = received(b2)
        res = asyncio.run(_generate_all(router.address, PROMPTS, max_tokens=4))
        assert [r.error for r in res] == [None] * len(PROMPTS)
        assert received(b2) > before_b2
    finally:
        assert b2.stop() == 0
    assert shm_entries(b2.instance_id) == []
