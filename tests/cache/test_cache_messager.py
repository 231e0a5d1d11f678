"""The cache messager stage (pipeline/cache/stage.py) as the gateway runs it: real stage
processes (``spawn_stage``, the 'spawn' context) over real rings, real shared-memory KV pools
and a real LayerSignal that this test publishes like the prefill worker. Blocks land in the
decode pool over ipc and tcp, a done message becomes KVReady with the token, a dead or absent
peer fails only its own sends (and its KVFinish becomes nothing, or the error), a different
model or layout is refused at the handshake, malformed frames and ring messages never stop
a messager, a dead worker fails the step, a dead engine stops the stage with EXIT_PEER_DIED,
and nothing is left in /dev/shm (the ``inst`` fixture checks)."""
from __future__ import annotations

import multiprocessing as mp
import os
import socket

import msgspec
import numpy as np
import pytest
import zmq
from ipc_procs import CTX

from pipeline.cache.link import KVLink, LinkCache
from pipeline.cache.stage import run as stage_run
from pipeline.cache.tcp import DONE, ERR, FLUSH, HELLO, OK, FlushAck, Hello, PeerInfo, host_identity
from pipeline.cache.tcp_receiver import KVReceiver
from pipeline.cache.transfer import KVTransferError
from pipeline.config import EngineConfig
from pipeline.ipc.layer_signal import LayerSignal
from pipeline.ipc.ring import Ring
from pipeline.ipc.segment import unlink_name
from pipeline.messages.kv import KVFinish, KVReady, KVSend, TransferPlan, TransferReport, pairs_to_bytes
from pipeline.messages.kv_layout import KVLayout
from pipeline.runtime.lifecycle import Stage, spawn_stage, wait_ready
from pipeline.runtime.process import EXIT_PEER_DIED, STOP_SIGNAL
from pipeline.runtime.ring_sizes import capacity
from pipeline.runtime.rings import Channel, message_limits
from pipeline.runtime.spec import ModelInfo, StageSpec

PREFILL = KVLayout(num_layers=3, num_blocks=16, block_size=4, num_kv_heads=2, head_dim=8,
                   dtype="float32", model_hash="tiny")
DECODE = msgspec.structs.replace(PREFILL, num_blocks=12)
L, BB = PREFILL.num_layers, PREFILL.block_bytes
VOCAB = 100
WAIT = 60  # seconds before a wait is called hung
SPAWN = mp.get_context("spawn")
LIMITS = message_limits(EngineConfig(), 64)


def val(step: int, layer: int, block: int, kv: int) -> int:
    """What the prefill "worker" writes: distinct per step, layer, block and K/V."""
    return (step * 37 + layer * 11 + block * 3 + kv * 101 + 1) % 256


def model_info(layout: KVLayout, segment: str | None) -> ModelInfo:
    return ModelInfo(max_model_len=64, vocab_size=VOCAB, eos_token_ids=[0], kv=layout,
                     kv_segment=segment)


def channel(inst, role: str, tag: str, mine: str) -> Channel:
    """A ring the gateway would create; this test holds the `mine` end."""
    return Channel(Ring.create(inst, f"{role}.{tag}", capacity(LIMITS[role]), role=mine), role)  # type: ignore[arg-type]


class Messager:
    """One messager stage process, plus its KV pool and the rings its engine would hold."""

    def __init__(self, inst, tag: str, spec: StageSpec, pool: KVLayout) -> None:
        self.stage: Stage = spawn_stage(SPAWN, spec)
        self.pool = pool
        self.info = wait_ready([self.stage], WAIT)

    def stop(self) -> int | None:
        if self.stage.process.is_alive():
            os.kill(self.stage.process.pid, STOP_SIGNAL)  # type: ignore[arg-type]
        self.stage.process.join(WAIT)
        return self.stage.process.exitcode

    def kill(self) -> None:
        self.stage.process.kill()
        self.stage.process.join(WAIT)


class Pool:
    def __init__(self, inst, tag: str, layout: KVLayout) -> None:
        self.seg = inst.create_segment(f"kv.{tag}", layout.total_bytes)
        self.name = self.seg.name
        self.view = layout.pool(self.seg)

    def close(self) -> None:
        del self.view
        self.seg.close()


