"""`pipeline bench ipc`: the transport against pyzmq and multiprocessing.Pipe, on this machine.

Round trip p50/p99 between two processes (64 B, 4 KiB), one-way throughput (64 B, 4 KiB,
1 MiB), layer-signal notification latency (blocking wait vs polling loops that sleep 10 ms and
1 ms), and the message codec (msgspec msgpack vs pickle). Owns no state beyond one `Instance`
whose names it unlinks on exit. Children are forked: this command never imports torch.
"""
from __future__ import annotations

import argparse
import itertools
import multiprocessing as mp
import os
import pickle
import random
import shutil
import tempfile
import time
from collections.abc import Callable
from typing import Protocol

from pipeline.bench.report import Report, percentiles_us
from pipeline.ipc.instance import Instance
from pipeline.ipc.layer_signal import LayerSignal
from pipeline.ipc.ring import Ring

CTX = mp.get_context("fork")
STOP = b""
KiB, MiB = 1024, 1024 * 1024
THROUGHPUT_COUNTS = {64: 100_000, 4 * KiB: 30_000, MiB: 300}
_serial = itertools.count()


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--rtt-iters", type=int, default=3000, help="round trips per case")
    p.add_argument("--signal-steps", type=int, default=600, help="publications per signal case")
    p.add_argument("--spin-us", type=float, default=20.0, help="ring spin budget before parking")



# ---- the three transports, each as (parent end, child end) behind send/recv callables ----
class _Transport:
    def __init__(self, kind: str, inst: Instance, spin_us: float, capacity: int = 4 * MiB,
                 adaptive: bool = True):
        self.kind, self.adaptive = kind, adaptive
        if kind == "shm":
            k = next(_serial)
            self.a2b = Ring.create(inst, f"a2b{k}", capacity, role="writer", spin_us=spin_us)
            self.b2a = Ring.create(inst, f"b2a{k}", capacity, role="reader", spin_us=spin_us)
        elif kind == "zmq":
            self.dir = tempfile.mkdtemp(prefix="pipeline-bench-")
            self.addr = f"ipc://{self.dir}/pair"
        else:
            self.pa, self.pb = CTX.Pipe(duplex=True)
        self.spin_us = spin_us

    def parent(self) -> tuple[Callable[[bytes], object], Callable[[], bytes], Callable[[], None]]:
        if self.kind == "shm":
            self.a2b.claim()
            self.b2a.claim()
            self.a2b.adaptive_spin = self.b2a.adaptive_spin = self.adaptive
            return self.a2b.send, self.b2a.recv, lambda: None
        if self.kind == "zmq":
            import zmq
            ctx = zmq.Context()
            s = ctx.socket(zmq.PAIR)
            s.bind(self.addr)

            def close() -> None:
                s.close(linger=0)
                ctx.term()
                shutil.rmtree(self.dir, ignore_errors=True)
            return (lambda m: s.send(m, 0, copy=len(m) < 65536)), s.recv, close
        return self.pa.send_bytes, self.pa.recv_bytes, self.pa.close

    def child(self) -> tuple[Callable[[bytes], object], Callable[[], bytes]]:
        if self.kind == "shm":
            tx = Ring.attach(self.b2a.name, "writer", spin_us=self.spin_us)
            rx = Ring.attach(self.a2b.name, "reader", spin_us=self.spin_us)
            tx.adaptive_spin = rx.adaptive_spin = self.adaptive
            return tx.send, rx.recv
        if self.kind == "zmq":
            import zmq
            s = zmq.Context().socket(zmq.PAIR)
            s.connect(self.addr)
            return (lambda m: s.send(m, 0, copy=len(m) < 65536)), s.recv
        return self.pb.send_bytes, self.pb.recv_bytes


def _echo(t: _Transport) -> None:
    send, recv = t.child()
    while (m := recv()) != STOP:
        send(m)
    send(STOP)


def _blast(t: _Transport, size: int, count: int) -> None:
    send, recv = t.child()
    recv()  # go
    msg = bytes(size)
    for _ in range(count):
        send(msg)
    send(STOP)


