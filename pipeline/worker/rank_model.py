"""Worker stage: one rank's model and its memory, the part of the model runner that is set up
once. Resolves the device, dtype, block size and max_model_len from the config (refusing what
the checkpoint or the host cannot do), loads the weights, joins the tensor-parallel group and
sizes and allocates the paged KV cache. `ModelRunner` (model_runner.py) runs the steps on it.

Under tensor parallelism (``--tensor-parallel-size N``) there is one per rank, each holding its
shard of the weights (``models.parallel``) and a KV cache of its KV heads; the ranks check at
joining that they all run the same configuration, and take the smallest KV pool of them all.

Owns: the model weights, the KV cache memory (KVCache), on CPU the ThreadGovernor of the
worker's team and, under tensor parallelism, this rank's TPGroup.
"""
from __future__ import annotations

import os
import secrets
import sys
import time
from collections.abc import Callable

import torch

from pipeline.config import EngineConfig
from pipeline.layers import ops
from pipeline.layers.int4 import PACKED
from pipeline.models.config import load_model_config, model_hash, weights_id
from pipeline.models.llama import CausalLM
from pipeline.models.loader import load_weights
from pipeline.models.parallel import TPGroup, TPShard
from pipeline.models.weights import weight_bytes
from pipeline.worker.device import proc_memory, resolve_dtype, weight_plan, worker_threads
from pipeline.worker.kv_cache import KVCache, kv_layout
from pipeline.worker.kv_sizing import decide_num_blocks, profile_gpu_blocks
from pipeline.worker.threads import ThreadGovernor, usable_cores
from pipeline.worker.tp_rendezvous import open_store, store_host

# How long a rank waits for the others to join the group (or, in a collective, for a peer
# that is alive but stuck): a dead peer's closed connection fails a collective at once.
TP_TIMEOUT_S = float(os.environ.get("PIPELINE_TP_TIMEOUT_S", "120"))