class Decode(Messager):
    def __init__(self, inst, tag: str, layout: KVLayout = DECODE, listen: str = "tcp://127.0.0.1:0") -> None:
        self.kv = Pool(inst, tag, layout)
        self.ready = channel(inst, "kv_ready", tag, "reader")
        spec = StageSpec(name=f"messager-{tag}", kind="messager",
                         config=EngineConfig.of(role="decode", kv_listen=listen),
                         rings={"kv_ready": self.ready.ring.name}, model=model_info(layout, self.kv.name),
                         ring_timeout_s=0.2)
        super().__init__(inst, tag, spec, layout)
        self.endpoint = self.info["kv_endpoint"]

    def close(self) -> None:
        self.stop()
        self.ready.close()
        self.kv.close()


class Prefill(Messager):
    def __init__(self, inst, mode: str = "auto", timeout_s: float = 2.0) -> None:
        self.kv = Pool(inst, "p", PREFILL)
        self.sig = LayerSignal.create(inst, "layers", L)  # this process publishes, as the worker
        self.plans = channel(inst, "kv_plans", "p", "writer")
        self.reports = channel(inst, "kv_reports", "p", "reader")
        spec = StageSpec(name="messager-p", kind="messager",
                         config=EngineConfig.of(role="prefill", kv_transfer=mode, kv_transfer_timeout=timeout_s),
                         rings={"kv_plans": self.plans.ring.name, "kv_reports": self.reports.ring.name,
                                "layers": self.sig.name},
                         model=model_info(PREFILL, self.kv.name), ring_timeout_s=0.2)
        super().__init__(inst, "p", spec, PREFILL)

    def compute(self, step: int) -> None:
        """The worker's step: each layer's KV written, then published."""
        for layer in range(L):
            for kv in (0, 1):
                self.kv.view[layer, kv] = np.array([val(step, layer, b, kv) for b in range(PREFILL.num_blocks)],
                                                   np.uint8)[:, None]
            self.sig.publish(step, layer)

    def step(self, step: int, sends: list[KVSend]) -> TransferReport:
        self.plans.send(TransferPlan(step, sends))
        self.compute(step)
        return self.reports.recv(timeout=WAIT)

    def close(self) -> None:
        self.stop()
        for ch in (self.plans, self.reports):
            ch.close()
        self.sig.close()
        self.kv.close()


@pytest.fixture
def procs(inst):
    made: list = []
    yield made
    for m in made:
        if m.stage.process.is_alive():
            m.kill()
        m.close()


def send(req: str, peer: str, remote: str, pairs) -> KVSend:
    return KVSend(req, peer, remote, pairs_to_bytes(pairs))


def expect(pool: np.ndarray, step: int, pairs) -> None:
    for layer in range(L):
        for kv in (0, 1):
            for lo, ro in pairs:
                assert (pool[layer, kv, ro] == val(step, layer, lo, kv)).all(), (step, layer, kv, lo, ro)


def untouched(pool: np.ndarray, written: set[int]) -> None:
    rest = sorted(set(range(pool.shape[2])) - written)
    assert not pool[:, :, rest].any()


def closed_port() -> str:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return f"tcp://127.0.0.1:{port}"


# ---- the whole path -----------------------------------------------------------------------
@pytest.mark.parametrize("mode,listen,kind", [("ipc", "ipc", "ipc"), ("auto", "tcp", "ipc"), ("tcp", "tcp", "tcp")])
def test_blocks_land_in_the_decode_pool_and_done_becomes_kv_ready(inst, procs, tmp_path, capfd, mode, listen, kind):
    d = Decode(inst, "d", listen=f"ipc://{tmp_path}/kv.sock" if listen == "ipc" else "tcp://127.0.0.1:0")
    procs.append(d)
    p = Prefill(inst, mode, timeout_s=10.0)  # no time-out is under test here: load must not fail it
    procs.append(p)
    ep = d.endpoint
    # Step 0: two requests' first chunks; step 1: the first request's next block.
    r0 = p.step(0, [send("p1", ep, "d1", [(0, 5), (1, 6)]), send("p2", ep, "d2", [(7, 0)])])
    assert (r0.step_id, r0.failed, r0.bytes) == (0, {}, 2 * L * 3 * BB)
    r1 = p.step(1, [send("p1", ep, "d1", [(2, 7)])])
    assert (r1.step_id, r1.failed, r1.bytes) == (1, {}, 2 * L * BB)
    p.plans.send(KVFinish("p1", ep, "d1", 42))
    p.plans.send(KVFinish("p2", ep, "d2", 7))
    assert d.ready.recv(timeout=WAIT) == KVReady("d1", 42, "")
    assert d.ready.recv(timeout=WAIT) == KVReady("d2", 7, "")
    expect(d.kv.view, 0, [(0, 5), (1, 6), (7, 0)])
    expect(d.kv.view, 1, [(2, 7)])
    untouched(d.kv.view, {0, 5, 6, 7})
    assert (p.stop(), d.stop()) == (0, 0)  # STOP_SIGNAL: a clean exit
    assert f"KV link to {ep}: {kind}" in capfd.readouterr().err


