"""`pipeline bench pd`: the cache messager's layer loop and KV transfers, on this machine.

(1) Wake latency: how long after the worker publishes a layer the messager starts sending it,
p50/p99, the real blocking loop against the same `Messager` driven by a 10 ms polling loop,
both listening to one publisher at the same time, each in its own process. (3) Bandwidth of
one step's KV (runs of contiguous blocks at scattered places): `IpcTransfer` against a plain
memcpy of the same bytes between the same two buffers; `TcpTransfer` + `KVReceiver` on
loopback against a plain ZMQ send of the same bytes to the same process. Rounds alternate
so that the load of other processes drifts over both alike. (2) The share of a prefill step's
KV already in the decode pool when the forward ends (``pd_overlap``: a real worker and
messager). (4) The decoders' inter-token latency while long prompts arrive, a prefill +
decode pair behind the router against one mixed instance with the same CPU budget
(``pd_load``). Owns no state beyond one `Instance` whose names it unlinks on exit. Children of
(1) and (3) are forked before any ZMQ context exists and before (2) imports torch.
"""
from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import random
import time

import numpy as np

from pipeline.bench import pd_load
from pipeline.bench.pd_overlap import forward_overlap
from pipeline.bench.report import Report, percentiles_us
from pipeline.cache.messager import Messager
from pipeline.cache.tcp import TcpTransfer
from pipeline.cache.tcp_receiver import KVReceiver
from pipeline.cache.transfer import IpcTransfer, KVTransfer
from pipeline.ipc.instance import Instance
from pipeline.ipc.layer_signal import LayerSignal
from pipeline.ipc.segment import attach_segment
from pipeline.messages.kv_layout import KVLayout

CTX = mp.get_context("fork")
POLL_S = 0.01


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--steps", type=int, default=60, help="steps of the wake-latency case")
    p.add_argument("--layers", type=int, default=4, help="layers per step (wake latency)")
    p.add_argument("--blocks", type=int, default=256, help="blocks per layer moved (bandwidth)")
    p.add_argument("--rounds", type=int, default=12, help="alternating rounds per bandwidth case")
    p.add_argument("--overlap-tokens", type=int, default=512,
                   help="prompt tokens of the prefill step whose KV overlap is measured")
    pd_load.add_args(p)



# ---- (1) wake latency: blocking layer loop vs the same loop driven by a polling wait --------
class _Polling:
    """The seed's old loop: check the published layer, sleep 10 ms, check again."""

    def __init__(self, sig: LayerSignal) -> None:
        self.sig = sig

    def wait(self, step: int, layer: int, timeout: float | None = None) -> None:
        while self.sig.published(layer) < step:
            time.sleep(POLL_S)


class _Stamped(KVTransfer):
    """A real IpcTransfer that notes when each layer's send starts."""

    def __init__(self, inner: KVTransfer, out, layers: int) -> None:
        self.inner, self.out, self.layers = inner, out, layers
        self.local, self.remote = inner.local, inner.remote
        self.step = 0

    def send_layer(self, layer: int, pairs: object) -> int:
        self.out[self.step * self.layers + layer] = time.monotonic_ns()
        return self.inner.send_layer(layer, pairs)

    def flush(self) -> None:
        self.inner.flush()

    def close(self) -> None:
        self.inner.close()


def _messager(sig_name: str, seg_name: str, layout: KVLayout, out, steps: int, poll: bool) -> None:
    sig = LayerSignal.attach(sig_name)
    t = _Stamped(IpcTransfer(bytes(layout.total_bytes), layout, seg_name, layout), out, layout.num_layers)
    m = Messager(_Polling(sig) if poll else sig, t)
    for step in range(steps):
        t.step = step
        rep = m.run_step(step, {"r": [(0, 0), (1, 1)]})
        assert not rep.failed, rep.failed
    t.close()
    sig.close()


def _publisher(names: list[str], stamps, steps: int, layers: int) -> None:
    sigs = [LayerSignal.attach(n) for n in names]
    for sig in sigs:
        sig.claim_publisher()
    rnd = random.Random(7)
    for step in range(steps):
        for layer in range(layers):
            time.sleep(rnd.uniform(0.0005, 0.003))  # the worker's forward of one layer
            stamps[step * layers + layer] = time.monotonic_ns()
            for sig in sigs:  # the blocking loop's signal last: no head start for it
                sig.publish(step, layer)


