"""Broadcast ring (engine -> TP workers): every reader gets everything, the writer waits for
the slowest, and a dead reader unblocks the writer with PeerDied."""
from __future__ import annotations

import os
import signal

import pytest
from ipc_procs import CTX, NO_RESCUE, bcast_reader, bcast_slow_reader_then_die, payload

from pipeline.ipc import PeerDied
from pipeline.ipc.broadcast import BroadcastRing


@pytest.mark.parametrize("num_readers", [2, 3])
def test_every_reader_gets_every_message_in_order(inst, num_readers):
    w = BroadcastRing.create(inst, "b", 8192, num_readers, spin_us=0, slice_s=NO_RESCUE, claim=True)
    count, seed = 600, 5
    procs = [CTX.Process(target=bcast_reader, args=(w.name, k, count, seed), daemon=True)
             for k in range(num_readers)]
    for p in procs:
        p.start()
    for i in range(count):  # 600 messages of up to 2 KB through 8 KiB: the writer waits a lot
        w.send(payload(seed, i, 1 + (i * 131) % 2000), timeout=20)
    for p in procs:
        p.join(20)
    assert [p.exitcode for p in procs] == [0] * num_readers


def test_writer_waits_for_slowest_reader(inst):
    w = BroadcastRing.create(inst, "s", 1024, 2, spin_us=0)
    fast, slow = BroadcastRing.attach(w.name, 0), BroadcastRing.attach(w.name, 1)
    w.send(b"a" * 400)
    w.send(b"b" * 400)
    assert fast.recv() == b"a" * 400 and fast.recv() == b"b" * 400
    with pytest.raises(TimeoutError, match="no space"):
        w.send(b"c" * 400, timeout=0.05)  # the slow reader still holds both records
    assert slow.recv() == b"a" * 400
    w.send(b"c" * 400, timeout=0)
    assert [slow.recv(), slow.recv(), fast.recv()] == [b"b" * 400, b"c" * 400, b"c" * 400]
    assert fast.try_recv() is None and slow.try_recv() is None
    with pytest.raises(ValueError, match="reader_index=2"):
        BroadcastRing.attach(w.name, 2)
    with pytest.raises(ValueError, match="this end is a reader"):
        fast.send(b"x")


def test_dead_reader_raises_peer_died_in_writer(inst):
    w = BroadcastRing.create(inst, "d", 4096, 2, claim=True)
    live = BroadcastRing.attach(w.name, 0)
    ready = CTX.Event()
    p = CTX.Process(target=bcast_slow_reader_then_die, args=(w.name, 1, ready), daemon=True)
    p.start()
    assert ready.wait(20)
    os.kill(p.pid, signal.SIGKILL)
    with pytest.raises(PeerDied, match=r"reader 1 \(pid"):
        for _ in range(100):
            w.send(b"x" * 1000, timeout=20)
            live.try_recv()
    p.join()
