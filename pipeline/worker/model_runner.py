"""Worker stage: the model runner of one rank. On the rank's loaded model and KV cache
(`RankModel`, rank_model.py) it keeps the persistent batch and runs one step per
SchedulerOutput: apply the diff, one forward over the flattened varlen batch (prefill chunks
with cached context and decodes mixed), sample for the requests whose known tokens are all
computed, and compute the prompt logprobs of the prefill chunks of requests that ask for them.
A prefill instance's runner publishes each layer's KV write on a LayerSignal for its cache
messager.

Under tensor parallelism every rank runs every step the same way, and rank 0 samples (the
others take its tokens by broadcast when sampling is random; greedy argmax over the gathered
logits is the same everywhere).

Owns (besides what RankModel owns): the InputBatch, the Sampler, rank 0's StructuredBatch, on
CUDA the captured decode graphs (DecodeGraphs).
State: the attached layer signal (and its CUDA side stream), the current step id.
"""
from __future__ import annotations

import time
from typing import TYPE_CHECKING

import numpy as np
import torch

from pipeline.config import EngineConfig
from pipeline.layers import flash_prefill, ops
from pipeline.layers.ops_fused import argmax
from pipeline.messages import ModelRunnerOutput, PromptLogprobs, SchedulerOutput
from pipeline.worker.cuda_graphs import DecodeGraphs
from pipeline.worker.input_batch import InputBatch
from pipeline.worker.pooling import Pooler
from pipeline.worker.prompt_logprobs import prompt_logprobs
from pipeline.worker.rank_model import RankModel
from pipeline.worker.sampler import Sampler, build_metadata
from pipeline.worker.spec.draft import DraftModel, draft_kv_bytes_per_block
from pipeline.worker.spec.step import mask_drafts, verify_step
from pipeline.worker.spec.verify import SpecDecoder
from pipeline.worker.step_inputs import StepInputs, prepare_inputs
from pipeline.worker.structured import StructuredBatch

if TYPE_CHECKING:
    from pipeline.ipc.layer_signal import LayerSignal