def test_peers_fail_alone_and_their_finish_carries_the_error(inst, procs, capfd):
    good = Decode(inst, "good")  # same host: ipc
    procs.append(good)
    far = Decode(inst, "far")  # its segment gone from /dev/shm: auto falls back to tcp
    procs.append(far)
    unlink_name(far.kv.name, "shm")
    other = Decode(inst, "other", layout=msgspec.structs.replace(DECODE, model_hash="another-model"))
    procs.append(other)
    p = Prefill(inst, "auto")
    procs.append(p)
    absent = closed_port()
    g, f = good.endpoint, far.endpoint
    rep = p.step(0, [
        send("a", g, "ra", [(0, 0), (1, 1)]),
        send("b", f, "rb", [(2, 3)]),
        send("gone", absent, "rg", [(3, 4)]),
        send("bad", g, "rbad", [(4, 12)]),  # remote block past the decode pool
        send("clash", g, "rclash", [(5, 1)]),  # remote block 1 is also "a"'s
        send("wrong", other.endpoint, "rw", [(6, 2)]),
        send("nowhere", "udp://x", "rn", [(8, 8)]),
        KVSend("odd", g, "ro", b"\x00" * 7),
        send("twice", g, "rt1", [(9, 9)]), send("twice", g, "rt2", [(10, 10)]),
    ])
    assert set(rep.failed) == {"gone", "bad", "clash", "wrong", "nowhere", "odd", "twice"}
    assert absent in rep.failed["gone"] and "is not listening (connection refused)" in rep.failed["gone"]
    assert "remote block 12 out of range 0..11" in rep.failed["bad"]
    assert "remote block 1 is also another request's" in rep.failed["clash"]
    assert "KV layout mismatch on model_hash (this instance's: model_hash='tiny')" in rep.failed["wrong"]
    assert "another-model" not in rep.failed["wrong"]  # the receiver's value stays there
    assert "peer='udp://x' must be tcp://HOST:PORT or ipc://PATH" in rep.failed["nowhere"]
    assert "pairs of 7 bytes" in rep.failed["odd"]
    assert "listed twice" in rep.failed["twice"]
    assert rep.bytes == 2 * L * 3 * BB
    expect(good.kv.view, 0, [(0, 0), (1, 1)])
    untouched(good.kv.view, {0, 1})
    expect(far.kv.view, 0, [(2, 3)])
    untouched(far.kv.view, {3})
    untouched(other.kv.view, set())
    # Finishes: the unreachable peer's is dropped (logged), a failed transfer's carries its
    # error, a finish without a token an error too; the stage goes on.
    for fin in (KVFinish("gone", absent, "rg", 1), KVFinish("bad", g, "rbad", 5),
                KVFinish("nowhere", "udp://x", "rn", 1), KVFinish("a", g, "ra", 9),
                KVFinish("clash", g, "rclash", 3, "engine: aborted"), KVFinish("b", f, "rb", -1)):
        p.plans.send(fin)
    bad = good.ready.recv(timeout=WAIT)
    assert (bad.req_id, bad.token) == ("rbad", -1) and "remote block 12 out of range 0..11" in bad.error
    assert good.ready.recv(timeout=WAIT) == KVReady("ra", 9, "")
    assert good.ready.recv(timeout=WAIT) == KVReady("rclash", -1, "engine: aborted")
    nothing = far.ready.recv(timeout=WAIT)
    assert (nothing.req_id, nothing.token) == ("rb", -1) and "without a first token" in nothing.error
    assert good.ready.try_recv() is None and other.ready.try_recv() is None
    # Within the retry window the absent peer is refused at once, with its first error.
    rep = p.step(1, [send("gone2", absent, "rg2", [(0, 0)]), send("a2", g, "ra2", [(2, 2)])])
    assert set(rep.failed) == {"gone2"} and "not retried for" in rep.failed["gone2"]
    assert [m.stop() for m in (p, good, far, other)] == [0, 0, 0, 0]
    err = capfd.readouterr().err
    assert f"KV link to {g}: ipc" in err and f"KV link to {f}: tcp" in err
    assert "udp://x unreachable" in err


