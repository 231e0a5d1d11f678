"""Worker stage: the model runner of one rank. Loads the weights, sizes and owns the paged KV
cache, keeps the persistent batch, and runs one step per SchedulerOutput: apply the diff, one
forward over the flattened varlen batch (prefill chunks with cached context and decodes
mixed), sample for the requests whose known tokens are all computed, and compute the prompt
logprobs of the prefill chunks of requests that ask for them.

Under tensor parallelism (``--tensor-parallel-size N``) there is one runner per rank, each
holding its shard of the weights (``models.parallel``) and a KV cache of its KV heads; every
rank runs every step the same way, and rank 0 samples (the others take its tokens by
broadcast when sampling is random; greedy argmax over the gathered logits is the same
everywhere).

Owns: the model weights, the KV cache memory (KVCache), the InputBatch, the Sampler, on
CUDA the captured decode graphs (DecodeGraphs) and, under tensor parallelism, this rank's
TPGroup.
"""
from __future__ import annotations

import os
import sys
import time
from typing import TYPE_CHECKING

import torch

from pipeline.config import EngineConfig
from pipeline.layers import ops
from pipeline.layers.int4 import PACKED
from pipeline.layers.ops_fused import argmax
from pipeline.messages import ModelRunnerOutput, SchedulerOutput
from pipeline.models.config import load_model_config, model_hash
from pipeline.models.llama import CausalLM
from pipeline.models.loader import load_weights
from pipeline.models.parallel import TPGroup, TPShard
from pipeline.models.weights import weight_bytes
from pipeline.worker.cuda_graphs import DecodeGraphs
from pipeline.worker.device import proc_memory, resolve_dtype, weight_plan, worker_threads
from pipeline.worker.input_batch import InputBatch
from pipeline.worker.kv_cache import KVCache, kv_layout
from pipeline.worker.kv_sizing import decide_num_blocks, profile_gpu_blocks
from pipeline.worker.prompt_logprobs import prompt_logprobs
from pipeline.worker.sampler import Sampler, build_metadata
from pipeline.worker.step_inputs import StepInputs, prepare_inputs
from pipeline.worker.structured import StructuredBatch
from pipeline.worker.threads import ThreadGovernor, usable_cores

if TYPE_CHECKING:
    from pipeline.ipc.layer_signal import LayerSignal

# How long a rank waits for the others to join the group (or, in a collective, for a peer
# that is alive but stuck): a dead peer's closed connection fails a collective at once.
TP_TIMEOUT_S = float(os.environ.get("PIPELINE_TP_TIMEOUT_S", "120"))


