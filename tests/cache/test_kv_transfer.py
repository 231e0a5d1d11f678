"""KV transfer (pipeline/cache): ipc and tcp put exactly the right bytes into the right blocks
of a real second process's KV segment, the layout handshake refuses a different cache,
malformed tcp messages never stop the receiver, and the layer loop sends layer i only once
the (real, separate) publisher published it and fails the step when the publisher dies."""
from __future__ import annotations

import os
import pickle
import signal
import threading

import msgspec
import numpy as np
import pytest
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from ipc_procs import CTX

from pipeline.cache.messager import Messager
from pipeline.cache.tcp import (
    DATA,
    DONE,
    ERR,
    FLUSH,
    HELLO,
    OK,
    FlushAck,
    Hello,
    KVHeader,
    PeerInfo,
    TcpTransfer,
    host_identity,
)
from pipeline.cache.tcp_receiver import KVReceiver
from pipeline.cache.transfer import IpcTransfer, KVTransfer, KVTransferError
from pipeline.ipc.layer_signal import LayerSignal
from pipeline.ipc.segment import attach_segment, unlink_segment
from pipeline.messages.kv_layout import KVLayout, LayoutMismatch

LAYOUT = KVLayout(num_layers=3, num_blocks=16, block_size=4, num_kv_heads=2, head_dim=8,
                  dtype="float32", model_hash="tiny-0")
REMOTE = KVLayout(**{**{f: getattr(LAYOUT, f) for f in LAYOUT.__struct_fields__}, "num_blocks": 12})
WAIT = 60  # seconds a test waits on a child before calling it hung


# ---- child processes (forkserver: started clean, see ipc_procs) --------------------------
def _pool_of(kv) -> np.ndarray:
    import torch
    return kv.buffer.view(-1).view(torch.uint8).numpy()


def decode_side(instance_id: str, layout: KVLayout, conn, tcp: bool) -> None:
    """A decode instance: the worker's real KV cache, optionally a KVReceiver over it; serves
    "read" / "zero" / "rejected" until "stop"."""
    import torch

    from pipeline.worker.kv_cache import KVCache
    kv = KVCache(layout.num_layers, layout.num_blocks, layout.block_size, layout.num_kv_heads,
                 layout.head_dim, getattr(torch, layout.dtype), torch.device("cpu"), instance_id)
    pool = _pool_of(kv)
    rx = KVReceiver(pool, layout) if tcp else None
    try:
        conn.send((kv.shm_name, rx.endpoint if rx else None))
        while (cmd := conn.recv()) != "stop":
            if cmd == "read":
                conn.send_bytes(pool.tobytes())
            elif cmd == "zero":
                pool[:] = 0
                conn.send("ok")
            elif cmd == "rejected":
                conn.send(rx.rejected if rx else 0)
    finally:
        if rx is not None:
            rx.close()
        del pool
        kv.close()


def prefill_worker(instance_id: str, sig_name: str, layout: KVLayout, conn, steps: int,
                   gated: bool) -> None:
    """A prefill worker: writes each layer's KV into its real KV cache, then publishes the
    layer. `gated`: layer i of a step is written only after the test says "go"."""
    import torch

    from pipeline.worker.kv_cache import KVCache
    # Rank 1 only keeps its segment's name apart from the decode side's in the test's instance.
    kv = KVCache(layout.num_layers, layout.num_blocks, layout.block_size, layout.num_kv_heads,
                 layout.head_dim, getattr(torch, layout.dtype), torch.device("cpu"), instance_id,
                 rank=1)
    pool = layout.pool(_pool_of(kv))
    sig = LayerSignal.attach(sig_name)
    sig.claim_publisher()
    conn.send(kv.shm_name)
    for step in range(steps):
        for layer in range(layout.num_layers):
            if gated:
                conn.recv()
            pool[layer] = pattern(step, layer)
            sig.publish(step, layer)
    conn.recv()  # "stop": the test has read what it needs
    del pool
    kv.close()


