"""Worker stage: how many KV blocks a worker's cache gets.

``--num-blocks`` if given; on CPU, the ``--kv-cache-memory`` budget (default: 1 GiB, or what
``max_model_len * max_num_seqs`` tokens need if less); on CUDA, what is left of
``--gpu-memory-utilization`` after the largest step the engine may send has run
(``profile_gpu_blocks``). Too few for one sequence of max_model_len is an error naming the
flags to change. Under tensor parallelism each rank decides, then they take the smallest
(model_runner). Owns no state.
"""
from __future__ import annotations

from collections.abc import Callable

import torch

from pipeline.config import EngineConfig
from pipeline.layers.attention import AttentionMetadata
from pipeline.models.llama import CausalLM
from pipeline.worker.kv_cache import KVCache

DEFAULT_CPU_KV_BYTES = 1 << 30


def decide_num_blocks(config: EngineConfig, per_block: int, block_size: int, max_model_len: int,
                      device: torch.device, profile: Callable[[int], int]) -> int:
    """Blocks of ``per_block`` bytes (all layers, K and V); ``profile(per_block)`` on CUDA."""
    blocks_per_seq = -(-max_model_len // block_size)
    if config.num_blocks:
        n = config.num_blocks
    elif device.type == "cpu":
        budget = config.kv_cache_memory or min(
            DEFAULT_CPU_KV_BYTES, per_block * blocks_per_seq * config.max_num_seqs)
        n = budget // per_block
    else:
        n = profile(per_block)
    if n < blocks_per_seq:
        raise ValueError(
            f"KV cache of {n} blocks x {block_size} tokens cannot hold one sequence of "
            f"max_model_len={max_model_len}; raise --kv-cache-memory / "
            f"--gpu-memory-utilization / --num-blocks or lower --max-model-len")
    return int(n)


@torch.no_grad()
def profile_gpu_blocks(model: CausalLM | None, config: EngineConfig, block_size: int,
                       max_model_len: int, device: torch.device, cache: Callable[[int], KVCache],
                       per_block: int) -> int:
    """Run the largest step the engine may send, then give what is left to the cache."""
    assert model is not None
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    num_tokens = min(config.max_num_batched_tokens, max_model_len)
    nb = -(-num_tokens // block_size)
    tmp = cache(nb)
    meta = AttentionMetadata(
        slot_mapping=torch.arange(num_tokens, device=device, dtype=torch.int64),
        cu_seqlens_q=torch.tensor([0, num_tokens], device=device, dtype=torch.int32),
        seq_lens=torch.tensor([num_tokens], device=device, dtype=torch.int32),
        block_tables=torch.arange(nb, device=device, dtype=torch.int32)[None, :])
    ids = torch.zeros(num_tokens, dtype=torch.int64, device=device)
    hidden = model(ids, torch.arange(num_tokens, device=device), meta, tmp.layers)
    n_logits = min(config.max_num_seqs, num_tokens)
    model.compute_logits(hidden[:n_logits]).softmax(-1)
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device)
    del hidden
    tmp.close()
    free, total = torch.cuda.mem_get_info(device)
    others = total - free - torch.cuda.memory_reserved(device)  # context, other processes
    budget = int(total * config.gpu_memory_utilization) - peak - max(others, 0)
    torch.cuda.empty_cache()
    return max(budget // per_block, 0)
