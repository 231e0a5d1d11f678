"""`pipeline bench pd`, target (2): how much of a prefill step's KV is already in the decode
pool when the prefill forward ends.

A real ModelRunner (CPU, its KV cache in shared memory, a LayerSignal attached exactly as
`serve --role prefill` attaches it) runs single-step prefills of a long prompt; a real
`Messager` + `IpcTransfer` in a separate process (as the cache messager stage runs) blocks on
the layer signal and copies each layer's blocks into a second pool the moment it is written.
The forward's end is stamped by a forward hook on the model (before logits and sampling); each
layer's copy by its end. Share = bytes whose copy ended by the forward's end / the step's bytes;
the target is (L-1)/L: only the last layer may still be on its way. perf_counter is
CLOCK_MONOTONIC, one clock for both processes. Owns one Instance (its names unlinked on exit).
"""
from __future__ import annotations

import multiprocessing as mp
import tempfile
import time
from pathlib import Path

import msgspec
import numpy as np

from pipeline.cache.transfer import IpcTransfer, KVTransfer
from pipeline.messages.kv_layout import KVLayout

CTX = mp.get_context("spawn")  # torch is loaded here: the child must not inherit it


class _Ended(KVTransfer):
    """An IpcTransfer that notes when each layer's copy ended, and its bytes."""

    def __init__(self, inner: IpcTransfer) -> None:
        self.inner, self.local, self.remote = inner, inner.local, inner.remote
        self.ends: list[tuple[float, int]] = []

    def send_layer(self, layer: int, pairs: object) -> int:
        n = self.inner.send_layer(layer, pairs)
        self.ends.append((time.perf_counter(), n))
        return n

    def flush(self) -> None:
        self.inner.flush()

    def close(self) -> None:
        self.inner.close()


def _messager(sig_name: str, local_seg: str, remote_seg: str, layout: KVLayout, conn) -> None:
    from pipeline.cache.messager import Messager
    from pipeline.ipc.layer_signal import LayerSignal
    from pipeline.ipc.segment import attach_segment

    sig = LayerSignal.attach(sig_name)
    seg = attach_segment(local_seg)
    transfer = _Ended(IpcTransfer(seg, layout, remote_seg, layout))
    conn.send("ready")
    try:
        while (msg := conn.recv()) is not None:
            step, pairs = msg
            transfer.ends.clear()
            rep = Messager(sig, transfer, 60.0).run_step(step, {"r": pairs})
            conn.send((list(transfer.ends), rep.failed))
    finally:
        transfer.close()
        seg.close()
        sig.close()


def forward_overlap(prompt_tokens: int = 512, steps: int = 6) -> dict:
    """Per step: the share of its KV bytes copied into the decode pool by the forward's end."""
    from pipeline.bench.worker import make_bench_model
    from pipeline.config import EngineConfig
    from pipeline.ipc.instance import Instance
    from pipeline.ipc.layer_signal import LayerSignal
    from pipeline.messages import NewRequestData, SchedulerOutput, ids_to_bytes
    from pipeline.models.config import model_hash
    from pipeline.sampling_params import SamplingParams
    from pipeline.worker.model_runner import ModelRunner

    tmp = tempfile.TemporaryDirectory(prefix="pipeline-bench-pd-")
    model = Path(tmp.name) / "model"
    make_bench_model(model)
    inst = Instance(f"bench-pd-overlap-{id(tmp):x}")
    bs = 16
    nb = -(-prompt_tokens // bs)
    cfg = EngineConfig.of(model=str(model), device="cpu", dtype="float32", block_size=bs,
                       num_blocks=nb + 1, max_model_len=prompt_tokens + 16, max_num_seqs=1,
                       max_num_batched_tokens=prompt_tokens, instance_id=inst.id)
    runner = ModelRunner(cfg)
    proc = None
    try:
        runner.load()
        kv = runner.kv_cache
        assert kv is not None and kv.shm_name is not None
        layout = msgspec.structs.replace(kv.layout, model_hash=model_hash(model))
        remote = inst.create_segment("remote-kv", layout.total_bytes)
        sig = LayerSignal.create(inst, "layers", layout.num_layers)
        sig.claim_publisher()
        runner.attach_layer_signal(sig)
        ends: list[float] = []
        assert runner.model is not None
        runner.model.register_forward_hook(lambda *a: ends.append(time.perf_counter()))
        parent, child = CTX.Pipe()
        proc = CTX.Process(target=_messager, args=(sig.name, kv.shm_name, remote.name, layout, child),
                           daemon=True)
        proc.start()
        assert parent.poll(120) and parent.recv() == "ready"
        rng = np.random.default_rng(0)
        shares = []
        prev: list[str] = []
        pairs = [(b, b) for b in range(nb)]
        for i in range(steps + 1):  # the first one warms up
            step = i + 1
            parent.send((step, pairs))
            rid = f"p{i}"
            ids = rng.integers(3, runner.vocab_size, prompt_tokens).tolist()
            new = NewRequestData(rid, ids_to_bytes(ids), prompt_tokens,
                                 SamplingParams(temperature=0.0, max_tokens=1), list(range(nb)), 0)
            runner.execute(SchedulerOutput(step, [new], [], {rid: prompt_tokens},
                                           prompt_tokens, prev, []))
            prev = [rid]
            layer_ends, failed = parent.recv()
            assert not failed, failed
            if i:
                total = sum(n for _, n in layer_ends)
                sent = sum(n for t, n in layer_ends if t <= ends[-1])
                shares.append(sent / total)
        parent.send(None)
        proc.join(30)
        L = layout.num_layers
        return {"layers": L, "prompt_tokens": prompt_tokens, "step_bytes": total,
                "share_min": min(shares), "share_median": float(np.median(shares)),
                "target": (L - 1) / L}
    finally:
        if proc is not None and proc.is_alive():
            proc.kill()
        runner.attach_layer_signal(None)
        runner.close()
        inst.cleanup()
        tmp.cleanup()