def wake_latency(inst: Instance, steps: int, layers: int) -> dict[str, tuple[float, float]]:
    layout = KVLayout(num_layers=layers, num_blocks=4, block_size=16, num_kv_heads=2,
                      head_dim=64, dtype="bfloat16", model_hash="bench")
    n = steps * layers
    stamps = CTX.RawArray("q", n)
    variants = (("poll sleep(0.01)", True), ("blocking wait", False))
    sigs = [LayerSignal.create(inst, f"sig{k}", layers) for k in range(len(variants))]
    segs = [inst.create_segment(f"kv{k}", layout.total_bytes) for k in range(len(variants))]
    outs = [CTX.RawArray("q", n) for _ in variants]
    procs = [CTX.Process(target=_messager, args=(sig.name, seg.name, layout, out, steps, poll), daemon=True)
             for sig, seg, out, (_, poll) in zip(sigs, segs, outs, variants)]
    procs.append(CTX.Process(target=_publisher, args=([s.name for s in sigs], stamps, steps, layers),
                             daemon=True))
    for p in procs:
        p.start()
    for p in procs:
        p.join()
        if p.exitcode != 0:
            raise RuntimeError(f"bench child {p.name} exited with {p.exitcode}")
    for sig, seg in zip(sigs, segs):
        sig.close()
        seg.close()
    return {label: percentiles_us([out[i] - stamps[i] for i in range(n)]) for (label, _), out in zip(variants, outs)}


# ---- (3) bandwidth ----------------------------------------------------------------------------
def bench_layout(blocks: int) -> KVLayout:
    # One layer of a 7B-class model's bf16 KV: 16 tokens x 8 KV heads x 128 = 32 KiB per block.
    return KVLayout(num_layers=2, num_blocks=2 * blocks, block_size=16, num_kv_heads=8,
                    head_dim=128, dtype="bfloat16", model_hash="bench")


def step_pairs(blocks: int, run: int = 8, seed: int = 0) -> list[tuple[int, int]]:
    """`blocks` pairs in runs of `run` blocks contiguous on both sides, at scattered places."""
    rnd = random.Random(seed)
    nruns = blocks // run
    local = rnd.sample(range(2 * nruns), nruns)
    remote = rnd.sample(range(2 * nruns), nruns)
    return [(lo * run + i, ro * run + i) for lo, ro in zip(local, remote) for i in range(run)]


def ipc_bandwidth(inst: Instance, blocks: int, rounds: int) -> tuple[float, float]:
    layout, pairs = bench_layout(blocks), step_pairs(blocks)
    src = np.random.default_rng(0).integers(0, 256, layout.total_bytes, dtype=np.uint8)
    seg = inst.create_segment("bw", layout.total_bytes)
    t = IpcTransfer(src, layout, seg.name, layout)
    dst = np.frombuffer(seg, np.uint8)
    nbytes = 2 * blocks * layout.block_bytes
    xfer, plain = [], []
    for _ in range(rounds):
        t0 = time.perf_counter()
        t.send_layer(0, pairs)
        t.flush()
        xfer.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        np.copyto(dst[:nbytes], src[:nbytes])
        plain.append(time.perf_counter() - t0)
    t.close()
    del dst
    seg.close()
    return nbytes / float(np.median(xfer)) / 1e6, nbytes / float(np.median(plain)) / 1e6


def _tcp_side(seg_name: str, layout: KVLayout, conn) -> None:
    """Decode side: a KVReceiver into its pool, and a plain ZMQ PULL-and-ack for the baseline."""
    import zmq
    seg = attach_segment(seg_name)
    rx = KVReceiver(seg, layout)
    ctx = zmq.Context()
    plain = ctx.socket(zmq.ROUTER)
    plain.bind("tcp://127.0.0.1:0")
    conn.send((rx.endpoint, plain.getsockopt_string(zmq.LAST_ENDPOINT)))
    while True:
        peer, body = plain.recv_multipart(copy=False)
        if len(body) == 0:
            break
        plain.send_multipart([peer, b"ack"])
    plain.close()
    ctx.term()
    rx.close()
    seg.close()