def publisher_dies(sig_name: str, layers_before: int) -> None:
    sig = LayerSignal.attach(sig_name)
    sig.claim_publisher()
    for layer in range(layers_before):
        sig.publish(0, layer)
    os.kill(os.getpid(), signal.SIGKILL)


def pattern(step: int, layer: int) -> int:
    return (step * 16 + layer + 1) % 256


# ---- helpers --------------------------------------------------------------------------------
class DecodeProc:
    def __init__(self, inst, layout: KVLayout, tcp: bool) -> None:
        self.layout = layout
        self.conn, child = CTX.Pipe()
        self.proc = CTX.Process(target=decode_side, args=(inst.id, layout, child, tcp), daemon=True)
        self.proc.start()
        assert self.conn.poll(WAIT), "decode process did not start"
        self.shm_name, self.endpoint = self.conn.recv()

    def ask(self, cmd: str):
        self.conn.send(cmd)
        assert self.conn.poll(WAIT), f"decode process did not answer {cmd!r}"
        return self.conn.recv_bytes() if cmd == "read" else self.conn.recv()

    def pool(self) -> np.ndarray:
        return np.frombuffer(self.ask("read"), np.uint8).reshape(
            self.layout.num_layers, 2, self.layout.num_blocks, self.layout.block_bytes)

    def stop(self) -> None:
        self.conn.send("stop")
        self.proc.join(WAIT)
        assert self.proc.exitcode == 0


@pytest.fixture
def decode_ipc(inst):
    d = DecodeProc(inst, REMOTE, tcp=False)
    yield d
    d.stop()


@pytest.fixture
def decode_tcp(inst):
    d = DecodeProc(inst, REMOTE, tcp=True)
    yield d
    d.stop()


def expected(src: np.ndarray, layers: list[int], pairs: list[tuple[int, int]]) -> np.ndarray:
    """The oracle: block by block, what the remote pool must hold afterwards."""
    out = np.zeros((REMOTE.num_layers, 2, REMOTE.num_blocks, REMOTE.block_bytes), np.uint8)
    for layer in layers:
        for lo, ro in pairs:
            out[layer, :, ro] = src[layer, :, lo]
    return out


LAYERS = st.lists(st.integers(0, LAYOUT.num_layers - 1), min_size=1, max_size=3, unique=True)
# Sorted remote ids with runs, so contiguous runs on both sides (coalesced) occur often.
PAIRS = st.lists(st.tuples(st.integers(0, LAYOUT.num_blocks - 1), st.integers(0, REMOTE.num_blocks - 1)),
                 max_size=14, unique_by=lambda p: p[1])
EXAMPLES = settings(max_examples=25, deadline=None,
                    suppress_health_check=[HealthCheck.function_scoped_fixture])


def _round_trip(make, decode: DecodeProc, layers, pairs, seed) -> None:
    src_buf = np.random.default_rng(seed).integers(0, 256, LAYOUT.total_bytes, dtype=np.uint8)
    decode.ask("zero")
    t: KVTransfer = make(src_buf)
    try:
        sent = sum(t.send_layer(layer, pairs) for layer in layers)
        t.flush()
    finally:
        t.close()
    assert sent == 2 * len(layers) * len(pairs) * LAYOUT.block_bytes
    assert np.array_equal(decode.pool(), expected(LAYOUT.pool(src_buf), layers, pairs))


@EXAMPLES
@given(layers=LAYERS, pairs=PAIRS, seed=st.integers(0, 2**32 - 1))
def test_ipc_copies_exactly_the_given_blocks_into_another_process(decode_ipc, layers, pairs, seed):
    _round_trip(lambda buf: IpcTransfer(buf, LAYOUT, decode_ipc.shm_name, REMOTE),
                decode_ipc, layers, pairs, seed)


@EXAMPLES
@given(layers=LAYERS, pairs=PAIRS, seed=st.integers(0, 2**32 - 1))
def test_tcp_copies_exactly_the_given_blocks_into_another_process(decode_tcp, layers, pairs, seed):
    _round_trip(lambda buf: TcpTransfer(buf, LAYOUT, decode_tcp.endpoint), decode_tcp,
                layers, pairs, seed)


