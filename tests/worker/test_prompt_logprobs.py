"""prompt_logprobs: each prompt token's logprob given the tokens before it (top-k like
``logprobs``), computed by the worker for prefill chunks, sent once per token by the engine
(even when a preempted prefill reruns), never served from the prefix cache, and delivered
as ``RequestResult.prompt_logprobs`` (entry 0 is None). (The results and outputs rings are
sized for a logprobs entry per batched token: runtime/ring_sizes.py.)

Oracle: transformers' log-softmax over the prompt on a tiny checkpoint.
"""
from __future__ import annotations

import json
import time

import pytest
import torch
from e2e_helpers import make_tiny_model, run_pipe
from model_driver import Driver, instance_id, make_runner, tiny_hf_model

from pipeline.config import EngineConfig
from pipeline.engine.fake_worker import FakeWorker
from pipeline.engine.growth import preempt
from pipeline.engine.scheduler import Scheduler
from pipeline.messages import EngineOutput, EngineRequest, ids_to_bytes
from pipeline.sampling_params import SamplingParams

PROMPT = [(11 * i + 5) % 300 + 3 for i in range(45)]
K = 4


@pytest.fixture(scope="module")
def hf_and_dir(tmp_path_factory):
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    path = str(tmp_path_factory.mktemp("llama"))
    hf = tiny_hf_model("llama", path, seed=3)
    yield hf, path
    torch.set_num_threads(old)


