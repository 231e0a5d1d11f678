"""Parallel sampling (n > 1) inside the engine: one request id, n children that share the
prompt's prefill through the prefix cache, one answer with ``outputs``.

Scheduler + FakeWorker (which simulates the paged KV cache, so a sibling reading a wrong
shared block fails), then the real ModelRunner on a tiny checkpoint with the token
processor, then the real stage processes (pipe mode).
"""
from __future__ import annotations

import json
import time

import pytest
import torch
from e2e_helpers import make_tiny_model, run_pipe, shm_entries
from model_driver import instance_id, tiny_hf_model
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from pipeline.config import EngineConfig
from pipeline.engine.fake_worker import FakeWorker
from pipeline.engine.scheduler import Scheduler
from pipeline.messages import (
    EngineOutput,
    EngineOutputs,
    EngineRequest,
    RequestDelta,
    RequestResult,
    TokenLogprobs,
    ids_to_bytes,
)
from pipeline.messages.engine_outputs import child_id
from pipeline.output.detokenizer import DetokenizerTable
from pipeline.output.processor import OutputProcessor
from pipeline.sampling_params import SamplingParams

BS = 4
EOS = 0


def fake_engine(num_blocks=64, caching=True, budget=64):
    cfg = EngineConfig.of(max_num_seqs=16, max_num_batched_tokens=budget, enable_prefix_caching=caching)
    sched = Scheduler(cfg, num_blocks, BS, 128, hash_key=b"test")
    return sched, FakeWorker(num_blocks, BS, 128, 48, [EOS], check_kv=True)


def add(sched, rid, prompt, **sp):
    sched.add_request(EngineRequest(rid, ids_to_bytes(prompt), SamplingParams(**sp), time.time(), [EOS]))


def run(sched, worker, max_steps=500) -> list[EngineOutput]:
    outs: list[EngineOutput] = []
    for _ in range(max_steps):
        if not sched.has_unfinished_requests():
            return outs
        so = sched.schedule()
        outs += sched.update_from_output(so, worker.execute(so))
        assert sched.check_invariants() == []
    raise AssertionError("engine did not converge")


def by_index(outs: list[EngineOutput], rid: str) -> dict[int, list[EngineOutput]]:
    got: dict[int, list[EngineOutput]] = {}
    for o in outs:
        if o.req_id == rid:
            got.setdefault(o.index, []).append(o)
    return got


def test_children_share_the_prompt_prefill_and_each_ends_once():
    sched, worker = fake_engine()
    prompt = list(range(1, 4 * BS + 2))  # 17 tokens: 4 full blocks, then 1
    add(sched, "p", prompt, n=4, max_tokens=6, ignore_eos=True)
    outs = run(sched, worker)
    got = by_index(outs, "p")
    assert sorted(got) == [0, 1, 2, 3]
    for os_ in got.values():
        # Each child: one token per output, exactly one final, after every token.
        assert [o.finish_reason for o in os_] == [None] * 5 + ["length"]
        assert sum(len(o.new_token_ids) for o in os_) == 6
    # The 4 full prompt blocks were computed once; each sibling recomputed only the last
    # prompt token (its first token's logits), then 5 decode tokens each.
    s = sched.stats()
    assert s.prompt_tokens == len(prompt)
    assert s.computed_tokens == len(prompt) + 3 * 1 + 4 * 5
    assert s.prefix_cache_hit_tokens == 3 * 4 * BS
    assert sched.families.parents == {} and s.kv_blocks_used == 0


def test_without_prefix_caching_siblings_start_at_once():
    sched, worker = fake_engine(caching=False)
    add(sched, "p", list(range(1, 10)), n=3, max_tokens=2, ignore_eos=True)
    so = sched.schedule()
    assert sorted(so.num_scheduled_tokens) == ["p#0", "p#1", "p#2"]
    sched.update_from_output(so, worker.execute(so))
    run(sched, worker)
    assert sched.stats().computed_tokens == 3 * (9 + 1)


def test_abort_by_request_id_ends_every_child_held_or_running():
    sched, worker = fake_engine(budget=8)
    add(sched, "p", list(range(1, 30)), n=3, max_tokens=20, ignore_eos=True)
    so = sched.schedule()  # child 0 starts its prefill; the siblings are held
    sched.update_from_output(so, worker.execute(so))
    outs = sched.abort_requests(["p"])
    assert sorted(o.index for o in outs) == [0, 1, 2]
    assert all(o.req_id == "p" and o.finish_reason == "abort" and o.error == "aborted by the client"
               for o in outs)
    assert not sched.has_unfinished_requests() and sched.families.parents == {}
    assert len(sched.waiting) == 0 and sched.check_invariants() == []
    assert sched.stats().kv_blocks_used == 0
    assert sched.abort_requests(["p"]) == []  # already over: nothing more