@pytest.mark.parametrize("bad", [(0, 16), (-1, 0), (0, 12), (3, -2)])
def test_block_ids_out_of_range_are_refused_naming_the_limit(decode_ipc, bad):
    t = IpcTransfer(bytes(LAYOUT.total_bytes), LAYOUT, decode_ipc.shm_name, REMOTE)
    try:
        with pytest.raises(ValueError, match=r"block -?\d+ out of range 0\.\.1[15]"):
            t.send_layer(0, [bad])
        with pytest.raises(ValueError, match=r"layer=3 out of range 0\.\.2"):
            t.send_layer(3, [(0, 0)])
        with pytest.raises(ValueError, match="remote block 5 written twice"):
            t.send_layer(0, [(0, 5), (1, 5)])
    finally:
        t.close()


# ---- handshake ------------------------------------------------------------------------------
DIFFERENT = [("block_size", 8), ("dtype", "float16"), ("num_kv_heads", 4), ("head_dim", 16),
             ("num_layers", 2), ("model_hash", "other-model")]


def _with(field: str, value) -> KVLayout:
    return KVLayout(**{**{f: getattr(LAYOUT, f) for f in LAYOUT.__struct_fields__}, field: value})


@pytest.mark.parametrize("field,value", DIFFERENT)
def test_ipc_refuses_a_different_layout_naming_both_values(decode_ipc, field, value):
    mine = _with(field, value)
    with pytest.raises(LayoutMismatch, match=f"{field}: local={value!r} remote={getattr(REMOTE, field)!r}"):
        IpcTransfer(bytes(mine.total_bytes), mine, decode_ipc.shm_name, REMOTE)


def test_ipc_refuses_a_segment_of_another_size(decode_ipc):
    bigger = KVLayout(**{**{f: getattr(REMOTE, f) for f in REMOTE.__struct_fields__}, "num_blocks": 13})
    with pytest.raises(LayoutMismatch, match=f"{REMOTE.total_bytes} bytes, its layout says {bigger.total_bytes}"):
        IpcTransfer(bytes(LAYOUT.total_bytes), LAYOUT, decode_ipc.shm_name, bigger)


@pytest.mark.parametrize("field,value", DIFFERENT)
def test_tcp_handshake_refuses_a_different_layout_and_keeps_serving(decode_tcp, field, value):
    mine = _with(field, value)
    with pytest.raises(ValueError, match=f"refused the handshake: KV layout mismatch on {field} "
                                         fr"\(this instance's: {field}={value!r}\)$") as e:
        TcpTransfer(bytes(mine.total_bytes), mine, decode_tcp.endpoint)
    # Only the field's name: nothing of the receiver's values (its model hash least of all).
    assert repr(getattr(REMOTE, field)) not in str(e.value).split("refused")[1]
    assert REMOTE.model_hash not in str(e.value)
    _round_trip(lambda buf: TcpTransfer(buf, LAYOUT, decode_tcp.endpoint), decode_tcp,
                [1], [(2, 3)], 0)
    assert decode_tcp.ask("rejected") == 1


# ---- malformed tcp messages -----------------------------------------------------------------
def _enc(obj) -> bytes:
    import msgspec
    return msgspec.msgpack.encode(obj)


BB = LAYOUT.block_bytes
MALFORMED_BEFORE_HELLO = [[DATA, _enc(KVHeader(0, 0, 1)), bytes(BB), bytes(BB)], [FLUSH, _enc(1)], [b"Z"],
                          [DONE, _enc(["r", 1, ""])]]
