"""Worker stage: how many KV blocks a worker's cache gets.

``--num-blocks`` if given; on CPU, the ``--kv-cache-memory`` budget, by default sized to the
model (``default_cpu_kv_bytes``); on CUDA, what is left of ``--gpu-memory-utilization``
after the largest step the engine may send has run (``profile_gpu_blocks``). Too few for one
sequence of max_model_len is an error naming the flags to change. Under tensor parallelism
each rank decides, then they take the smallest (rank_model). Owns no state.
"""
from __future__ import annotations

from collections.abc import Callable

import torch

from pipeline.config import EngineConfig
from pipeline.layers import flash_prefill
from pipeline.layers.attention import AttentionMetadata
from pipeline.models.llama import CausalLM
from pipeline.worker.kv_cache import KVCache

# The least a default CPU cache gets (a tiny model still batches): 64 MiB.
MIN_CPU_KV_BYTES = 64 << 20


def default_cpu_kv_bytes(per_block: int, blocks_per_seq: int, max_num_seqs: int,
                         weight_bytes: int, available: int) -> int:
    """The CPU KV cache without ``--kv-cache-memory``: as much memory as the weights take
    (at least ``MIN_CPU_KV_BYTES``, at most half of ``available``: the memory and /dev/shm
    free on this host per rank), but never less than one sequence of max_model_len, nor more
    than ``max_num_seqs`` sequences of max_model_len can fill (what the engine could ever
    use). So a 7 MB model gets 64 MiB, a 1 GB one about 1 GB, a 16 GB model with a 128k
    context the 16 GiB one such sequence needs."""
    one_seq = per_block * blocks_per_seq
    budget = min(max(weight_bytes, MIN_CPU_KV_BYTES), available // 2)
    return min(one_seq * max_num_seqs, max(budget, one_seq))


def available_bytes(ranks: int) -> int:
    """This host's memory and /dev/shm free (the smaller), per worker rank on it."""
    from pipeline.ipc.segment import shm_free_bytes
    avail = shm_free_bytes()
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    avail = min(avail, int(line.split()[1]) * 1024)
    except OSError:
        pass
    return avail // max(1, ranks)


def decide_num_blocks(config: EngineConfig, per_block: int, block_size: int, max_model_len: int,
                      device: torch.device, profile: Callable[[int], int], weight_bytes: int = 0) -> int:
    """Blocks of ``per_block`` bytes (``KVLayout.bytes_per_block``: all layers, K and V,
    plus a draft model's KV per block where there is one: the budget covers both);
    ``profile(per_block)`` on CUDA;
    ``weight_bytes``: what this rank's weights take (the CPU default follows it)."""
    blocks_per_seq = -(-max_model_len // block_size)
    if config.cache_config.num_blocks:
        n = config.cache_config.num_blocks
    elif device.type == "cpu":
        budget = config.cache_config.kv_cache_memory or default_cpu_kv_bytes(
            per_block, blocks_per_seq, config.scheduler_config.max_num_seqs, weight_bytes,
            available_bytes(config.parallel_config.ranks_per_node))
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
    num_tokens = min(config.scheduler_config.max_num_batched_tokens, max_model_len)
    nb = -(-num_tokens // block_size)
    tmp = cache(nb)
    meta = AttentionMetadata(
        slot_mapping=torch.arange(num_tokens, device=device, dtype=torch.int64),
        cu_seqlens_q=torch.tensor([0, num_tokens], device=device, dtype=torch.int32),
        seq_lens=torch.tensor([num_tokens], device=device, dtype=torch.int32),
        block_tables=torch.arange(nb, device=device, dtype=torch.int32)[None, :])
    ids = torch.zeros(num_tokens, dtype=torch.int64, device=device)
    hidden = model(ids, torch.arange(num_tokens, device=device), meta, tmp.layers)
    n_logits = min(config.scheduler_config.max_num_seqs, num_tokens)
    model.compute_logits(hidden[:n_logits]).softmax(-1)
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device)
    k0 = tmp.layers[0][0]
    if flash_prefill.supported(device, k0.dtype, k0.shape[3]):
        # A chunk's flash prefill gathers its whole context's K and V for one layer at a time
        # (layers/flash_prefill.py): up to max_model_len tokens of both, beside the activations.
        peak += 2 * max_model_len * k0[0, 0].numel() * k0.element_size()
    del hidden
    tmp.close()
    free, total = torch.cuda.mem_get_info(device)
    others = total - free - torch.cuda.memory_reserved(device)  # context, other processes
    budget = int(total * config.cache_config.gpu_memory_utilization) - peak - max(others, 0)
    torch.cuda.empty_cache()
    return max(budget // per_block, 0)