def test_stop_string_abort_ends_one_child_only():
    sched, worker = fake_engine()
    add(sched, "p", list(range(1, 8)), n=3, max_tokens=10, ignore_eos=True)
    outs: list[EngineOutput] = []
    while not any(o.index == 2 for o in outs):  # until every child has tokens
        so = sched.schedule()
        outs += sched.update_from_output(so, worker.execute(so))
    [o] = sched.abort_requests([child_id("p", 1, 3)], reason="stop")
    assert (o.req_id, o.index, o.finish_reason, o.error) == ("p", 1, "stop", None)
    outs = run(sched, worker)
    got = by_index(outs, "p")
    assert sorted(got) == [0, 2] and all(v[-1].finish_reason == "length" for v in got.values())


def test_seeded_children_get_their_own_seed():
    sched, worker = fake_engine()
    add(sched, "p", [1, 2, 3], n=3, seed=7, temperature=1.0)
    add(sched, "q", [1, 2, 3], n=2, temperature=1.0)
    seeds = {rid: r.sampling_params.seed for rid, r in sched.requests.items()}
    assert seeds == {"p#0": 7, "p#1": 8, "p#2": 9, "q#0": None, "q#1": None}
    assert all(r.sampling_params.n == 1 for r in sched.requests.values())
    with pytest.raises(ValueError, match="already in the engine"):
        add(sched, "p#1", [1])


