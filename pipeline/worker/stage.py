"""Worker stage process loop: one per tensor-parallel rank.

Owns the ModelRunner (weights, KV cache memory, persistent batch, sampler) of its rank. It
receives each step's SchedulerOutput from the engine's broadcast ring, runs it and (rank 0
only) sends the ModelRunnerOutput back to the engine. It never decides what runs.
"""
from __future__ import annotations

import time

import msgspec

from pipeline.engine.sched_output import SchedulerOutput
from pipeline.engine.stage import RESULT_HEADER
from pipeline.entrypoints.stages import ReadyFn, StageSpec, log
from pipeline.ipc.broadcast import BroadcastRing
from pipeline.ipc.ring import Ring


def run(spec: StageSpec, ready: ReadyFn) -> None:
    from pipeline.worker.model_runner import ModelRunner  # noqa: PLC0415 - heavy (torch)

    cfg = spec.config
    log(spec, f"loading weights from {cfg.model} (device {cfg.device}, dtype {cfg.dtype})")
    t0 = time.perf_counter()
    runner = ModelRunner(cfg, spec.rank)
    runner.load()
    kv_bytes = runner.kv_cache_bytes
    log(spec, f"loaded in {time.perf_counter() - t0:.1f}s: {runner.num_blocks} KV blocks of "
              f"{runner.block_size} tokens ({kv_bytes / 2**20:.1f} MiB, "
              f"{runner.num_blocks * runner.block_size} tokens), max_model_len "
              f"{runner.max_model_len}")
    steps = BroadcastRing.attach(spec.rings["steps"], spec.rank)
    results = Ring.attach(spec.rings["results"], "writer") if spec.rank == 0 else None
    ready({"num_blocks": runner.num_blocks, "block_size": runner.block_size,
           "max_model_len": runner.max_model_len, "vocab_size": runner.vocab_size,
           "eos_token_ids": list(runner.eos_token_ids), "kv_cache_bytes": kv_bytes})
    decode = msgspec.msgpack.Decoder(SchedulerOutput).decode
    encode = msgspec.msgpack.Encoder().encode
    try:
        while True:
            buf = steps.recv(timeout=None)  # PeerDied if the engine dies
            t0 = time.perf_counter()
            sched = decode(buf)
            out = runner.execute(sched)
            if results is not None:
                results.send(RESULT_HEADER.pack(time.perf_counter() - t0) + encode(out))
    finally:
        runner.close()