def test_a_dead_peer_fails_its_own_sends_over_ipc_and_tcp(inst, procs):
    a = Decode(inst, "a")  # ipc
    procs.append(a)
    b = Decode(inst, "b")
    procs.append(b)
    p = Prefill(inst, "auto")
    procs.append(p)
    unlink_name(b.kv.name, "shm")  # tcp to b
    ea, eb = a.endpoint, b.endpoint
    assert p.step(0, [send("a", ea, "ra", [(0, 0)]), send("b", eb, "rb", [(1, 1)])]).failed == {}
    b.kill()
    rep = p.step(1, [send("a", ea, "ra", [(2, 2)]), send("b", eb, "rb", [(3, 3)])])
    assert set(rep.failed) == {"b"} and rep.failed["b"].startswith(f"KV peer {eb}: KVTransferError")
    expect(a.kv.view, 1, [(2, 2)])
    a.kill()  # ipc: the copy still "works", the flush round trip finds the peer dead
    rep = p.step(2, [send("a", ea, "ra", [(4, 4)])])
    assert set(rep.failed) == {"a"} and rep.failed["a"].startswith(f"KV peer {ea}: KVTransferError")
    # The monitor, not a reply time-out: the cached link found gone before use and the new
    # connect refused at once, or (when the disconnect reaches the monitor only after that
    # check, on a busy machine) the link's probe flush ended by the disconnect.
    assert ("is not listening (connection refused)" in rep.failed["a"]
            or "disconnected (its instance stopped or died)" in rep.failed["a"]), rep.failed["a"]
    # Its finish: the link was dropped, reconnecting fails; logged, never a hang or a crash.
    p.plans.send(KVFinish("a", ea, "ra", 1))
    assert p.step(3, []).failed == {}
    assert p.stop() == 0


# ---- the worker and the engine die ---------------------------------------------------------
def claim_and_exit(name: str, kind: str, end: str) -> None:
    if kind == "signal":
        LayerSignal.attach(name).claim_publisher()
    else:
        Ring.attach(name, end)  # type: ignore[arg-type]


def _die(name: str, kind: str, end: str = "reader") -> None:
    c = CTX.Process(target=claim_and_exit, args=(name, kind, end), daemon=True)
    c.start()
    c.join(WAIT)
    assert c.exitcode == 0


def test_a_dead_worker_or_a_layer_timeout_fails_the_whole_step(inst, procs):
    d = Decode(inst, "d")
    procs.append(d)
    p = Prefill(inst, "tcp")
    procs.append(p)
    ep = d.endpoint
    # Layer 0 of step 0 published, then nothing: the layer time-out (2 s) fails the step.
    p.plans.send(TransferPlan(0, [send("a", ep, "ra", [(0, 0)]), send("b", ep, "rb", [(1, 1)])]))
    p.sig.publish(0, 0)
    rep = p.reports.recv(timeout=WAIT)
    assert set(rep.failed) == {"a", "b"} and all(w.startswith("TimeoutError: ") for w in rep.failed.values())
    # The worker (the signal's publisher) dies: the step fails at once with PeerDied.
    _die(p.sig.name, "signal")
    p.plans.send(TransferPlan(1, [send("a", ep, "ra", [(0, 0)])]))
    rep = p.reports.recv(timeout=WAIT)
    assert list(rep.failed) == ["a"] and rep.failed["a"].startswith("PeerDied: ") and "died" in rep.failed["a"]
    p.sig.claim_publisher()  # a publisher again: transfers work again on the same link
    assert p.step(2, [send("a", ep, "ra", [(0, 0)])]).failed == {}
    expect(d.kv.view, 2, [(0, 0)])
    assert p.stop() == 0


def test_a_dead_engine_stops_both_messagers_with_exit_peer_died(inst, procs):
    d = Decode(inst, "d")
    procs.append(d)
    p = Prefill(inst, "tcp")
    procs.append(p)
    _die(d.ready.ring.name, "ring", "reader")  # the decode engine: kv_ready's reader
    _die(p.plans.ring.name, "ring", "writer")  # the prefill engine: kv_plans' writer
    for m in (d, p):
        m.stage.process.join(WAIT)
        assert m.stage.process.exitcode == EXIT_PEER_DIED


