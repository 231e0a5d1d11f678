"""Worker stage process loop: one per tensor-parallel rank.

Owns the ModelRunner (weights, KV cache memory, persistent batch, sampler) of its rank. It
receives each step's SchedulerOutput from the engine's broadcast ring, runs it and (rank 0
only) sends the ModelRunnerOutput back to the engine. It never decides what runs. On CUDA,
rank 0 of a prefill or decode instance exports its KV cache by CUDA IPC for the cache
messager (ModelInfo.kv_cuda_ipc); the cache stays allocated, so exported, until it exits.
Importing this module imports torch and the model code: the process does it while the gateway
is still creating the rings and the other stages come up (``runtime.process``). Across hosts
(``--nnodes``), rank 0 forwards each plan to the ranks of the other nodes, which have no step
ring and take their plans from it instead (``worker.remote_plan``).
"""
from __future__ import annotations

import time

import msgspec

from pipeline.ipc.layer_signal import LayerSignal
from pipeline.models.config import model_hash
from pipeline.runtime import rings
from pipeline.runtime.process import ReadyFn, log
from pipeline.runtime.spec import ModelInfo, StageSpec
from pipeline.worker.model_runner import ModelRunner
from pipeline.worker.rank_model import TP_TIMEOUT_S
from pipeline.worker.remote_plan import HEARTBEAT_S, PlanReceiver, PlanSender


def run(spec: StageSpec, ready: ReadyFn) -> None:
    cfg = spec.config
    mc = cfg.model_config
    log(spec, f"loading weights from {mc.model} (device {mc.device}, dtype {mc.dtype})")
    t0 = time.perf_counter()
    runner = ModelRunner(cfg, spec.rank)
    runner.load()
    assert runner.kv_cache is not None
    kv = runner.kv_cache.layout
    log(spec, f"loaded in {time.perf_counter() - t0:.1f}s: {kv.num_blocks} KV blocks of "
              f"{kv.block_size} tokens ({kv.total_bytes / 2**20:.1f} MiB, "
              f"{kv.num_blocks * kv.block_size} tokens), max_model_len {runner.max_model_len}")
    if "layers" in spec.rings:  # role prefill: the cache messager waits on it (every rank's layers)
        signal = LayerSignal.attach(spec.rings["layers"])
        signal.claim_publisher()
        runner.attach_layer_signal(signal)
    local = "steps" in spec.rings  # node 0; the ranks of other nodes get plans from rank 0
    steps = rings.attach(spec, "steps") if local else None
    results = rings.attach(spec, "results", "writer") if spec.rank == 0 else None
    kv_cuda_ipc = b""
    buf = runner.kv_cache.buffer
    if spec.rank == 0 and cfg.kv_transfer_config.role != "mixed" and buf is not None and buf.is_cuda:
        from pipeline.ipc.cuda_ipc import export_pool
        kv_cuda_ipc = export_pool(buf)  # runner.kv_cache keeps buf alive until runner.close()
    sender = receiver = None
    try:
        par = cfg.parallel_config
        if spec.rank == 0 and par.nnodes > 1:
            assert runner.tp is not None  # each remote rank's plan_key, gathered as it joined
            keys = {r: runner.tp.gathered[r]["plan_key"]
                    for r in range(par.ranks_per_node, par.tensor_parallel_size)}
            sender = PlanSender(par.master_addr, par.master_port, keys, TP_TIMEOUT_S, cfg.curve_keys)
        elif not local:  # ready below only once node 0 took this rank's hello
            receiver = PlanReceiver(par.master_addr, par.master_port, spec.rank, runner.plan_key,
                                    TP_TIMEOUT_S, cfg.curve_keys)
        info = ModelInfo(max_model_len=runner.max_model_len, vocab_size=runner.vocab_size,
                         eos_token_ids=list(runner.eos_token_ids),
                         kv=msgspec.structs.replace(kv, model_hash=model_hash(cfg.model_config.model)),
                         kv_segment=runner.kv_cache.shm_name, kv_cuda_ipc=kv_cuda_ipc,
                         kv_tier_id=runner.kv_tier_id() if spec.rank == 0 else "",
                         hidden_size=runner.model_config.hidden_size)
        ready(msgspec.structs.asdict(info))
        while True:
            t_wait = time.perf_counter()
            if receiver is not None:
                sched = receiver.recv()  # PeerDied once node 0 is silent
                if sched is None:
                    log(spec, "node 0 shut down; stopping")
                    return
            elif sender is not None:
                assert steps is not None
                try:  # idle: a heartbeat tells the other hosts' ranks that node 0 is alive
                    sched = steps.recv(timeout=HEARTBEAT_S)
                except TimeoutError:
                    sender.heartbeat()
                    continue
                sender.send(sched)
            else:
                assert steps is not None
                sched = steps.recv(timeout=None)  # PeerDied if the engine dies
            t0 = time.perf_counter()
            out = runner.execute(sched)
            if results is not None:
                out.execute_s = time.perf_counter() - t0
                out.wait_s = t0 - t_wait
                results.send(out)
    finally:
        if sender is not None:
            sender.close()
        if receiver is not None:
            receiver.close()
        runner.close()