class ModelRunner(RankModel):
    def __init__(self, config: EngineConfig, rank: int = 0) -> None:
        super().__init__(config, rank)
        self.graphs: DecodeGraphs | None = None  # CUDA, one rank: captured decode steps
        self.batch = InputBatch(config.scheduler_config.max_num_seqs, self.max_model_len, self.block_size)
        self.sampler = Sampler(self.device, config.model_config.seed)
        self.pooler = Pooler(config.model_config.pooling)  # embedding requests (rank 0 answers)
        # Rank 0 samples, so it alone keeps the grammars of structured outputs.
        self.structured = StructuredBatch(config.model_config.model, self.vocab_size,
                                          self.eos_token_ids) if rank == 0 else None
        spec = config.speculative_config
        # Speculative decoding: rank 0 proposes, every rank verifies the drafts it is sent.
        self.spec = SpecDecoder(spec, proposes=rank == 0) if spec is not None else None
        if spec is not None and spec.method == "draft_model" and rank == 0:  # its KV is in the budget
            self.draft_block_bytes = draft_kv_bytes_per_block(config, spec.model, self.block_size, self.device)
        self.spec_idle: list[str] = []  # the step's requests to propose nothing for
        self.spec_fewer: dict[str, int] = {}  # ... and to propose fewer than K drafts for
        self._signal: LayerSignal | None = None
        self._signal_ranks = 1  # ranks sharing the KV segment (and the signal's layers)
        self._signal_stream = None
        self._step_id = 0
        self.flash = False  # set by load(): long query runs on tensor cores (CUDA, fp16/bf16)

    def load(self) -> None:
        super().load()
        spec = self.config.speculative_config
        if self.spec is not None and spec is not None and spec.method == "draft_model" and self.rank == 0:
            assert self.kv_cache is not None  # loaded just now
            self.spec.attach_draft(DraftModel(self.config, spec.model, self.device, self.num_blocks,
                                              self.block_size, self.max_model_len, self.vocab_size))
        self.flash = flash_prefill.supported(self.device, self.dtype, self.model_config.head_dim)
        # A prefill instance keeps its layer signal attached, which rules the graphs out;
        # --enforce-eager rules them out too.
        if (self.device.type == "cuda" and self.tp is None and self.config.kv_transfer_config.role != "prefill"
                and not self.config.model_config.enforce_eager):
            assert self.model is not None and self.kv_cache is not None  # loaded just now
            self.graphs = DecodeGraphs(self.model, self.kv_cache.layers,
                                       self.config.scheduler_config.max_num_seqs,
                                       self.batch.max_blocks_per_req, self.device)
            self.graphs.capture()

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
        b, so, spec = self.batch, self.structured, self.spec
        if spec is not None:
            for rid in sched.finished_req_ids:
                spec.finished(b, rid)
            for rid in sched.preempted_req_ids:
                spec.removed(rid)
        for rid in (*sched.finished_req_ids, *sched.preempted_req_ids):
            b.remove(rid)
            self.pooler.forget(rid)
            if so is not None:
                so.remove(rid)
        for new in sched.new_reqs:
            b.remove(new.req_id)  # a resumed request replaces its stale row, if any
            row = b.add(new)
            grammar = new.sampling_params.structured_outputs
            if so is not None and grammar is not None:  # its output so far replays on the matcher
                so.add(new.req_id, grammar, b.token_ids[row, new.num_prompt_tokens:b.num_tokens[row]].tolist(),
                       new.grammar)
        for cached in sched.cached_reqs:
            if cached.req_id not in b:
                raise ValueError(f"step {sched.step_id}: cached request {cached.req_id!r} "
                                 f"is not in the worker's batch")
            b.append_blocks(cached.req_id, cached.new_block_ids)
            b.num_computed_tokens[b.index[cached.req_id]] = cached.num_computed_tokens
        if spec is not None:
            spec.stage(b, sched.spec_token_ids)
            self.spec_idle, self.spec_fewer = sched.spec_idle, sched.spec_fewer

    def prepare_inputs(self, sched: SchedulerOutput) -> StepInputs:
        # A decode step replays a CUDA graph unless a layer signal must fire per layer.
        graphs = self.graphs if self._signal is None else None
        return prepare_inputs(self.batch, sched, self.device, graphs, self.flash)

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
            # A row verifying drafts gets its masks after the forward (draft_masks), one per position.
            staged = self.spec.staged if self.spec is not None else {}
            so.start_masks([None if r in staged else self.batch.req_ids[r]
                            for r in inp.rows[inp.sample_batch_idx].tolist()] if len(so) else [])
        gov = self.thread_governor
        if gov is not None:
            gov.begin()
        t0 = time.perf_counter()
        with torch.inference_mode():
            out = self._forward_and_sample(sched.step_id, inp)
        out.execute_s = time.perf_counter() - t0  # what a token costs (engine.spec_decode)
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
        # Hidden states are the same on every rank (after the all-reduce): rank 0 answers.
        pooled = (self.pooler.pool(model, b, hidden, inp.rows, inp.num_scheduled)
                  if b.num_embed and self.rank == 0 else [])
        b.num_computed_tokens[inp.rows] += inp.num_scheduled
        out = self._sample(step_id, inp, hidden, prompt_lps)
        out.pooled = pooled
        return out

    def _sample(self, step_id: int, inp: StepInputs, hidden: torch.Tensor,
                prompt_lps: list[PromptLogprobs]) -> ModelRunnerOutput:
        """Sample the rows whose known tokens are all computed now (``inp.sample_batch_idx``)."""
        model, b = self.model, self.batch
        assert model is not None  # execute() checked
        if len(inp.sample_batch_idx) == 0:
            return ModelRunnerOutput(step_id=step_id, req_ids=[], sampled_token_ids=[],
                                     prompt_logprobs=prompt_lps)
        sample_rows = inp.rows[inp.sample_batch_idx]
        spec_logits: torch.Tensor | None = None
        by_pos: list[np.ndarray] = []
        if self.spec is not None and self.spec.staged:  # the draft positions' logits too, in one product
            idx, by_pos = self.spec.positions(sample_rows, inp.logits_indices.cpu().numpy())
            n = len(inp.sample_batch_idx)
            both = model.compute_logits(hidden.index_select(
                0, torch.cat([inp.logits_indices, torch.from_numpy(idx).to(inp.logits_indices.device)])))
            logits, spec_logits = both[:n], both[n:]
            if self.structured is not None and len(self.structured):
                mask_drafts(self.structured, self.spec, self.batch, both, sample_rows, by_pos)
        else:
            logits = model.compute_logits(hidden.index_select(0, inp.logits_indices))
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
        if self.spec is not None:
            return verify_step(self, step_id, tokens, logprobs, sample_rows, spec_logits, by_pos, prompt_lps)
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
        super().close()