def tcp_bandwidth(inst: Instance, blocks: int, rounds: int) -> tuple[float, float]:
    layout, pairs = bench_layout(blocks), step_pairs(blocks)
    seg = inst.create_segment("bwtcp", layout.total_bytes)
    conn, child = CTX.Pipe()
    proc = CTX.Process(target=_tcp_side, args=(seg.name, layout, child), daemon=True)
    proc.start()
    rx_endpoint, plain_endpoint = conn.recv()
    import zmq
    src = np.random.default_rng(0).integers(0, 256, layout.total_bytes, dtype=np.uint8)
    t = TcpTransfer(src, layout, rx_endpoint)
    ctx = zmq.Context()
    s = ctx.socket(zmq.DEALER)
    s.connect(plain_endpoint)
    nbytes = 2 * blocks * layout.block_bytes
    payload = src.data[:nbytes]
    xfer, plain = [], []
    for r in range(rounds + 1):  # round 0 warms both connections up
        t0 = time.perf_counter()
        t.send_layer(r % layout.num_layers, pairs)
        t.flush()
        t1 = time.perf_counter()
        s.send(payload, 0, copy=False)
        s.recv()
        t2 = time.perf_counter()
        if r:
            xfer.append(t1 - t0)
            plain.append(t2 - t1)
    s.send(b"")
    s.close()
    ctx.term()
    t.close()
    proc.join()
    seg.close()
    return nbytes / float(np.median(xfer)) / 1e6, nbytes / float(np.median(plain)) / 1e6


def main(args: argparse.Namespace) -> int:
    rep = Report("pd")
    rep.machine["loadavg_1m"] = round(os.getloadavg()[0], 2)
    with Instance() as inst:
        wake = wake_latency(inst, args.steps, args.layers)
        for label, (a, b) in wake.items():
            rep.add(f"messager wake, {label}", p50_us=a, p99_us=b)
        bw = {"ipc": ipc_bandwidth(inst, args.blocks, args.rounds),
              "tcp": tcp_bandwidth(inst, args.blocks, args.rounds)}
    base = {"ipc": "memcpy", "tcp": "plain zmq send"}
    for kind, (mine, plain) in bw.items():
        rep.add(f"{kind} transfer, {args.blocks} blocks x 32 KiB x (K, V)", mb_per_s=mine)
        rep.add(f"{base[kind]}, same bytes", mb_per_s=plain)
    # After the forked cases: this one loads torch (its child is spawned).
    ov = forward_overlap(args.overlap_tokens)
    rep.add(f"KV copied by the prefill forward's end, {ov['layers']} layers, "
            f"{ov['prompt_tokens']}-token prompt", share_min=round(ov["share_min"], 3),
            share_median=round(ov["share_median"], 3), step_mib=round(ov["step_bytes"] / 2**20, 2))
    # Last: real daemons and a router (ZMQ contexts: after every fork above).
    load = pd_load.itl_under_long_prompts(args)
    for setup in ("mixed", "pd"):
        r = load[setup]
        rep.add(f"decoders' ITL under long prompts, {setup}", **{
            k: r[k] for k in r if k.endswith("_ms") or k in ("failed", "short_answers", "itl_gaps")})
    rep.machine["pd_load_cpu_budget"] = load["cpu_budget"]
    x = wake["poll sleep(0.01)"][0] / wake["blocking wait"][0]
    rep.target("poll sleep(0.01) p50 / blocking messager wake p50", round(x, 1), ">= 100x", x >= 100)
    for kind, (mine, plain) in bw.items():
        r = mine / plain
        rep.target(f"{kind} transfer / {base[kind]} bandwidth", round(r, 3), ">= 0.7", r >= 0.7)
    rep.target("step's KV bytes in the decode pool when the prefill forward ends (ipc, min)",
               round(ov["share_min"], 3), f">= (L-1)/L = {ov['target']:.3f}", ov["share_min"] >= ov["target"])
    q = load["itl_p99_ratio"]
    rep.target("decode instance ITL p99 / mixed instance ITL p99, long prompts arriving",
               round(q, 3), "< 1", q < 1)
    rep.add("TTFT, pd / mixed (reported beside target 4)",
            long_prompts_p50=round(load["ttft_long_p50_ratio"], 3),
            decoders_p50=round(load["ttft_decoder_p50_ratio"], 3))
    return rep.emit(args.json)