# ---- malformed input -----------------------------------------------------------------------
def _enc(obj) -> bytes:
    return msgspec.msgpack.encode(obj)


BAD_DONES = [
    [DONE, b"\xc1"], [DONE, _enc(["", 1, ""])], [DONE, _enc(["x" * 257, 1, ""])],
    [DONE, _enc(["r", VOCAB, ""])],  # token beyond the vocabulary
    [DONE, _enc(["r", -1, ""])],  # neither a token nor an error
    [DONE, _enc(["r", 2**40, ""])], [DONE, _enc(["r", -2, "e"])], [DONE, _enc(["r", -1, "e" * 4097])],
    [DONE, _enc(["r", 1, ""]), b"extra"], [DONE, _enc({"req_id": "r"})],
]


def test_malformed_frames_never_stop_the_decode_messager(inst, procs):
    d = Decode(inst, "d")
    procs.append(d)
    ctx = zmq.Context()
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.connect(d.endpoint)
    try:
        s.send_multipart([DONE, _enc(["early", 1, ""])])  # before the handshake
        s.send_multipart([HELLO, _enc(Hello(msgspec.structs.replace(PREFILL, block_size=8), host_identity()))])
        assert s.poll(WAIT * 1000)
        kind, why = s.recv_multipart()
        assert (kind, why) == (ERR, b"KV layout mismatch on block_size")  # names, no values
        s.send_multipart([HELLO, _enc(Hello(PREFILL, "another-boot/another-host"))])
        assert s.poll(WAIT * 1000)
        kind, body = s.recv_multipart()
        info = msgspec.msgpack.decode(body, type=PeerInfo)  # another host: no segment, no host
        assert kind == OK and (info.layout, info.same_host, info.segment) == (DECODE, False, "")
        assert d.kv.name.encode() not in body and host_identity().split("/")[0].encode() not in body
        s.send_multipart([HELLO, _enc(Hello(PREFILL, host_identity()))])
        assert s.poll(WAIT * 1000)
        kind, body = s.recv_multipart()
        info = msgspec.msgpack.decode(body, type=PeerInfo)
        assert kind == OK and (info.layout, info.same_host, info.segment) == (DECODE, True, d.kv.name)
        for frames in BAD_DONES:
            s.send_multipart(frames)
        s.send_multipart([DONE, _enc(["good", 3, ""])])
        s.send_multipart([DONE, _enc(["bad", -1, "boom"])])
        assert d.ready.recv(timeout=WAIT) == KVReady("good", 3, "")
        assert d.ready.recv(timeout=WAIT) == KVReady("bad", -1, "boom")
        assert d.ready.try_recv() is None  # nothing malformed became a KVReady
        s.send_multipart([FLUSH, _enc(1)])
        assert s.poll(WAIT * 1000)
        kind, body = s.recv_multipart()
        ack = msgspec.msgpack.decode(body, type=FlushAck)
        assert (kind, ack.applied, ack.rejected) == (FLUSH, 0, len(BAD_DONES))
    finally:
        s.close()
        ctx.term()
    assert d.stage.process.is_alive() and d.stop() == 0


def test_malformed_ring_messages_never_stop_the_prefill_messager(inst, procs):
    d = Decode(inst, "d")
    procs.append(d)
    p = Prefill(inst, "tcp", timeout_s=10.0)
    procs.append(p)
    for raw in (b"", b"\x63garbage", bytes([11]) + b"\xc1", bytes([12]) + _enc(["x"])):
        p.plans.ring.send(raw)
    p.plans.send(KVFinish("x", d.endpoint, "r" * 300, 1))  # remote id over the limit
    assert p.step(0, [send("a", d.endpoint, "ra", [(0, 0)])]).failed == {}
    p.plans.send(KVFinish("a", d.endpoint, "ra", 5))
    assert d.ready.recv(timeout=WAIT) == KVReady("ra", 5, "")
    assert p.stop() == 0


