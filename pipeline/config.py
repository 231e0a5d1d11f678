"""Shared by every stage: the engine configuration, built once by the entry point.

The gateway parses flags into an EngineConfig and hands it (msgspec-encoded) to each stage.
"""
from __future__ import annotations

import argparse
import os
from pathlib import Path

import msgspec

DEFAULT_MODEL = str(Path(__file__).resolve().parent / "default_model")


class EngineConfig(msgspec.Struct, kw_only=True):
    model: str = DEFAULT_MODEL
    device: str = "auto"  # auto | cpu | cuda
    dtype: str = "auto"  # auto | float32 | bfloat16 | float16
    block_size: int = 0  # 0: 16 on CPU, 64 on GPU
    num_blocks: int = 0  # 0: from the memory budget
    kv_cache_memory: int = 0  # bytes on CPU; 0: 1 GiB or what max_model_len * max_num_seqs needs
    gpu_memory_utilization: float = 0.9
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    max_model_len: int = 0  # 0: from the checkpoint's config
    long_prefill_token_threshold: int = 0  # 0: max_num_batched_tokens // 4 ... see scheduler
    enable_prefix_caching: bool = True
    preemption_policy: str = "newest"  # newest | lowest_priority
    tensor_parallel_size: int = 1
    worker_threads: int = 0  # CPU: 0 = PIPELINE_WORKER_THREADS or usable cores - 1
    seed: int = 0
    instance_id: str = ""

    def resolved_device(self) -> str:
        if self.device != "auto":
            return self.device
        import torch
        return "cuda" if torch.cuda.is_available() else "cpu"

    def resolved_block_size(self) -> int:
        if self.block_size:
            return self.block_size
        return 64 if self.resolved_device() == "cuda" else 16


def add_engine_args(p: argparse.ArgumentParser) -> None:
    d = EngineConfig()
    p.add_argument("--model", default=d.model, help="checkpoint directory (Hugging Face format)")
    p.add_argument("--device", default=d.device, choices=["auto", "cpu", "cuda"])
    p.add_argument("--dtype", default=d.dtype, choices=["auto", "float32", "bfloat16", "float16"])
    p.add_argument("--block-size", type=int, default=d.block_size)
    p.add_argument("--num-blocks", type=int, default=d.num_blocks)
    p.add_argument("--kv-cache-memory", type=int, default=d.kv_cache_memory, help="bytes (CPU)")
    p.add_argument("--gpu-memory-utilization", type=float, default=d.gpu_memory_utilization)
    p.add_argument("--max-num-seqs", type=int, default=d.max_num_seqs)
    p.add_argument("--max-num-batched-tokens", type=int, default=d.max_num_batched_tokens)
    p.add_argument("--max-model-len", type=int, default=d.max_model_len)
    p.add_argument("--long-prefill-token-threshold", type=int, default=d.long_prefill_token_threshold)
    p.add_argument("--no-prefix-caching", dest="enable_prefix_caching", action="store_false")
    p.add_argument("--preemption-policy", default=d.preemption_policy, choices=["newest", "lowest_priority"])
    p.add_argument("--tensor-parallel-size", type=int, default=d.tensor_parallel_size)
    p.add_argument("--worker-threads", type=int, default=d.worker_threads,
                   help="CPU torch threads of the worker (0: PIPELINE_WORKER_THREADS or cores - 1)")
    p.add_argument("--seed", type=int, default=d.seed)


def config_from_args(a: argparse.Namespace) -> EngineConfig:
    fields = {f: getattr(a, f) for f in EngineConfig.__struct_fields__ if hasattr(a, f)}
    cfg = EngineConfig(**fields)
    if not cfg.instance_id:
        cfg.instance_id = f"{os.getpid():x}"
    return cfg