class RankModel:
    def __init__(self, config: EngineConfig, rank: int = 0) -> None:
        self.config = config
        self.rank = rank
        dev = config.resolved_device()
        if dev == "cuda" and not torch.cuda.is_available():
            raise ValueError(f"--device cuda: this torch ({torch.__version__}) sees no CUDA device"
                             + ("" if torch.version.cuda else " (it is a CPU-only build)")
                             + "; use --device cpu or auto")
        local_rank = rank % config.parallel_config.ranks_per_node
        if dev == "cuda" and local_rank >= torch.cuda.device_count():
            raise ValueError(f"--tensor-parallel-size {config.parallel_config.tensor_parallel_size} puts "
                             f"{config.parallel_config.ranks_per_node} ranks on this host, which has "
                             f"{torch.cuda.device_count()} CUDA device(s)")
        self.device = torch.device(f"cuda:{local_rank}") if dev == "cuda" else torch.device("cpu")
        # CPU: a fixed team (--worker-threads, PIPELINE_WORKER_THREADS) or one that adapts
        # to the cores actually free, starting with all of them (worker/threads.py).
        self.thread_governor: ThreadGovernor | None = None
        if self.device.type == "cpu":
            fixed = worker_threads(config.parallel_config.worker_threads)
            if fixed:
                torch.set_num_threads(fixed)
            else:  # the ranks on this host share its cores
                self.thread_governor = ThreadGovernor(max(1, usable_cores() // config.parallel_config.ranks_per_node))
        else:  # one device per worker process: the ops launch on the current one
            torch.cuda.set_device(self.device)
        self.model_config = mc = load_model_config(config.model_config.model)
        size = config.parallel_config.tensor_parallel_size
        self.shard = TPShard.of(mc, rank, size) if size > 1 else None
        self.tp: TPGroup | None = None
        # Rank 0 waits in it (seconds) while the others join; it raises if one is known dead
        # (pipeline.LLM: its rank processes).
        self.watch_peers: Callable[[float], None] | None = None
        self.plan_key = secrets.token_hex(16)  # known to the group only, after it joined
        self.dtype = resolve_dtype(config.model_config.dtype, mc.torch_dtype, self.device,
                                   ops.backend(self.device) is not None)
        self.block_size = config.resolved_block_size()
        default_len = mc.max_position_embeddings
        if mc.sliding_window is not None:
            default_len = min(default_len, mc.sliding_window)
        self.max_model_len = config.model_config.max_model_len or default_len
        if self.max_model_len > mc.max_position_embeddings:
            raise ValueError(f"--max-model-len {self.max_model_len} exceeds the checkpoint's "
                             f"max_position_embeddings={mc.max_position_embeddings}")
        mc.check_max_model_len(self.max_model_len)
        self.vocab_size = mc.vocab_size
        self.eos_token_ids: list[int] = list(mc.eos_token_ids)
        self.num_layers = mc.num_layers
        self.num_blocks = 0
        # A draft model's KV bytes per block (rank 0 with one, set by ModelRunner): its cache
        # has as many blocks as the pool, so the budget is divided by both together.
        self.draft_block_bytes = 0
        self.kv_cache_bytes = 0  # the pool's and the draft model's
        self.weight_bytes = 0
        self.weight_format = ""  # set by load()
        self.model: CausalLM | None = None
        self.kv_cache: KVCache | None = None

    # ---- loading ----------------------------------------------------------------------------
    def _join_group(self) -> None:
        """Join the torch.distributed group of the ranks and check they all run the same
        configuration (a node started with other flags is refused here, naming the field)."""
        assert self.shard is not None
        cfg = self.config
        par, mc = cfg.parallel_config, cfg.model_config
        store = open_store(par, self.rank, TP_TIMEOUT_S, self.watch_peers)
        self.tp = TPGroup(self.shard, cfg.resolved_backend(), store,
                          f"{store_host(par)}:{par.master_port}", TP_TIMEOUT_S, self.device)
        # plan_key: what this rank's step-plan hello proves it is (worker.remote_plan).
        self.tp.check_same(own={"plan_key": self.plan_key}, fields={
            "model": model_hash(mc.model), "tensor_parallel_size": str(par.tensor_parallel_size),
            "nnodes": str(par.nnodes), "dtype": str(self.dtype), "quantization": mc.quantization,
            "quantization_group_size": str(mc.quantization_group_size),
            "block_size": str(self.block_size), "max_model_len": str(self.max_model_len),
            "max_num_seqs": str(cfg.scheduler_config.max_num_seqs), "device": self.device.type})

    def kv_tier_id(self) -> str:
        """What a KV tier's files are kept under (``ModelInfo.kv_tier_id``): the weights and
        every setting that changes the KV they compute; "" without a tier."""
        cfg = self.config
        if not cfg.cache_config.kv_offload_dir:
            return ""
        mc = cfg.model_config
        return weights_id(mc.model, f"{self.weight_format}|{mc.quantization_group_size}|"
                                    f"tp{cfg.parallel_config.tensor_parallel_size}|{self.device.type}")

    def load(self) -> None:
        mc = self.model_config
        t0, cpu0 = time.perf_counter(), time.process_time()
        rss0 = proc_memory("VmRSS")
        if self.shard is not None:
            self._join_group()
        # CPU bf16/int8/int4: float32 activations, the projections packed as they load.
        plan = weight_plan(self.config.model_config.model, self.dtype, self.config.model_config.quantization,
                           self.config.model_config.quantization_group_size, self.device,
                           ops.backend(self.device) is not None)
        fmt = plan.fmt
        self.weight_format = fmt or str(self.dtype)
        with torch.device("meta"):
            model = CausalLM(self.shard.model_config(mc) if self.shard else mc, self.max_model_len)
        load_weights(model, self.config.model_config.model, plan, shard=self.shard)
        model.tp = self.tp
        self.model = model.eval()
        nparams = sum(p.numel() for p in model.parameters()) + sum(
            m.out_features * m.in_features for m in model.modules() if isinstance(m, PACKED))
        self.weight_bytes = weight_bytes(model)
        weights = f"{fmt} weights, float32 activations" if fmt else str(self.dtype)
        part = f" (rank {self.rank} of {self.shard.size})" if self.shard else ""
        print(f"model: {mc.architecture} {nparams / 1e6:.1f}M params{part}, {weights}, {self.device}, "
              f"{self.weight_bytes / 2**20:.1f} MiB, loaded in {time.perf_counter() - t0:.2f}s "
              f"(cpu {time.process_time() - cpu0:.2f}s), "
              f"peak RSS {proc_memory() / 2**20:.0f} MiB ({rss0 / 2**20:.0f} MiB before loading)",
              file=sys.stderr, flush=True)
        self.num_blocks = self._decide_num_blocks()
        if self.tp is not None:  # one block table for every rank: the smallest pool
            self.num_blocks = self.tp.min_int(self.num_blocks)
        # The ranks of an instance with a cache messager (prefill/decode, a KV tier) share one
        # KV segment, which the messager moves as one pool (worker/kv_cache.py): rank 0 makes
        # it before the others map it.
        role = self.config.kv_transfer_config.role
        messager = role != "mixed" or bool(self.config.cache_config.kv_offload_dir)
        shared = self.tp.size if self.tp is not None and messager else 0
        if shared and self.device.type != "cpu":
            why = f"--role {role}" if role != "mixed" else "--kv-offload-dir"
            raise ValueError(f"{why} with --tensor-parallel-size {shared} runs on CPU only (the "
                             f"ranks share one shared-memory KV segment); use --device cpu")
        if shared and self.rank != 0:
            assert self.tp is not None
            self.tp.barrier()
        self.kv_cache = KVCache(mc.num_layers, self.num_blocks, self.block_size, self._kv_heads,
                                mc.head_dim, self.dtype, self.device,
                                # "<pid>-<hex>" is the id form sweep_stale ties to a live pid.
                                self.config.instance_id or f"{os.getpid()}-{id(self):x}", self.rank,
                                shared_ranks=shared)
        if shared and self.rank == 0:
            assert self.tp is not None
            self.tp.barrier()
        draft = self.draft_block_bytes * self.num_blocks
        self.kv_cache_bytes = self.kv_cache.layout.total_bytes + draft
        tokens = self.num_blocks * self.block_size
        of_draft = f", of which the draft model's {draft / 2**20:.1f} MiB" if draft else ""
        print(f"kv cache: {self.num_blocks} blocks x {self.block_size} tokens "
              f"({self.kv_cache_bytes / 2**20:.1f} MiB{of_draft}): {tokens} tokens, "
              f"{tokens / self.max_model_len:.2f}x max_model_len={self.max_model_len}", file=sys.stderr, flush=True)

    @property
    def _kv_heads(self) -> int:
        return self.shard.kv_heads if self.shard else self.model_config.num_kv_heads

    def _block_bytes(self) -> int:
        mc = self.model_config
        return kv_layout(mc.num_layers, 1, self.block_size, self._kv_heads, mc.head_dim,
                         self.dtype).bytes_per_block

    def _decide_num_blocks(self) -> int:
        mc = self.model_config
        assert self.model is not None

        def cache(nb: int) -> KVCache:  # a throw-away cache for the GPU profiling step
            return KVCache(mc.num_layers, nb, self.block_size, self._kv_heads, mc.head_dim,
                           self.dtype, self.device)
        return decide_num_blocks(self.config, self._block_bytes() + self.draft_block_bytes, self.block_size,
                                 self.max_model_len,
                                 self.device, lambda per_block: profile_gpu_blocks(
                                     self.model, self.config, self.block_size, self.max_model_len,
                                     self.device, cache, per_block), self.weight_bytes)

    def close(self) -> None:
        if self.kv_cache is not None:
            self.kv_cache.close()
            self.kv_cache = None
        self.model = None
        if self.tp is not None:
            self.tp.close()
            self.tp = None