# ---- start-up ------------------------------------------------------------------------------
def test_refuses_to_start_without_a_shared_memory_kv_pool(inst):
    spec = StageSpec(name="m", kind="messager", config=EngineConfig.of(role="decode", kv_listen="tcp://127.0.0.1:0"),
                     rings={}, model=model_info(DECODE, None))
    with pytest.raises(ValueError, match=r"exported no KV cache \(ModelInfo.kv_segment is None and "
                                         r"ModelInfo.kv_cuda_ipc is empty\)"):
        stage_run(spec, lambda info: None)
    ok = msgspec.structs.replace(spec, model=model_info(DECODE, "/pipeline.x.kv"))
    with pytest.raises(ValueError, match=r"cache messager \(decode\): spec.rings lacks kv_ready"):
        stage_run(ok, lambda info: None)
    with pytest.raises(ValueError, match="only prefill and decode"):
        stage_run(msgspec.structs.replace(spec, config=EngineConfig()), lambda info: None)


# ---- the link, in process -----------------------------------------------------------------
@pytest.fixture
def decode_pool(inst):
    pool = Pool(inst, "dl", DECODE)
    yield pool
    pool.close()


def _receiver(pool: Pool, host: str | None = None, layout: KVLayout = DECODE) -> KVReceiver:
    return KVReceiver(pool.seg, layout, segment=pool.name, host=host)


def test_link_takes_ipc_only_on_the_same_host_and_a_mappable_segment(decode_pool):
    src = np.random.default_rng(0).integers(0, 256, PREFILL.total_bytes, dtype=np.uint8)
    here = _receiver(decode_pool)
    there = _receiver(decode_pool, host="another-boot/another-host")
    try:
        for rx, mode, kind in ((here, "auto", "ipc"), (here, "ipc", "ipc"), (here, "tcp", "tcp"),
                               (there, "auto", "tcp")):
            decode_pool.view[:] = 0
            link = KVLink(src, PREFILL, rx.endpoint, mode)
            try:
                assert link.kind == kind
                link.send_layer(2, [(3, 4), (4, 5)])
                link.flush()
            finally:
                link.close()
            assert np.array_equal(decode_pool.view[2, :, 4:6], PREFILL.pool(src)[2, :, 3:5])
            untouched(decode_pool.view[:2], set())
        elsewhere = "kv_transfer=ipc to .* impossible: it runs on another host"
        with pytest.raises(KVTransferError, match=elsewhere):
            KVLink(src, PREFILL, there.endpoint, "ipc")
        with pytest.raises(KVTransferError, match="impossible: it names this instance's own KV segment"):
            KVLink(src, PREFILL, here.endpoint, "ipc", local_segment=decode_pool.name)
    finally:
        here.close()
        there.close()


@pytest.mark.parametrize("field,value", [("model_hash", "another-model"), ("block_size", 8),
                                         ("dtype", "float16"), ("num_layers", 2)])
def test_link_handshake_refuses_another_model_or_layout(decode_pool, field, value):
    rx = _receiver(decode_pool)
    mine = msgspec.structs.replace(PREFILL, **{field: value})
    try:
        with pytest.raises(ValueError, match=f"refused the handshake: KV layout mismatch on {field} "
                                             fr"\(this instance's: {field}={value!r}\)$"):
            KVLink(bytes(mine.total_bytes), mine, rx.endpoint, "auto")
        # The receiver thread counts a rejection after its reply: a later round trip orders it.
        KVLink(bytes(PREFILL.total_bytes), PREFILL, rx.endpoint, "tcp").close()
        assert rx.rejected == 1
    finally:
        rx.close()


def test_link_cache_keeps_the_most_recent_links(inst):
    pools = [Pool(inst, f"lru{k}", DECODE) for k in range(3)]
    rxs = [_receiver(pool) for pool in pools]
    made: list[KVLink] = []

    def connect(peer: str) -> KVLink:
        made.append(KVLink(bytes(PREFILL.total_bytes), PREFILL, peer))
        return made[-1]

    cache = LinkCache(connect, max_links=2)
    try:
        a, b, c = (rx.endpoint for rx in rxs)
        assert cache.get(a) is cache.get(a)
        cache.get(b)
        cache.get(a)  # a is now the most recent: c evicts b
        cache.get(c)
        assert len(cache) == 2 and len(made) == 3
        with pytest.raises(KVTransferError, match="is closed"):
            made[1].flush()  # b's link was closed on eviction
        made[0].flush()
        made[2].flush()
        cache.drop(a)
        assert cache.get(a) is made[3]
    finally:
        cache.close()
        for rx in rxs:
            rx.close()
        for pool in pools:
            pool.close()

