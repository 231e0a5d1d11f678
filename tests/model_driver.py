"""Test helper: a minimal engine stand-in that drives a ModelRunner with hand-built
SchedulerOutputs (block allocation, chunked prefill under a token budget, decode, finish),
and tiny transformers checkpoints for the parity tests. Test-only: imports transformers.
"""
from __future__ import annotations

import itertools
import os
from dataclasses import dataclass, field

import torch

from pipeline.config import EngineConfig
from pipeline.messages import CachedRequestData, NewRequestData, SchedulerOutput, ids_to_bytes
from pipeline.sampling_params import SamplingParams
from pipeline.worker.model_runner import ModelRunner

_ids = itertools.count()


def instance_id() -> str:
    # "<pid>-<hex>": sweep_stale leaves it alone while this process lives.
    return f"{os.getpid()}-{next(_ids):x}"


def tiny_hf_model(arch: str, path: str, seed: int = 0, max_shard_size: str | None = None, **overrides):
    """Save a randomly initialised transformers model (all weights and biases random)."""
    import transformers as tf
    base = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, vocab_size=320, max_position_embeddings=512,
                rms_norm_eps=1e-6, eos_token_id=2, bos_token_id=1)
    base.update(overrides)
    cfg_cls, model_cls = {"llama": (tf.LlamaConfig, tf.LlamaForCausalLM),
                          "qwen2": (tf.Qwen2Config, tf.Qwen2ForCausalLM),
                          "qwen3": (tf.Qwen3Config, tf.Qwen3ForCausalLM),
                          "mistral": (tf.MistralConfig, tf.MistralForCausalLM)}[arch]
    torch.manual_seed(seed)
    model = model_cls(cfg_cls(**base)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.7, 1.3)
            else:
                p.normal_(0.0, 0.08)
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(path, **kwargs)
    return model


def make_runner(model_dir: str, **cfg) -> ModelRunner:
    base = dict(model=model_dir, device="cpu", dtype="float32", block_size=16, num_blocks=96,
                max_num_seqs=8, max_num_batched_tokens=256, instance_id=instance_id())
    base.update(cfg)
    runner = ModelRunner(EngineConfig.of(**base))
    runner.load()
    return runner


@dataclass
class Req:
    req_id: str
    tokens: list[int]
    max_tokens: int
    params: SamplingParams
    num_prompt: int = 0
    num_computed: int = 0
    blocks: list[int] = field(default_factory=list)
    shared: int = 0  # leading blocks borrowed from another request (prefix cache hit)
    sent: bool = False
    output: list[int] = field(default_factory=list)


class Driver:
    """Schedules requests FCFS under a token budget, like a (much) simplified engine."""

    def __init__(self, runner: ModelRunner, token_budget: int = 256) -> None:
        self.runner = runner
        self.budget = token_budget
        self.free = list(range(runner.num_blocks - 1, -1, -1))
        self.step_id = 0
        self.running: list[Req] = []
        self.finished: list[str] = []
        self.keep: dict[str, Req] = {}
        self.preempted: list[str] = []
        self.outputs = []

    def add(self, req_id: str, prompt: list[int], max_tokens: int,
            params: SamplingParams | None = None, prefix_from: str | None = None,
            prefix_blocks: int = 0, num_prompt: int | None = None) -> Req:
        sp = params or SamplingParams(temperature=0.0, max_tokens=max_tokens)
        r = Req(req_id, list(prompt), max_tokens, sp,
                num_prompt=len(prompt) if num_prompt is None else num_prompt)
        if prefix_from is not None:
            src = self.keep[prefix_from]
            r.blocks = src.blocks[:prefix_blocks]
            r.shared = prefix_blocks
            r.num_computed = prefix_blocks * self.runner.block_size
        self.running.append(r)
        return r

    def step(self) -> bool:
        bs = self.runner.block_size
        budget = self.budget
        new, cached, sched = [], [], {}
        for r in self.running:
            n = min(len(r.tokens) - r.num_computed, budget)
            if n <= 0:
                continue
            need = -(-(r.num_computed + n) // bs) - len(r.blocks)
            fresh = [self.free.pop() for _ in range(max(need, 0))]
            r.blocks.extend(fresh)
            if not r.sent:
                new.append(NewRequestData(r.req_id, ids_to_bytes(r.tokens), r.num_prompt, r.params,
                                          list(r.blocks), r.num_computed))
                r.sent = True
            else:
                cached.append(CachedRequestData(r.req_id, fresh, r.num_computed))
            sched[r.req_id] = n
            budget -= n
        self.step_id += 1
        out = self.runner.execute(SchedulerOutput(
            step_id=self.step_id, new_reqs=new, cached_reqs=cached, num_scheduled_tokens=sched,
            total_num_scheduled_tokens=sum(sched.values()), finished_req_ids=self.finished,
            preempted_req_ids=self.preempted))
        self.preempted = []
        self.outputs.append(out)
        self.finished = []
        by_id = {r.req_id: r for r in self.running}
        for rid, n in sched.items():
            by_id[rid].num_computed += n
        for i, (rid, tok) in enumerate(zip(out.req_ids, out.sampled_token_ids)):
            r = by_id[rid]
            r.tokens.append(tok)
            r.output.append(tok)
            if len(r.output) >= r.max_tokens:
                self.running.remove(r)
                self.finished.append(rid)
                self.keep[rid] = r
        return bool(self.running)

    def preempt(self, req_id: str) -> Req:
        """Recompute-style preemption: free the blocks; the runner drops the row next step."""
        r = next(x for x in self.running if x.req_id == req_id)
        self.running.remove(r)
        self.free.extend(r.blocks[r.shared:])
        self.preempted.append(req_id)
        return r

    def release(self, req_id: str) -> None:
        r = self.keep.pop(req_id)
        self.free.extend(r.blocks[r.shared:])

    def run(self) -> dict[str, list[int]]:
        while self.step():
            pass
        # Flush the finish notices so the runner drops those rows.
        self.step_id += 1
        self.runner.execute(SchedulerOutput(self.step_id, [], [], {}, 0, self.finished, []))
        self.finished = []
        return {rid: r.output for rid, r in self.keep.items()}
