"""Acceptance: the worker matches transformers on checkpoints written by its save_pretrained.

Logits within 1e-4 (float32) on prompts of several lengths, and 64-token greedy continuations
token-identical alone, batched with others, with a chunked prefill, and with part of the
prompt served from blocks an earlier request filled (prefix-cache hit).
"""
from __future__ import annotations

import os

import pytest
import torch
from model_driver import Driver, make_runner, tiny_hf_model

from pipeline.messages import NewRequestData, SchedulerOutput, ids_to_bytes
from pipeline.sampling_params import SamplingParams

CASES = {
    "llama-untied-gqa": ("llama", {}),
    "llama-tied-mqa": ("llama", {"tie_word_embeddings": True, "num_key_value_heads": 1}),
    "llama-bias": ("llama", {"attention_bias": True, "mlp_bias": True, "rope_theta": 500000.0}),
    "llama3-rope-scaling": ("llama", {"rope_scaling": {
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 32}, "rope_theta": 500000.0}),
    "qwen2-bias-headdim": ("qwen2", {"head_dim": 24, "tie_word_embeddings": True}),
    "qwen3-qknorm": ("qwen3", {"head_dim": 32, "rms_norm_eps": 1e-5}),
    "mistral": ("mistral", {"sliding_window": None}),
    "llama-sharded": ("llama", {"max_shard_size": "60KB"}),
}
PROMPT_LENS = (1, 7, 16, 17, 45)
GEN = 64


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    # Tiny matmuls: thread hand-offs cost more than the math on a shared 2-core machine.
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)


@pytest.fixture(scope="module", params=list(CASES))
def case(request, tmp_path_factory):
    arch, overrides = CASES[request.param]
    overrides = dict(overrides)
    shard = overrides.pop("max_shard_size", None)
    path = str(tmp_path_factory.mktemp(request.param))
    hf = tiny_hf_model(arch, path, seed=len(request.param), max_shard_size=shard, **overrides)
    if shard:
        assert os.path.exists(os.path.join(path, "model.safetensors.index.json"))
    runner = make_runner(path)
    refs = [hf_greedy(hf, p, GEN) for p in prompts(runner.vocab_size, seed=2)]
    yield request.param, hf, runner, refs
    name = runner.kv_cache.spec.shm_name
    runner.close()
    assert not os.path.exists("/dev/shm" + name)


def prompts(vocab: int, seed: int = 1) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in PROMPT_LENS]


def hf_greedy(hf, prompt: list[int], n: int) -> list[int]:
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n,
                          min_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def test_logits_match_transformers(case):
    """All prompts in ONE varlen forward; every position's logits against transformers."""
    _, hf, runner, _ = case
    ps = prompts(runner.vocab_size)
    bs = runner.block_size
    new, sched, next_block = [], {}, 0
    for i, p in enumerate(ps):
        nb = -(-len(p) // bs)
        new.append(NewRequestData(f"p{i}", ids_to_bytes(p), len(p), SamplingParams(temperature=0.0),
                                  list(range(next_block, next_block + nb)), 0))
        next_block += nb
        sched[f"p{i}"] = len(p)
    so = SchedulerOutput(1, new, [], sched, sum(sched.values()), [], [])
    runner._apply_diff(so)
    inp = runner.prepare_inputs(so)
    with torch.inference_mode():
        hidden = runner.model(inp.input_ids, inp.positions, inp.meta, runner.kv_cache.layers)
        ours = runner.model.compute_logits(hidden)
    runner._apply_diff(SchedulerOutput(2, [], [], {}, 0, list(sched), []))
    assert len(runner.batch) == 0
    start = 0
    for p in ps:
        with torch.no_grad():
            ref = hf(torch.tensor([p])).logits[0].float()
        diff = (ours[start:start + len(p)] - ref).abs().max().item()
        assert diff < 1e-4, f"prompt of {len(p)} tokens: max |logit diff| {diff:.2e}"
        start += len(p)


def test_greedy_alone_and_batched(case):
    _, hf, runner, refs = case
    ps = prompts(runner.vocab_size, seed=2)
    # Alone: one request at a time.
    for i in (0, 4):
        d = Driver(runner)
        d.add("solo", ps[i], GEN)
        assert d.run()["solo"] == refs[i], f"prompt {i} alone"
    # Batched: all together, with staggered lengths so prefills and decodes mix in one step.
    d = Driver(runner)
    for i, p in enumerate(ps):
        d.add(f"r{i}", p, GEN - 3 * i)
    got = d.run()
    for i in range(len(ps)):
        assert got[f"r{i}"] == refs[i][:GEN - 3 * i], f"prompt {i} in a batch"
    assert any(len(o.req_ids) > 1 for o in d.outputs)


def test_greedy_chunked_prefill(case):
    _, hf, runner, refs = case
    p, ref = prompts(runner.vocab_size, seed=2)[4], refs[4]
    d = Driver(runner, token_budget=10)  # the 45-token prompt spans 5 steps, off block edges
    d.add("chunked", p, GEN)
    d.add("other", prompts(runner.vocab_size, seed=4)[3], 20)
    got = d.run()
    assert got["chunked"] == ref


def test_greedy_with_cached_prefix(case):
    _, hf, runner, _ = case
    bs = runner.block_size
    first = prompts(runner.vocab_size, seed=5)[4]  # 45 tokens: 2 full blocks
    second = first[:2 * bs] + prompts(runner.vocab_size, seed=6)[2]
    ref = hf_greedy(hf, second, GEN)
    d = Driver(runner)
    d.add("first", first, 4)
    d.run()
    d.add("second", second, GEN, prefix_from="first", prefix_blocks=2)
    got = d.run()
    assert got["second"] == ref
    d.release("first")
    d.release("second")
