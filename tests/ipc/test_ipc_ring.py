"""SPSC ring and doorbell: cross-process integrity, wrap, limits, peer death, wait_any."""
from __future__ import annotations

import os
import signal

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pipeline.ipc import PeerDied
from pipeline.ipc.instance import Instance, list_entries
from pipeline.ipc.ring import Doorbell, Ring, wait_any

from ipc_procs import CTX, NO_RESCUE, payload
from ipc_procs import ring_endless_writer as _endless_writer
from ipc_procs import ring_exit_after_attach as _exit_after_attach
from ipc_procs import ring_idle_reader as _idle_reader
from ipc_procs import ring_multi_writer as _multi_writer
from ipc_procs import ring_writer as _writer

@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(sizes=st.lists(st.integers(0, 2048), min_size=1, max_size=400),
       seed=st.integers(0, 2**31), spin_us=st.sampled_from([0.0, 20.0]))
def test_cross_process_stream_is_lossless_and_ordered(sizes, seed, spin_us):
    with Instance() as inst:
        ring = Ring.create(inst, "s", 4096, role="reader", spin_us=spin_us, slice_s=NO_RESCUE,
                           claim=True)
        p = CTX.Process(target=_writer, args=(ring.name, sizes, seed, spin_us), daemon=True)
        p.start()
        for i, n in enumerate(sizes):
            assert ring.recv(timeout=20) == payload(seed, i, n), f"message {i}"
        p.join(20)
        assert p.exitcode == 0
        assert ring.try_recv() is None
        ring.close()
    assert list_entries(inst.id) == []


def test_wraps_and_rejects_oversize_naming_the_limit(inst):
    w = Ring.create(inst, "w", 1024)
    r = Ring.attach(w.name, "reader")
    assert w.max_message == 512
    for i in range(300):  # 300 x up to 512 bytes through 1 KiB: wraps at every offset
        msg = payload(7, i, (i * 37) % 513)
        w.send(msg, timeout=0)
        assert r.recv(timeout=0) == msg
    with pytest.raises(ValueError, match="513 bytes exceeds the limit of 512 bytes"):
        w.send(b"x" * 513)
    w.send(b"")
    assert r.recv() == b""
    with pytest.raises(ValueError, match="capacity=1000"):
        Ring.create(inst, "bad", 1000)


def test_full_ring_and_empty_ring_time_out(inst):
    w = Ring.create(inst, "t", 1024, spin_us=0)
    r = Ring.attach(w.name, "reader", spin_us=0)
    with pytest.raises(TimeoutError, match="no message"):
        r.recv(timeout=0.05)
    assert r.try_recv() is None
    w.send(b"a" * 500)
    w.send(b"b" * 400)
    with pytest.raises(TimeoutError, match="no space"):
        w.send(b"c" * 200, timeout=0.05)
    assert r.recv() == b"a" * 500
    w.send(b"c" * 200, timeout=0)
    assert [r.recv(), r.recv()] == [b"b" * 400, b"c" * 200]
    w.close()
    with pytest.raises(ValueError, match="closed"):
        w.send(b"x")


def test_writer_killed_mid_stream_raises_peer_died(inst):
    ring = Ring.create(inst, "k", 4096, role="reader", claim=True)
    p = CTX.Process(target=_endless_writer, args=(ring.name,), daemon=True)
    p.start()
    for i in range(200):
        assert ring.recv(timeout=20) == i.to_bytes(8, "little") * 8
    os.kill(p.pid, signal.SIGKILL)
    got = 200
    with pytest.raises(PeerDied, match="writer"):
        while True:  # whatever was published before the kill is still delivered, in order
            assert ring.recv(timeout=20) == got.to_bytes(8, "little") * 8
            got += 1
    p.join()


def test_reader_killed_unblocks_writer_on_full_ring(inst):
    ring = Ring.create(inst, "d", 4096, role="writer", claim=True)
    ready = CTX.Event()
    p = CTX.Process(target=_idle_reader, args=(ring.name, ready), daemon=True)
    p.start()
    assert ready.wait(20)
    os.kill(p.pid, signal.SIGKILL)
    with pytest.raises(PeerDied, match="reader 0"):
        for _ in range(100):
            ring.send(b"x" * 1000, timeout=20)
    p.join()


def test_wait_any_across_rings_sharing_a_doorbell(inst):
    bell = Doorbell.create(inst, "bell")
    rings = [Ring.create(inst, f"in{k}", 4096, doorbell=bell, role="reader", spin_us=0,
                         slice_s=NO_RESCUE, claim=True) for k in range(3)]
    counts, seed = [150, 40, 300], 11
    p = CTX.Process(target=_multi_writer, args=([r.name for r in rings], counts, seed), daemon=True)
    p.start()
    got = [0, 0, 0]
    while got != counts:
        ready = wait_any(rings, timeout=20)
        assert ready
        for ring in ready:
            k = rings.index(ring)
            msg = ring.try_recv()
            assert msg == payload(seed + k, got[k], 1 + got[k] % 300)
            got[k] += 1
    p.join(20)
    assert p.exitcode == 0
    for ring in rings:
        ring.slice_ns = 50_000_000  # from here on a dead writer must be noticed
    with pytest.raises(PeerDied):  # every writer is gone and nothing is left
        wait_any(rings, timeout=20)
    with pytest.raises(ValueError, match="shared doorbell"):
        wait_any([rings[0], Ring.create(inst, "lone", 1024, role="reader")], timeout=0)


def test_wait_any_times_out_with_live_writer(inst):
    bell = Doorbell.create(inst, "bell")
    rings = [Ring.create(inst, f"q{k}", 1024, doorbell=bell, role="reader") for k in range(2)]
    writer = Ring.attach(rings[1].name, "writer")
    with pytest.raises(TimeoutError):
        wait_any(rings, timeout=0.05)
    writer.send(b"hi")
    assert wait_any(rings, timeout=1) == [rings[1]]


def test_writer_that_exited_is_detected_while_waiting(inst):
    ring = Ring.create(inst, "e", 1024, role="reader", claim=True)
    p = CTX.Process(target=_exit_after_attach, args=(ring.name,), daemon=True)
    p.start()
    p.join(20)
    with pytest.raises(PeerDied, match=r"writer \(pid"):
        ring.recv(timeout=20)


def test_attach_rejects_foreign_segment(inst):
    seg = inst.create_segment("junk", 4096)
    with pytest.raises(ValueError, match="not a pipeline ring"):
        Ring.attach(seg.name)
    seg.close()
    with pytest.raises(ValueError, match="role="):
        Ring.attach(Ring.create(inst, "x", 1024).name, "both")
