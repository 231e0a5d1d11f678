"""Tensor parallelism on CPU over gloo (models/parallel.py, worker/model_runner.py): two worker
ranks give the greedy continuations of one rank, with logprobs within 1e-4, for Llama
(`pipeline make-model` and transformers' save_pretrained), Qwen2 (q/k/v biases, a single KV
head replicated on both ranks, a vocabulary that two does not divide), Qwen3 (q/k norms) and
Mistral, through the whole pipeline (`pipeline run`), with chunked prefill, prefix-cache hits
and preemption in the same run. Also: the shard arithmetic and a split the checkpoint refuses.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from e2e_helpers import make_tiny_model, run_pipe, shm_entries
from model_driver import tiny_hf_model

from pipeline.models.config import load_model_config
from pipeline.models.parallel import TPShard

# Chunked prefill (32-token budget against 40-90-token prompts), prefix-cache hits (two
# prompts share 48 tokens) and preemption (24 blocks of 16 for 8 requests of up to 130 tokens).
FLAGS = ("--max-num-batched-tokens", "32", "--num-blocks", "24", "--max-model-len", "160",
         "--worker-threads", "1")


def _requests() -> list[str]:
    shared = [(7 * i) % 1900 + 40 for i in range(48)]
    prompts = [shared + [5, 6, 7], shared + [9, 8], *[[(31 * i + 17 * j) % 1990 + 30 for j in range(40 + 10 * i)]
                                                      for i in range(6)]]
    return [json.dumps({"id": f"r{i}", "prompt_token_ids": p, "max_tokens": 40, "temperature": 0,
                        "ignore_eos": True, "logprobs": 3}) for i, p in enumerate(prompts)]


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tp")
    made = make_tiny_model(root / "make-model")
    out = {"make-model llama": made}
    for name, arch, extra in (("llama", "llama", {}),
                              ("qwen2 (bias, 1 KV head, odd vocab)", "qwen2",
                               {"num_key_value_heads": 1, "vocab_size": 2051}),
                              ("qwen3", "qwen3", {"head_dim": 16}),
                              ("mistral", "mistral", {})):
        d = root / arch
        tiny_hf_model(arch, str(d), seed=3, **{"vocab_size": 2048, **extra})
        for f in ("tokenizer.json", "tokenizer_config.json"):  # the pipeline needs a tokenizer
            if (made / f).exists():
                shutil.copy(made / f, d / f)
        out[name] = d
    return out


def _run(model: Path, tp: int, tmp_path: Path) -> tuple[dict, dict]:
    stats = tmp_path / f"stats-tp{tp}.json"
    rc, answers, err = run_pipe(model, _requests(), *FLAGS, "--tensor-parallel-size", str(tp),
                                "--stats-json", str(stats))
    assert rc == 0, err[-3000:]
    by_id = {a["id"]: a for a in answers}
    assert len(by_id) == 8 and all(a.get("error") is None for a in answers), answers
    return by_id, json.loads(stats.read_text())


@pytest.mark.parametrize("name", ["make-model llama", "llama", "qwen2 (bias, 1 KV head, odd vocab)",
                                  "qwen3", "mistral"])
def test_two_ranks_decode_what_one_rank_decodes(models, name, tmp_path):
    one, stats1 = _run(models[name], 1, tmp_path)
    two, stats2 = _run(models[name], 2, tmp_path)
    assert stats2["num_preemptions"] > 0 and stats1["num_preemptions"] > 0
    assert stats2["prefix_cache_hit_tokens"] >= 32  # shared prompts, resumed requests
    for rid, a in one.items():
        b = two[rid]
        compared = 0
        for la, lb in zip(a["logprobs"], b["logprobs"], strict=True):
            (ta, va, ida, topa), (tb, vb, idb, topb) = la, lb
            assert abs(topa[0] - topb[0]) < 1e-4, (rid, la, lb)
            if ta != tb:
                # Only a near-tie of a random model's logits may flip greedy decoding; then the
                # texts part ways and nothing after is comparable.
                assert abs(topa[0] - topa[1]) < 1e-4, (rid, la, lb)
                break
            assert abs(va - vb) < 1e-4 and ida == idb, (rid, la, lb)
            assert all(abs(x - y) < 1e-4 for x, y in zip(topa, topb)), (rid, la, lb)
            compared += 1
        assert compared >= 8, (rid, compared)


def test_shards_cover_every_head_and_row(models):
    mc = load_model_config(models["qwen2 (bias, 1 KV head, odd vocab)"])
    shards = [TPShard.of(mc, r, 2) for r in range(2)]
    assert [s.q_rows() for s in shards] == [(0, 32), (32, 64)]
    assert [s.kv_rows() for s in shards] == [(0, 16), (0, 16)]  # the one KV head, on both
    assert [s.vocab_rows() for s in shards] == [(0, 1026), (1026, 2051)]
    assert shards[1].vocab_per_rank == 1026 and shards[1].model_config(mc).vocab_size == 1026
    four = [TPShard.of(load_model_config(models["llama"]), r, 4) for r in range(4)]
    assert [s.first_kv_head for s in four] == [0, 0, 1, 1] and {s.kv_heads for s in four} == {1}


def test_a_split_the_checkpoint_does_not_allow_is_refused_naming_the_field(models, tmp_path):
    rc, answers, err = run_pipe(models["llama"], [], "--tensor-parallel-size", "3")
    assert rc != 0 and answers == []
    assert "--tensor-parallel-size 3 does not split the checkpoint's num_attention_heads=4" in err
    assert not any(shm_entries(""))


def test_llm_with_two_ranks_generates_what_one_rank_generates(models):
    from pipeline import LLM
    from pipeline.sampling_params import SamplingParams

    prompts = [[(13 * i + 7 * j) % 1900 + 40 for j in range(20 + 9 * i)] for i in range(4)]
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    got = {}
    for tp in (1, 2):
        with LLM(str(models["mistral"]), device="cpu", dtype="float32", tensor_parallel_size=tp,
                 worker_threads=1, num_blocks=64, max_model_len=256) as llm:
            got[tp] = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params)]
            instance = llm.config.instance_id
        assert shm_entries(instance) == []
    assert got[1] == got[2]


def test_a_group_that_does_not_form_in_time_fails_naming_rank_and_host(models):
    from e2e_helpers import Daemon, free_port

    # Node 0 of two, and no node 1: rank 0 waits for it, then gives up.
    d = Daemon(models["llama"], "--tensor-parallel-size", "2", "--nnodes", "2", "--master-port",
               str(free_port()), extra_env={"PIPELINE_TP_TIMEOUT_S": "3"})
    try:
        assert d.proc.wait(120) != 0
        out = d.output()
        assert "tensor parallel: rank 0 on" in out and "could not join the group of 2" in out, out
    finally:
        d.stop()
    assert shm_entries(d.instance_id) == []