MALFORMED_AFTER_HELLO = [
    [b""], [b"ZZ", b"x"], [HELLO, b"\xc1garbage"], [HELLO, _enc({"num_layers": 3})],
    [HELLO, _enc(LAYOUT)],  # the old handshake, without the host
    [DATA, b"\x93", bytes(BB), bytes(BB)],  # truncated header
    [DATA, _enc(KVHeader(3, 0, 1)), bytes(BB), bytes(BB)],  # layer out of range
    [DATA, _enc(KVHeader(0, 11, 2)), bytes(2 * BB), bytes(2 * BB)],  # past the last block
    [DATA, _enc(KVHeader(0, -1, 1)), bytes(BB), bytes(BB)],
    [DATA, _enc(KVHeader(0, 0, 0)), b"", b""],
    [DATA, _enc(KVHeader(0, 0, 2)), bytes(BB), bytes(2 * BB)],  # K frame short
    [DATA, _enc(KVHeader(0, 0, 1)), bytes(BB)],  # V frame missing
    [DATA, bytes(1024 + 1), bytes(BB), bytes(BB)],  # oversized header
    [DATA, _enc(KVHeader(0, 0, 2**62)), bytes(BB), bytes(BB)],
    [DATA, _enc([0, [0, 1], [1, 1]]), bytes(BB), bytes(BB)],  # the old header, of several runs
    # more frames than the protocol's 4 (a second run): rejected whole, run 1 not written either
    [DATA, _enc(KVHeader(0, 0, 1)), bytes(range(256)) * (BB // 256), bytes(BB), bytes(BB), bytes(BB)],
    [FLUSH, b"not an int"],
    [DONE, _enc(["r", 1, ""])],  # well-formed, but this receiver takes no done messages
    [DONE, b"\xc1"],
]


def test_malformed_messages_are_rejected_and_the_receiver_keeps_serving(decode_tcp):
    ctx = zmq.Context()
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.connect(decode_tcp.endpoint)
    try:
        for frames in MALFORMED_BEFORE_HELLO:
            s.send_multipart(frames)
        # The flush without a handshake is answered at once (a restarted receiver), not ignored.
        assert s.poll(WAIT * 1000)
        assert s.recv_multipart() == [ERR, b"no handshake from this peer (receiver restarted?)"]
        s.send_multipart([HELLO, _enc(Hello(LAYOUT, host_identity()))])
        assert s.poll(WAIT * 1000)
        kind, body = s.recv_multipart()
        assert kind == OK
        info = __import__("msgspec").msgpack.decode(body, type=PeerInfo)
        assert (info.layout, info.same_host, info.segment) == (REMOTE, True, "")
        for frames in MALFORMED_AFTER_HELLO:
            s.send_multipart(frames)
        s.send_multipart([FLUSH, _enc(7)])
        assert s.poll(WAIT * 1000)
        kind, body = s.recv_multipart()
        ack = __import__("msgspec").msgpack.decode(body, type=FlushAck)
        assert (kind, ack.seq, ack.applied, ack.rejected) == (FLUSH, 7, 0, len(MALFORMED_AFTER_HELLO))
    finally:
        s.close()
        ctx.term()
    assert decode_tcp.ask("rejected") == len(MALFORMED_BEFORE_HELLO) + len(MALFORMED_AFTER_HELLO)
    assert not decode_tcp.pool().any()  # nothing malformed wrote a byte
    _round_trip(lambda buf: TcpTransfer(buf, LAYOUT, decode_tcp.endpoint), decode_tcp,
                [0, 2], [(0, 0), (1, 1), (9, 11)], 1)


def test_a_rejected_message_fails_the_senders_flush(decode_tcp):
    t = TcpTransfer(bytes(LAYOUT.total_bytes), LAYOUT, decode_tcp.endpoint)
    try:
        t.send_layer(0, [(0, 0)])
        t._sock.send_multipart([DATA, _enc(KVHeader(0, 11, 5)), bytes(5 * BB), bytes(5 * BB)])
        why = r"applied 1 of 1 messages, rejected 1: blocks 11\.\.15 out of range 0\.\.11"
        with pytest.raises(KVTransferError, match=why):
            t.flush()
        t.send_layer(1, [(0, 0)])
        t.flush()  # the counts restart after each flush
    finally:
        t.close()


# ---- the layer loop -------------------------------------------------------------------------
class Recording(KVTransfer):
    """Delegates to a real transfer; at each send notes what the publisher had published."""

    def __init__(self, inner: KVTransfer, sig: LayerSignal, step: int) -> None:
        self.inner, self.sig, self.step = inner, sig, step
        self.local, self.remote = inner.local, inner.remote
        self.sent: list[tuple[int, int]] = []  # (layer, that layer's last published step)
        self.sent_event = threading.Condition()

    def send_layer(self, layer, pairs):
        published = self.sig.published(layer)
        n = self.inner.send_layer(layer, pairs)
        with self.sent_event:
            self.sent.append((layer, published))
            self.sent_event.notify_all()
        return n

    def flush(self):
        self.inner.flush()

    def close(self):
        self.inner.close()


def test_layer_loop_sends_layer_i_only_after_the_publisher_published_it(inst, decode_ipc):
    L = LAYOUT.num_layers
    sig = LayerSignal.create(inst, "sig", L)
    conn, child = CTX.Pipe()
    pub = CTX.Process(target=prefill_worker, args=(inst.id, sig.name, LAYOUT, child, 2, True), daemon=True)
    pub.start()
    assert conn.poll(WAIT)
    prefill_name = conn.recv()
    prefill_seg = attach_segment(prefill_name)
    plan = {"a": [(0, 0), (1, 1), (2, 2)], "b": [(5, 7)], "c": [(15, 11), (14, 10)]}
    try:
        for step in range(2):
            rec = Recording(IpcTransfer(prefill_seg, LAYOUT, decode_ipc.shm_name, REMOTE), sig, step)
            out: list = []
            loop = threading.Thread(target=lambda s=step, r=rec, o=out: o.append(Messager(sig, r).run_step(s, plan)))
            loop.start()
            for layer in range(L):
                conn.send("go")  # the worker computes and publishes layer `layer`
                with rec.sent_event:
                    assert rec.sent_event.wait_for(lambda n=layer, r=rec: len(r.sent) > n, WAIT)
            loop.join(WAIT)
            rec.close()
            assert rec.sent == [(layer, step) for layer in range(L)]
            rep = out[0]
            assert (sorted(rep.done), rep.failed) == (["a", "b", "c"], {})
            assert rep.bytes == 2 * L * 6 * LAYOUT.block_bytes and len(rep.layer_send_s) == L
            got = decode_ipc.pool()
            for layer in range(L):
                for pairs in plan.values():
                    for _, ro in pairs:
                        assert (got[layer, :, ro] == pattern(step, layer)).all()
        conn.send("stop")
        pub.join(WAIT)
        assert pub.exitcode == 0
    finally:
        if pub.is_alive():  # a failed assertion above: the worker still waits for "go"
            pub.kill()
            pub.join(WAIT)
            unlink_segment(prefill_name)
        prefill_seg.close()
        sig.close()


def test_a_dead_publisher_fails_the_step_with_peer_died(inst, decode_ipc):
    sig = LayerSignal.create(inst, "sig", LAYOUT.num_layers)
    t = IpcTransfer(bytes(LAYOUT.total_bytes), LAYOUT, decode_ipc.shm_name, REMOTE)
    p = CTX.Process(target=publisher_dies, args=(sig.name, 1), daemon=True)
    p.start()
    out: list = []
    # A layer timeout far beyond the join bound: only PeerDied can end this step in time.
    messager = Messager(sig, t, layer_timeout_s=3600)
    loop = threading.Thread(target=lambda: out.append(messager.run_step(0, {"a": [(0, 0)], "b": [(1, 1)]})))
    loop.start()
    loop.join(WAIT)
    p.join(WAIT)
    t.close()
    sig.close()
    assert not loop.is_alive(), "the layer loop is still waiting on a dead publisher"
    rep = out[0]
    assert rep.done == [] and set(rep.failed) == {"a", "b"}
    assert all(why.startswith("PeerDied: ") and "died" in why for why in rep.failed.values())
    assert rep.layer_send_s and len(rep.layer_send_s) == 1  # layer 0 went before the death


def test_a_bad_request_fails_alone_and_every_request_gets_one_answer(inst, decode_ipc):
    sig = LayerSignal.create(inst, "sig", LAYOUT.num_layers)
    for layer in range(LAYOUT.num_layers):
        sig.publish(0, layer)
    t = IpcTransfer(bytes(LAYOUT.total_bytes), LAYOUT, decode_ipc.shm_name, REMOTE)
    plan = {"ok": [(0, 0)], "oob": [(0, 12)], "clash": [(3, 0)], "neg": [(-1, 3)], "ok2": [(4, 4)]}
    try:
        rep = Messager(sig, t).run_step(0, plan)
    finally:
        t.close()
        sig.close()
    assert sorted(rep.done) == ["ok", "ok2"]
    assert set(rep.failed) == {"oob", "clash", "neg"}
    assert "remote block 12 out of range 0..11" in rep.failed["oob"]
    assert "remote block 0 is also another request's" in rep.failed["clash"]


# ---- layout and coalescing ------------------------------------------------------------------
@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 40), st.integers(0, 40)), max_size=40, unique_by=lambda p: p[1]))
def test_runs_cover_exactly_the_pairs_and_are_maximal(pairs):
    from pipeline.cache.transfer import check_pairs, runs
    rs = runs(check_pairs(pairs, 41, 41))
    expanded = [(lo + i, ro + i) for lo, ro, n in rs for i in range(n)]
    assert sorted(expanded) == sorted(pairs)
    # maximal: no run continues, on both sides, into the next one
    assert not any((a[0] + a[2], a[1] + a[2]) == b[:2] for a, b in zip(rs, rs[1:]))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_layout_reads_the_workers_cache_as_the_worker_lays_it_out(inst, dtype):
    import torch

    from pipeline.runtime.spec import ModelInfo
    from pipeline.worker.kv_cache import KVCache
    kv = KVCache(3, 5, 4, 2, 8, getattr(torch, dtype), torch.device("cpu"), inst.id)
    info = ModelInfo(max_model_len=20, vocab_size=10, eos_token_ids=[0],
                     kv=msgspec.structs.replace(kv.layout, model_hash="m"), kv_segment=kv.shm_name)
    # What the messager gets: the ModelInfo as the control pipes carry it (runtime.process).
    layout = msgspec.convert(pickle.loads(pickle.dumps(msgspec.structs.asdict(info))), ModelInfo).kv
    assert (layout.block_bytes, layout.total_bytes) == (kv.layout.block_bytes, kv.layout.total_bytes)
    kv.buffer[2, 1, 3] = 1.0  # layer 2, V, block 3
    seg = attach_segment(kv.shm_name)
    pool = layout.pool(seg)
    nonzero = {tuple(int(x) for x in i[:3]) for i in np.argwhere(pool)}
    assert nonzero == {(2, 1, 3)}
    del pool
    seg.close()
    kv.close()


def test_a_stop_signal_raised_inside_wait_leaves_close_waiting_for_the_thread():
    """The decode messager stops on a signal whose handler raises while it sits in
    `rx.wait`. Python 3.11's Thread.join marks a live thread stopped when that happens
    (bpo-45274); close() then closed the sockets under the thread's poll and libzmq aborted
    the stage. wait() must still see the thread running, and close() must end it."""
    rx = KVReceiver(np.zeros(LAYOUT.total_bytes, np.uint8), LAYOUT)

    class Stop(Exception):
        pass

    def raise_stop(signum, frame):
        raise Stop

    old = signal.signal(signal.SIGALRM, raise_stop)
    try:
        signal.setitimer(signal.ITIMER_REAL, 0.05)
        with pytest.raises(Stop):
            rx.wait(WAIT)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
    try:
        assert not rx.wait(0), "the receiver thread is still serving: wait() must not say it ended"
    finally:
        rx.close()
    assert rx.wait(0) and rx.error is None