RTT_VARIANTS = (  # label, transport, spin (None: --spin-us), adaptive spin
    ("shm ring", "shm", None, True),
    ("shm ring (fixed spin)", "shm", None, False),
    ("shm ring (park only)", "shm", 0.0, False),
    ("pyzmq ipc PAIR", "zmq", 0.0, False),
    ("mp.Pipe", "pipe", 0.0, False),
)


def rtt(inst: Instance, size: int, iters: int, spin_us: float, rounds: int = 10) -> dict:
    """Round trips through every transport, interleaved in rounds so that the load other
    processes put on this shared machine drifts over all of them alike."""
    ts = [_Transport(kind, inst, spin_us if spin is None else spin, 1 * MiB, adaptive)
          for _, kind, spin, adaptive in RTT_VARIANTS]
    procs = [CTX.Process(target=_echo, args=(t,), daemon=True) for t in ts]
    for p in procs:  # fork every child before the parent opens any zmq context
        p.start()
    ends = [t.parent() for t in ts]
    msg = bytes(size)
    lat: list[list[int]] = [[] for _ in ts]
    for send, recv, _ in ends:
        for _ in range(200):  # warm caches, first touches, the adaptive spin
            send(msg)
            recv()
    for r in range(rounds):
        for k in [(r + j) % len(ts) for j in range(len(ts))]:
            send, recv, _ = ends[k]
            for _ in range(max(1, iters // rounds)):
                t0 = time.perf_counter_ns()
                send(msg)
                recv()
                lat[k].append(time.perf_counter_ns() - t0)
    for (send, recv, close), p in zip(ends, procs):
        send(STOP)
        recv()
        p.join()
        close()
    return {v[0]: percentiles_us(x) for v, x in zip(RTT_VARIANTS, lat)}


def throughput(kind: str, inst: Instance, size: int, count: int, spin_us: float) -> tuple[float, float]:
    t = _Transport(kind, inst, spin_us, capacity=8 * MiB)
    p = CTX.Process(target=_blast, args=(t, size, count), daemon=True)
    p.start()
    send, recv, close = t.parent()
    send(b"go")
    t0 = time.perf_counter()
    n = 0
    while recv() != STOP:
        n += 1
    dt = time.perf_counter() - t0
    p.join()
    close()
    return n * size / dt / 1e6, n / dt


# ---- layer signal: blocking wait vs sleep-polling, measured at the same time -----------
SIGNAL_VARIANTS = (("poll sleep(0.01)", 0.01), ("poll sleep(0.001)", 0.001), ("blocking wait", None))


def _publisher(names: list[str], stamps, steps: int, seed: int) -> None:
    sigs = [LayerSignal.attach(n) for n in names]
    for sig in sigs:
        sig.claim_publisher()
    rnd = random.Random(seed)
    for step in range(steps):
        time.sleep(rnd.uniform(0.0005, 0.003))  # the worker's forward between two layers
        stamps[step] = time.monotonic_ns()
        for sig in sigs:  # the blocking waiter's signal last: no head start for it
            sig.publish(step, 0)


def _listener(name: str, stamps, out, steps: int, poll_s: float | None) -> None:
    sig = LayerSignal.attach(name)
    for step in range(steps):
        if poll_s is None:
            sig.wait(step, 0, timeout=30)
        else:
            while sig.published(0) < step:
                time.sleep(poll_s)
        out[step] = time.monotonic_ns() - stamps[step]


def signal_latency(inst: Instance, steps: int) -> dict:
    """One publisher stamps and publishes each step to three signals; a blocking waiter and
    the two polling loops listen at the same time, each in its own process."""
    sigs = [LayerSignal.create(inst, f"sig{k}", 1) for k in range(len(SIGNAL_VARIANTS))]
    stamps = CTX.RawArray("q", steps)
    outs = [CTX.RawArray("q", steps) for _ in SIGNAL_VARIANTS]
    procs = [CTX.Process(target=_listener, args=(sig.name, stamps, out, steps, poll), daemon=True)
             for sig, out, (_, poll) in zip(sigs, outs, SIGNAL_VARIANTS)]
    procs.append(CTX.Process(target=_publisher, args=([s.name for s in sigs], stamps, steps, 7),
                             daemon=True))
    for p in procs:
        p.start()
    for p in procs:
        p.join()
    for sig in sigs:
        sig.close()
    return {label: percentiles_us(list(out)) for (label, _), out in zip(SIGNAL_VARIANTS, outs)}


# ---- codec: msgspec msgpack vs pickle on the engine's own messages -----------------------
def codec_cases() -> list[tuple[str, object, str]]:
    from pipeline.messages import (
        CachedRequestData,
        EngineOutput,
        EngineOutputs,
        EngineRequest,
        SchedulerOutput,
        ids_to_bytes,
    )
    from pipeline.sampling_params import SamplingParams
    sp = SamplingParams(max_tokens=256, temperature=0.7, top_p=0.9, stop=["\n\n"])
    req = EngineRequest("req-123", ids_to_bytes(range(1024)), sp, time.time(), [2])
    outs = EngineOutputs([EngineOutput(f"req-{i}", [i, i + 1]) for i in range(64)], time.time())
    step = SchedulerOutput(7, [], [CachedRequestData(f"req-{i}", [i], 100 + i) for i in range(64)],
                           {f"req-{i}": 1 for i in range(64)}, 64, [], [])
    return [("EngineRequest 1024 tok", req, "requests"),
            ("EngineOutputs x64", outs, "outputs"),
            ("SchedulerOutput 64 decodes", step, "steps")]


class _Op(Protocol):
    """A call with no arguments. Not ``Callable[[], object]``: against that, mypy cannot infer
    the type of main's lambdas, whose default arguments bind the loop variables."""

    def __call__(self) -> object: ...


def _per_op_us(fn: _Op, n: int = 2000) -> float:
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - t0) / n * 1e6


def main(args: argparse.Namespace) -> int:
    from pipeline.ipc.codec import TaggedCodec
    from pipeline.runtime.rings import RING_MESSAGES
    rep = Report("ipc")
    rep.machine["loadavg_1m"] = round(os.getloadavg()[0], 2)
    spin = args.spin_us
    with Instance() as inst:
        p50 = {}
        for size in (64, 4 * KiB):
            for label, (a, b) in rtt(inst, size, args.rtt_iters, spin).items():
                p50[(label, size)] = a
                rep.add(f"rtt {label} {size} B", p50_us=a, p99_us=b)
        for size, count in THROUGHPUT_COUNTS.items():
            for kind, label in (("shm", "shm ring"), ("zmq", "pyzmq ipc PAIR"), ("pipe", "mp.Pipe")):
                mbs, mps = throughput(kind, inst, size, count, spin)
                rep.add(f"one-way {label} {size} B", mb_per_s=mbs, msgs_per_s=mps)
        sig = {}
        for label, (a, b) in signal_latency(inst, args.signal_steps).items():
            sig[label] = a
            rep.add(f"layer signal {label}", p50_us=a, p99_us=b)
    for name, obj, ring in codec_cases():
        codec = TaggedCodec(RING_MESSAGES[ring])
        blob, pk = codec.encode(obj), pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
        rep.add(f"codec msgspec {name}", encode_us=_per_op_us(lambda c=codec, o=obj: c.encode(o)),
                decode_us=_per_op_us(lambda c=codec, b=blob: c.decode(b)), bytes=len(blob))
        rep.add(f"codec pickle {name}", encode_us=_per_op_us(
                    lambda o=obj: pickle.dumps(o, protocol=pickle.HIGHEST_PROTOCOL)),
                decode_us=_per_op_us(lambda p=pk: pickle.loads(p)), bytes=len(pk))
    for size in (64, 4 * KiB):
        r = p50[("shm ring", size)] / p50[("pyzmq ipc PAIR", size)]
        rep.target(f"shm RTT p50 / pyzmq RTT p50 ({size} B)", round(r, 4), "<= 0.333", r <= 1 / 3)
    for label, goal in (("poll sleep(0.01)", 100), ("poll sleep(0.001)", 20)):
        x = sig[label] / sig["blocking wait"]
        rep.target(f"{label} p50 / signal wait p50", round(x, 1), f">= {goal}x", x >= goal)
    return rep.emit(args.json)
