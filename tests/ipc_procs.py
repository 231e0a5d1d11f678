"""Child-process bodies for the ipc tests (no tests here): a module light enough that the
forkserver children start without importing pytest or hypothesis."""
from __future__ import annotations

import multiprocessing as mp
import random

from pipeline.ipc.ring import Ring

# forkserver: children fork from a clean server, safe even if torch was imported by then.
CTX = mp.get_context("forkserver")
CTX.set_forkserver_preload(["ipc_procs"])
# A lost wake-up must show up as a timeout, not be papered over by the periodic liveness
# wake-ups, so the integrity tests park in slices longer than their timeouts.
NO_RESCUE = 60.0


def payload(seed: int, i: int, n: int) -> bytes:
    return random.Random(seed * 1_000_003 + i).randbytes(n)


def ring_writer(name: str, sizes: list[int], seed: int, spin_us: float) -> None:
    ring = Ring.attach(name, "writer", spin_us=spin_us, slice_s=NO_RESCUE)
    for i, n in enumerate(sizes):
        ring.send(payload(seed, i, n), timeout=20)


def ring_endless_writer(name: str) -> None:
    ring = Ring.attach(name, "writer")
    i = 0
    while True:
        ring.send(i.to_bytes(8, "little") * 8)
        i += 1


def ring_idle_reader(name: str, ready) -> None:
    ring = Ring.attach(name, "reader")
    ready.set()
    ring.recv()  # the test kills us while we wait here


def ring_multi_writer(names: list[str], counts: list[int], seed: int) -> None:
    rings = [Ring.attach(n, "writer") for n in names]
    order = [k for k, c in enumerate(counts) for _ in range(c)]
    random.Random(seed).shuffle(order)
    sent = [0] * len(rings)
    for k in order:
        rings[k].send(payload(seed + k, sent[k], 1 + sent[k] % 300), timeout=20)
        sent[k] += 1


def ring_exit_after_attach(name: str) -> None:
    Ring.attach(name, "writer")


def bcast_reader(name: str, index: int, count: int, seed: int) -> None:
    from pipeline.ipc.broadcast import BroadcastRing
    ring = BroadcastRing.attach(name, index, spin_us=0, slice_s=NO_RESCUE)
    for i in range(count):
        if ring.recv(timeout=20) != payload(seed, i, 1 + (i * 131) % 2000):
            raise SystemExit(10 + index)
    if ring.try_recv() is not None:
        raise SystemExit(20 + index)


def bcast_slow_reader_then_die(name: str, index: int, ready) -> None:
    from pipeline.ipc.broadcast import BroadcastRing
    ring = BroadcastRing.attach(name, index)
    ready.set()
    ring.recv()  # the test kills us while we wait here


def signal_publisher(name: str, ack_name: str, steps: int, layers: int) -> None:
    from pipeline.ipc.layer_signal import LayerSignal
    sig = LayerSignal.attach(name, slice_s=NO_RESCUE)
    ack = LayerSignal.attach(ack_name, slice_s=NO_RESCUE)
    sig.claim_publisher()
    for step in range(steps):
        for layer in range(layers):
            sig.publish(step, layer)
        ack.wait(step, 0, timeout=20)


def signal_c_publisher(name: str, lib: str, steps: int) -> None:
    """Publishes through the plain C entry point, as the CUDA host callback does."""
    import ctypes
    from pipeline.ipc.layer_signal import LayerSignal
    sig = LayerSignal.attach(name)
    sig.claim_publisher()
    fn = ctypes.CDLL(lib).publish
    fn.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int]
    for step in range(steps):
        fn(sig.address, step, step % sig.num_layers)


def signal_dies_after_attach(name: str) -> None:
    from pipeline.ipc.layer_signal import LayerSignal
    LayerSignal.attach(name).claim_publisher()


def signal_create_then_die(instance_id: str, conn, how: str) -> None:
    """Creates a layer signal as its publisher (through a view of the test's instance), waits
    until the reader parks on it, then dies without ever publishing."""
    import os
    import signal
    import time
    from pipeline.ipc.instance import Instance
    from pipeline.ipc.layer_signal import LayerSignal
    sig = LayerSignal.create(Instance.view(instance_id), "early", 2)
    conn.send(sig.name)
    deadline = time.monotonic() + 30
    while not sig.reader_parked() and time.monotonic() < deadline:
        pass
    if how == "sigkill":
        os.kill(os.getpid(), signal.SIGKILL)
    os._exit(0)  # skips atexit: the reader unlinks the name


def view_segment_and_wait(instance_id: str, conn) -> None:
    """Creates a segment through a view of another process's instance, then blocks until
    killed (SIGTERM must unlink it, as for a worker's KV pool)."""
    from pipeline.ipc.instance import Instance
    Instance.view(instance_id).create_segment("kv.1", 4096)
    conn.send("ready")
    conn.recv()


def make_instance_and_wait(conn, leak: bool) -> None:
    """Creates one of everything, reports its instance id, then blocks until killed."""
    import os
    from pipeline.ipc.broadcast import BroadcastRing
    from pipeline.ipc.instance import Instance
    from pipeline.ipc.layer_signal import LayerSignal
    from pipeline.ipc.ring import Doorbell
    from pipeline.ipc.segment import create_segment
    inst = Instance()
    bell = Doorbell.create(inst, "bell")
    ring = Ring.create(inst, "r", 4096, doorbell=bell, role="reader", claim=True)
    BroadcastRing.create(inst, "b", 4096, 2)
    LayerSignal.create(inst, "sig", 4)
    inst.create_semaphore("sem")
    create_segment(f"/pipeline.{inst.id}.loose", 4096)  # outside the Instance, like a KV pool
    conn.send(inst.id)
    if leak:
        os._exit(0)  # skips atexit: leaves everything behind for sweep_stale
    ring.recv()