# -- the token processor --------------------------------------------------------------------
def _table() -> tuple[Tokenizer, DetokenizerTable]:
    t = Tokenizer(models.BPE())
    t.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    t.decoder = decoders.ByteLevel()
    t.train_from_iterator(["the quick brown fox jumps over the lazy dog END"] * 20, trainers.BpeTrainer(
        vocab_size=120, special_tokens=["<eos>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return t, DetokenizerTable(t)


TOK, TABLE = _table()


def test_processor_assembles_one_answer_with_every_completion():
    p = OutputProcessor(TABLE, lambda: 10.0)
    p.add_request("r", SamplingParams(n=3, stop="dog", max_tokens=50), 9.0, stream=True)
    got: list = []
    enc = TOK.encode
    texts = ["the fox", "the lazy dog jumps", "over"]
    stopped = p.process(EngineOutputs([EngineOutput("r", enc(t).ids, index=k) for k, t in enumerate(texts)]),
                        got.append)
    assert stopped == ["r#1"]  # the stop string ended child 1 only; the engine must be told
    assert not any(isinstance(g, RequestResult) for g in got)
    p.process(EngineOutputs([EngineOutput("r", enc(" END").ids, "length", index=0),
                             EngineOutput("r", enc(" more").ids, index=1),  # late: dropped
                             EngineOutput("r", [], "abort", index=2, error="aborted by the client")]),
              got.append)
    [res] = [g for g in got if isinstance(g, RequestResult)]
    assert [c.index for c in res.outputs] == [0, 1, 2]
    assert [c.text for c in res.outputs] == ["the fox END", "the lazy ", "over"]
    assert [c.finish_reason for c in res.outputs] == ["length", "stop", "abort"]
    assert res.outputs[1].stop_reason == "dog"
    # Top level mirrors outputs[0], but the request as a whole was aborted.
    assert (res.text, res.token_ids) == (res.outputs[0].text, res.outputs[0].token_ids)
    assert res.finish_reason == "abort" and res.error.code == "aborted"
    assert res.usage.completion_tokens == sum(len(c.token_ids) for c in res.outputs)
    for k, c in enumerate(res.outputs):
        deltas = [g for g in got if isinstance(g, RequestDelta) and g.index == k]
        assert "".join(d.text for d in deltas) == c.text
        assert [t for d in deltas for t in d.token_ids] == c.token_ids
    assert p.num_unfinished == 0 and p.num_dropped == 1


def test_processor_n1_answer_has_no_outputs_list():
    p = OutputProcessor(TABLE, lambda: 10.0)
    p.add_request("r", SamplingParams(logprobs=0), 9.0)
    got: list = []
    p.process(EngineOutputs([EngineOutput("r", [5, 6], "length",
                                          logprobs=[TokenLogprobs(5, -0.5, [], []),
                                                    TokenLogprobs(6, -0.25, [], [])])]), got.append)
    [res] = got
    assert res.outputs == [] and res.cumulative_logprob == -0.75 and res.prompt_logprobs is None


# -- the real worker ------------------------------------------------------------------------
@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    path = str(tmp_path_factory.mktemp("llama"))
    tiny_hf_model("llama", path, seed=5)
    yield path
    torch.set_num_threads(old)


def real_run(model_dir, sp: SamplingParams, prompt: list[int]):
    from pipeline.worker.model_runner import ModelRunner
    cfg = EngineConfig.of(model=model_dir, device="cpu", dtype="float32", block_size=16, num_blocks=96,
                       max_num_seqs=8, max_num_batched_tokens=256, instance_id=instance_id())
    runner = ModelRunner(cfg)
    runner.load()
    try:
        sched = Scheduler(cfg, runner.num_blocks, runner.block_size, runner.max_model_len)
        sched.add_request(EngineRequest("r", ids_to_bytes(prompt), sp, time.time(), [2]))
        outs = []
        while sched.has_unfinished_requests():
            so = sched.schedule()
            outs += sched.update_from_output(so, runner.execute(so))
        return by_index(outs, "r"), sched.stats()
    finally:
        runner.close()
        assert shm_entries(cfg.instance_id) == []


def test_real_worker_n4_seeded_reproducible_distinct_prefill_once(model_dir):
    prompt = [(5 * i + 7) % 300 + 3 for i in range(33)]  # 2 full blocks of 16, then 1
    sp = SamplingParams(n=4, seed=1234, temperature=1.0, max_tokens=12, ignore_eos=True)
    a, stats = real_run(model_dir, sp, prompt)
    b, _ = real_run(model_dir, sp, prompt)
    toks = {k: [t for o in v for t in o.new_token_ids] for k, v in a.items()}
    assert toks == {k: [t for o in v for t in o.new_token_ids] for k, v in b.items()}
    assert sorted(toks) == [0, 1, 2, 3] and all(len(t) == 12 for t in toks.values())
    assert len({tuple(t) for t in toks.values()}) >= 3  # mostly distinct
    # Child 0 alone with the same seed samples what child 0 of n=4 does.
    alone, _ = real_run(model_dir, SamplingParams(seed=1234, temperature=1.0, max_tokens=12,
                                                  ignore_eos=True), prompt)
    assert [t for o in alone[0] for t in o.new_token_ids] == toks[0]
    # The prompt's 2 full blocks were computed once: 33 + 3 siblings x 1 + 4 x 11 decodes.
    assert stats.computed_tokens == 33 + 3 + 4 * 11


def test_pipe_mode_n3_streams_each_completion_and_answers_once(tmp_path):
    model = make_tiny_model(tmp_path / "m")
    lines = [json.dumps({"id": "a", "prompt": "hello there", "n": 3, "seed": 3, "temperature": 1.0,
                         "max_tokens": 6, "ignore_eos": True, "stream": True}),
             json.dumps({"id": "b", "prompt": "hello", "n": 2, "stop": "e", "max_tokens": 5})]
    rc, answers, err = run_pipe(model, lines)
    assert rc == 0, err
    finals = {a["id"]: a for a in answers if "finish_reason" in a}
    assert sorted(finals) == ["a", "b"]
    a = finals["a"]
    assert [c["index"] for c in a["outputs"]] == [0, 1, 2]
    assert a["usage"]["completion_tokens"] == 18 and all(len(c["token_ids"]) == 6 for c in a["outputs"])
    assert (a["text"], a["token_ids"]) == (a["outputs"][0]["text"], a["outputs"][0]["token_ids"])
    for c in a["outputs"]:
        deltas = [d for d in answers if d["id"] == "a" and "finish_reason" not in d
                  and d.get("index", 0) == c["index"]]
        assert "".join(d["text"] for d in deltas) == c["text"]
        assert [t for d in deltas for t in d["token_ids"]] == c["token_ids"]
    # A string stop applies to each completion's text, never to single characters of it.
    assert all("e" not in c["text"] for c in finals["b"]["outputs"])


def test_daemon_client_abort_ends_every_completion_with_the_abort_shape(tmp_path):
    from e2e_helpers import Daemon

    from pipeline.client import Client

    def stream_and_abort(c: Client, rid: str, **fields) -> RequestResult:
        n, final = fields.get("n", 1), None
        for item in c.stream("hello there", id=rid, max_tokens=LONG, ignore_eos=True,
                             temperature=1.0, seed=5, **fields):
            if isinstance(item, RequestResult):
                final = item
            elif item.token_ids and (n == 1 or item.index == n - 1):
                c.abort(rid)  # once every completion is under way (again later: a no-op)
        assert final is not None
        return final

    # Far more tokens than an abort takes to land, even beside a CPU hog (200 in a 256-token
    # context could all be out before the client had read the first delta of the last
    # completion).
    LONG = 7000
    daemon = Daemon(make_tiny_model(tmp_path / "m", max_positions=8192),
                    "--max-model-len", "8192", "--num-blocks", "1100")
    try:
        daemon.wait_ready()
        with Client(daemon.address, timeout=120) as c:
            for fields in ({}, {"n": 2}):
                final = stream_and_abort(c, f"r{len(fields)}", **fields)
                assert final.finish_reason == "abort", final
                assert final.error is not None and final.error.code == "aborted", final
                assert "client" in final.error.message and len(final.token_ids) < LONG
            assert [o.index for o in final.outputs] == [0, 1]
            assert all(o.finish_reason == "abort" and len(o.token_ids) < LONG for o in final.outputs)
    finally:
        assert daemon.stop() == 0
    assert shm_entries(daemon.instance_id) == []