class ModelRunner:
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
        self.dtype = resolve_dtype(config.model_config.dtype, mc.torch_dtype, self.device)
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
        self.kv_cache_bytes = 0
        self.weight_bytes = 0
        self.model: CausalLM | None = None
        self.kv_cache: KVCache | None = None
        self.graphs: DecodeGraphs | None = None  # CUDA, one rank: captured decode steps
        self.batch = InputBatch(config.scheduler_config.max_num_seqs, self.max_model_len, self.block_size)
        self.sampler = Sampler(self.device, config.model_config.seed)
        # Rank 0 samples, so it alone keeps the grammars of structured outputs.
        self.structured = StructuredBatch(config.model_config.model, self.vocab_size,
                                          self.eos_token_ids) if rank == 0 else None
        self._signal: LayerSignal | None = None
        self._signal_ranks = 1  # ranks sharing the KV segment (and the signal's layers)
        self._signal_stream = None
        self._step_id = 0

    # ---- loading ----------------------------------------------------------------------------
    def _join_group(self) -> None:
        """Join the torch.distributed group of the ranks and check they all run the same
        configuration (a node started with other flags is refused here, naming the field)."""
        assert self.shard is not None
        cfg = self.config
        par, mc = cfg.parallel_config, cfg.model_config
        self.tp = TPGroup(self.shard, cfg.resolved_backend(), f"tcp://{par.master_addr}:{par.master_port}",
                          TP_TIMEOUT_S, self.device)
        self.tp.check_same({
            "model": model_hash(mc.model), "tensor_parallel_size": str(par.tensor_parallel_size),
            "nnodes": str(par.nnodes), "dtype": str(self.dtype), "quantization": mc.quantization,
            "quantization_group_size": str(mc.quantization_group_size),
            "block_size": str(self.block_size), "max_model_len": str(self.max_model_len),
            "max_num_seqs": str(cfg.scheduler_config.max_num_seqs), "device": self.device.type})

    def load(self) -> None:
        mc = self.model_config
        t0 = time.perf_counter()
        rss0 = proc_memory("VmRSS")
        if self.shard is not None:
            self._join_group()
        # CPU bf16/int8/int4: float32 activations, the projections packed as they load.
        plan = weight_plan(self.config.model_config.model, self.dtype, self.config.model_config.quantization,
                           self.config.model_config.quantization_group_size, self.device,
                           ops.backend(self.device) is not None)
        fmt = plan.fmt
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
              f"{self.weight_bytes / 2**20:.1f} MiB, loaded in {time.perf_counter() - t0:.2f}s, "
              f"peak RSS {proc_memory() / 2**20:.0f} MiB ({rss0 / 2**20:.0f} MiB before loading)",
              file=sys.stderr, flush=True)
        self.num_blocks = self._decide_num_blocks()
        if self.tp is not None:  # one block table for every rank: the smallest pool
            self.num_blocks = self.tp.min_int(self.num_blocks)
        # A prefill/decode instance's ranks share one KV segment, which its cache messager
        # ships as one pool (worker/kv_cache.py): rank 0 makes it before the others map it.
        shared = self.tp.size if self.tp is not None and self.config.kv_transfer_config.role != "mixed" else 0
        if shared and self.device.type != "cpu":
            raise ValueError(f"--role {self.config.kv_transfer_config.role} with --tensor-parallel-size "
                             f"{shared} runs on CPU only (the ranks share one shared-memory KV segment); "
                             f"use --device cpu")
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
        self.kv_cache_bytes = self.kv_cache.layout.total_bytes
        tokens = self.num_blocks * self.block_size
        print(f"kv cache: {self.num_blocks} blocks x {self.block_size} tokens "
              f"({self.kv_cache_bytes / 2**20:.1f} MiB): {tokens} tokens, {tokens / self.max_model_len:.2f}x "
              f"max_model_len={self.max_model_len}", file=sys.stderr, flush=True)
        # A prefill instance keeps its layer signal attached, which rules the graphs out.
        if self.device.type == "cuda" and self.tp is None and self.config.kv_transfer_config.role != "prefill":
            self.graphs = DecodeGraphs(model, self.kv_cache.layers, self.config.scheduler_config.max_num_seqs,
                                       self.batch.max_blocks_per_req, self.device)
            self.graphs.capture()

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
        return decide_num_blocks(self.config, self._block_bytes(), self.block_size, self.max_model_len,
                                 self.device, lambda per_block: profile_gpu_blocks(
                                     self.model, self.config, self.block_size, self.max_model_len,
                                     self.device, cache, per_block), self.weight_bytes)

    def attach_layer_signal(self, sig) -> None:
        """After each layer's K/V write, publish (step_id, layer) on ``sig`` (a LayerSignal;
        None detaches). On CUDA the publication is stream-ordered on a side stream. The ranks
        of a shared KV segment publish their layer l as ``l * ranks + rank``."""
        assert self.kv_cache is not None, "load() first"
        pool_layers = self.kv_cache.layout.num_layers
        if sig is not None and sig.num_layers < pool_layers:
            raise ValueError(f"layer signal has {sig.num_layers} layers, the KV pool {pool_layers}")
        self._signal_ranks = pool_layers // self.num_layers
        self._drain_signal_stream()  # before the old signal can be dropped and unmapped
        self._signal = sig
        self._signal_stream = (torch.cuda.Stream(self.device)
                               if sig is not None and self.device.type == "cuda" else None)

    def _drain_signal_stream(self) -> None:
        # Queued host functions hold the old signal's raw shm address: let them run before
        # that mapping can go away.
        if self._signal_stream is not None:
            self._signal_stream.synchronize()

    # ---- one step ---------------------------------------------------------------------------
    def _apply_diff(self, sched: SchedulerOutput) -> None:
        b, so = self.batch, self.structured
        for rid in (*sched.finished_req_ids, *sched.preempted_req_ids):
            b.remove(rid)
            if so is not None:
                so.remove(rid)
        for new in sched.new_reqs:
            b.remove(new.req_id)  # a resumed request replaces its stale row, if any
            row = b.add(new)
            grammar = new.sampling_params.structured_outputs
            if so is not None and grammar is not None:  # its output so far replays on the matcher
                so.add(new.req_id, grammar, b.token_ids[row, new.num_prompt_tokens:b.num_tokens[row]].tolist())
        for cached in sched.cached_reqs:
            if cached.req_id not in b:
                raise ValueError(f"step {sched.step_id}: cached request {cached.req_id!r} "
                                 f"is not in the worker's batch")
            b.append_blocks(cached.req_id, cached.new_block_ids)
            b.num_computed_tokens[b.index[cached.req_id]] = cached.num_computed_tokens

    def prepare_inputs(self, sched: SchedulerOutput) -> StepInputs:
        # A decode step replays a CUDA graph unless a layer signal must fire per layer.
        graphs = self.graphs if self._signal is None else None
        return prepare_inputs(self.batch, sched, self.device, graphs)

    def _on_kv_written(self, layer: int) -> None:
        assert self._signal is not None  # only installed while a signal is attached
        if self._signal_ranks > 1:
            layer = layer * self._signal_ranks + self.rank
        if self._signal_stream is not None:
            # Stream-ordered: a host function publishes once the layer's KV write is done,
            # without stalling this thread or the compute stream.
            ops.enqueue_layer_signal(self._signal.address, self._step_id, layer, self._signal_stream)
        else:
            self._signal.publish(self._step_id, layer)

    def execute(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        if self.model is None or self.kv_cache is None:
            raise RuntimeError("ModelRunner.load() must run before execute()")
        self._apply_diff(sched)
        if sched.total_num_scheduled_tokens == 0 or not sched.num_scheduled_tokens:
            return ModelRunnerOutput(step_id=sched.step_id, req_ids=[], sampled_token_ids=[])
        self._step_id = sched.step_id
        # Step metadata is built outside inference mode: the ops cache their validation keyed
        # on tensor version counters, which inference tensors do not have.
        inp = self.prepare_inputs(sched)
        so = self.structured
        if so is not None:  # grammar masks fill in the pool while the forward runs
            so.start_masks([self.batch.req_ids[r] for r in inp.rows[inp.sample_batch_idx]] if len(so) else [])
        gov = self.thread_governor
        if gov is not None:
            gov.begin()
        with torch.inference_mode():
            out = self._forward_and_sample(sched.step_id, inp)
        if gov is not None:
            gov.end(sched.total_num_scheduled_tokens)
        return out

    def _forward_and_sample(self, step_id: int, inp: StepInputs) -> ModelRunnerOutput:
        model, kv = self.model, self.kv_cache
        assert model is not None and kv is not None  # execute() checked
        signal = self._on_kv_written if self._signal is not None else None
        if inp.graph_size:
            assert self.graphs is not None
            hidden = self.graphs.replay(inp.graph_size)
        else:
            hidden = model(inp.input_ids, inp.positions, inp.meta, kv.layers, signal)
        b = self.batch
        prompt_lps = (prompt_logprobs(model, b, hidden, inp.rows, inp.num_scheduled, self.device)
                      if b.num_prompt_logprob_rows else [])
        b.num_computed_tokens[inp.rows] += inp.num_scheduled
        if len(inp.sample_batch_idx) == 0:
            return ModelRunnerOutput(step_id=step_id, req_ids=[], sampled_token_ids=[],
                                     prompt_logprobs=prompt_lps)
        logits = model.compute_logits(hidden.index_select(0, inp.logits_indices))
        sample_rows = inp.rows[inp.sample_batch_idx]
        if self.structured is not None:
            self.structured.apply_masks(logits)
        if b.num_needs_sampler == 0 and (self.tp is None or self.rank == 0 or not b.num_structured):
            # Every live request is plain greedy: the sampler would only take the argmax (of
            # the masked logits, for a grammar's rows: rank 0 masked them above).
            tokens, logprobs = argmax(logits), None
        elif self.tp is None or self.rank == 0:
            md = build_metadata(b, sample_rows, self.vocab_size, self.eos_token_ids, self.device)
            tokens, logprobs = self.sampler(logits, md)
        else:  # rank 0 samples (and masks); its tokens arrive below
            tokens, logprobs = torch.empty(len(sample_rows), dtype=torch.int64, device=self.device), None
        if self.tp is not None and (b.num_needs_sampler or b.num_structured):
            tokens = self.tp.broadcast(tokens.to(torch.int64), 0)
        tokens_np = tokens.cpu().numpy()
        b.append_tokens(sample_rows, tokens_np)
        if self.structured is not None and len(self.structured):
            self.structured.accept([b.req_ids[r] for r in sample_rows.tolist()], tokens_np.tolist())
        return ModelRunnerOutput(step_id=step_id, req_ids=[b.req_ids[r] for r in sample_rows.tolist()],
                                 sampled_token_ids=tokens_np.tolist(), logprobs=logprobs or [],
                                 prompt_logprobs=prompt_lps)

    def close(self) -> None:
        self._drain_signal_stream()
        self.graphs = None  # its graphs hold the KV cache's addresses
        if self.structured is not None:
            self.structured.close()
        if self.kv_cache is not None:
            self.kv_cache.close()
            self.kv_cache = None
        self.model = None
        if self.tp is not None:
            self.tp.close()
            self.tp = None