def oracle(hf, prompt: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return torch.log_softmax(hf(torch.tensor([prompt])).logits[0].float(), dim=-1)


def check_against(lsm: torch.Tensor, prompt: list[int], entries) -> None:
    assert len(entries) == len(prompt) - 1
    for p, e in enumerate(entries, start=1):
        assert e.token_id == prompt[p]
        assert e.logprob == pytest.approx(lsm[p - 1, prompt[p]].item(), abs=1e-4)
        want_vals, want_ids = lsm[p - 1].topk(K)
        assert e.top_logprobs == pytest.approx(want_vals.tolist(), abs=1e-4)
        assert e.top_ids == want_ids.tolist()


@pytest.mark.parametrize("budget", [256, 16, 7])  # whole prompt, chunks of 16, odd chunks
def test_worker_matches_transformers_over_prefill_chunks(hf_and_dir, budget):
    hf, path = hf_and_dir
    runner = make_runner(path)
    try:
        d = Driver(runner, token_budget=budget)
        d.add("a", PROMPT, 3, params=SamplingParams(temperature=0.0, max_tokens=3, prompt_logprobs=K))
        d.add("b", PROMPT[:9], 3)  # company that does not ask
        d.run()
        chunks = [c for o in d.outputs for c in o.prompt_logprobs]
        assert {c.req_id for c in chunks} == {"a"}
        starts = [c.start for c in chunks]
        assert starts[0] == 1 and all(s2 == s1 + len(c.logprobs)
                                      for s1, s2, c in zip(starts, starts[1:], chunks))
        check_against(oracle(hf, PROMPT), PROMPT, [e for c in chunks for e in c.logprobs])
    finally:
        runner.close()


# -- the engine: once per token, no prefix-cache hit, bounded per step ------------------------
def engine(num_blocks=64, budget=64, block_size=4):
    cfg = EngineConfig.of(max_num_seqs=8, max_num_batched_tokens=budget)
    return (Scheduler(cfg, num_blocks, block_size, 128, hash_key=b"t"),
            FakeWorker(num_blocks, block_size, 128, 48, [0], check_kv=True))


def add(sched, rid, prompt, **sp):
    sched.add_request(EngineRequest(rid, ids_to_bytes(prompt), SamplingParams(**sp), time.time(), [0]))


def prompt_entries(outs: list[EngineOutput], rid: str) -> list:
    return [e for o in outs if o.req_id == rid for e in (o.prompt_logprobs or [])]


def test_engine_sends_each_prompt_token_once_across_preemption():
    sched, worker = engine(budget=8)
    prompt = list(range(1, 31))
    add(sched, "a", prompt, max_tokens=4, ignore_eos=True, prompt_logprobs=0)
    outs: list[EngineOutput] = []
    for _ in range(2):  # two prefill chunks of 8
        so = sched.schedule()
        outs += sched.update_from_output(so, worker.execute(so))
    req = sched.requests["a"]
    sched.running.remove(req)
    preempt(sched, req)  # what a block shortage does: the prefill reruns from token 0
    while sched.has_unfinished_requests():
        so = sched.schedule()
        outs += sched.update_from_output(so, worker.execute(so))
        assert sched.check_invariants() == []
    entries = prompt_entries(outs, "a")
    # The fake worker's logprob of prompt token p is -p: every token once, in order.
    assert [e.logprob for e in entries] == [-float(p) for p in range(1, 30)]
    assert [e.token_id for e in entries] == prompt[1:]
    assert sched.stats().computed_tokens > 30 + 3  # the rerun did happen


def test_cached_prefix_is_not_used_for_a_request_that_asks():
    sched, worker = engine()
    prompt = list(range(1, 22))
    add(sched, "warm", prompt, max_tokens=1)
    while sched.has_unfinished_requests():
        so = sched.schedule()
        sched.update_from_output(so, worker.execute(so))
    hits = sched.stats().prefix_cache_hit_tokens
    add(sched, "a", prompt, max_tokens=1, prompt_logprobs=1)
    add(sched, "b", prompt, max_tokens=1)  # same prompt, no prompt logprobs: hits the cache
    outs = []
    while sched.has_unfinished_requests():
        so = sched.schedule()
        outs += sched.update_from_output(so, worker.execute(so))
    assert len(prompt_entries(outs, "a")) == 20 and prompt_entries(outs, "b") == []
    assert sched.stats().prefix_cache_hit_tokens == hits + 20  # b's 5 blocks; a none


# -- the whole way: real worker, engine, token processor --------------------------------------
def test_real_engine_cached_prefix_still_gives_prompt_logprobs(hf_and_dir):
    from pipeline.worker.model_runner import ModelRunner
    hf, path = hf_and_dir
    cfg = EngineConfig.of(model=path, device="cpu", dtype="float32", block_size=16, num_blocks=96,
                       max_num_seqs=8, max_num_batched_tokens=20, instance_id=instance_id())
    runner = ModelRunner(cfg)
    runner.load()
    try:
        sched = Scheduler(cfg, runner.num_blocks, runner.block_size, runner.max_model_len)
        outs: list[EngineOutput] = []
        for rid, sp in (("warm", SamplingParams(max_tokens=1)),
                        ("a", SamplingParams(max_tokens=2, prompt_logprobs=K))):
            sched.add_request(EngineRequest(rid, ids_to_bytes(PROMPT), sp, time.time(), [2]))
            while sched.has_unfinished_requests():
                so = sched.schedule()
                outs += sched.update_from_output(so, runner.execute(so))
        check_against(oracle(hf, PROMPT), PROMPT, prompt_entries(outs, "a"))
    finally:
        runner.close()


def test_pipe_mode_answer_carries_prompt_logprobs(tmp_path):
    model = make_tiny_model(tmp_path / "m")
    prompt = [5, 17, 9, 30, 2, 44, 8]
    lines = [json.dumps({"id": "a", "prompt_token_ids": prompt, "max_tokens": 2, "prompt_logprobs": 2,
                         "logprobs": 1}),
             json.dumps({"id": "b", "prompt_token_ids": prompt, "max_tokens": 2})]
    rc, answers, err = run_pipe(model, lines)
    assert rc == 0, err
    res = {a["id"]: a for a in answers}
    plp = res["a"]["prompt_logprobs"]
    assert plp[0] is None and len(plp) == len(prompt)
    assert [e[0] for e in plp[1:]] == prompt[1:]  # TokenLogprobs travels as an array
    assert all(len(e[2]) == 2 and e[1] <= 0.0 for e in plp[1:])
    assert res["a"]["cumulative_logprob"] == pytest.approx(sum(e[1] for e in res["a"]["logprobs"]))
    assert res["b"]["prompt_logprobs"] is None
