"""In-process engine ``pipeline.LLM``: FakeWorker for the engine logic, the default model for
the real worker (greedy outputs identical with and without heavy preemption)."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

from pipeline.config import DEFAULT_MODEL
from pipeline.engine.fake_worker import FakeWorker
from pipeline.llm import LLM
from pipeline.sampling_params import SamplingParams

VOCAB = 2048  # the default model's tokenizer


def fake_llm(**kw) -> LLM:
    worker = FakeWorker(num_blocks=kw.pop("num_blocks", 256), block_size=4, max_model_len=256,
                        vocab_size=VOCAB, eos_token_ids=[1], check_kv=True)
    return LLM(DEFAULT_MODEL, worker=worker, **kw)


def test_generate_returns_outputs_in_order_matching_the_worker():
    llm = fake_llm(max_num_seqs=3, max_num_batched_tokens=16)
    prompts = [[5, 6, 7], "Once upon a time", [9] * 20, "Hello"]
    sp = SamplingParams(max_tokens=10, ignore_eos=True)
    outs = llm.generate(prompts, sp)
    assert [o.request_id for o in outs] == [f"llm-{i}" for i in range(4)]
    for p, o in zip(prompts, outs):
        ids = llm.get_tokenizer().encode(p) if isinstance(p, str) else p
        assert o.prompt_token_ids == ids and o.prompt == (p if isinstance(p, str) else None)
        want, toks = [], list(ids)
        for _ in range(10):
            toks.append(llm.worker.next_token(toks))
            want.append(toks[-1])
        (c,) = o.outputs
        assert c.index == 0 and c.token_ids == want and c.finish_reason == "length" and c.finished()
        assert c.text == llm.tokenizer.decode(want) and o.finished
        assert o.metrics.ttft is not None and o.metrics.ttft >= 0
    assert llm.stats()["kv_blocks_used"] == 0


def test_stop_string_frees_the_request_in_the_engine():
    llm = fake_llm()
    free = llm.generate([[40, 41, 42]], SamplingParams(max_tokens=30, ignore_eos=True))[0].outputs[0]
    stop = free.text[len(free.text) // 2:][:3]
    assert stop.strip()
    out = llm.generate([[40, 41, 42]], SamplingParams(max_tokens=30, ignore_eos=True,
                                                      stop=[stop]))[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert stop not in out.text and free.text.startswith(out.text)
    assert llm.stats()["kv_blocks_used"] == 0 and not llm.scheduler.has_unfinished_requests()


def test_prefix_and_output_caching_across_calls():
    llm = fake_llm()
    sp = SamplingParams(max_tokens=9, ignore_eos=True)
    first = llm.generate([list(range(100, 110))], sp)[0]
    assert first.num_cached_tokens == 0
    turn2 = first.prompt_token_ids + first.outputs[0].token_ids + [7, 8, 9]
    second = llm.generate([turn2], sp)[0]
    assert second.num_cached_tokens == 16  # 10 prompt + 8 generated tokens had KV: 4 blocks
    other = llm.generate([list(range(100, 110))], sp, cache_salt="tenant")[0]
    assert other.num_cached_tokens == 0 and other.outputs[0].token_ids == first.outputs[0].token_ids


def test_bad_input_names_the_limit_and_leaves_nothing_behind():
    llm = fake_llm(num_blocks=8)
    with pytest.raises(ValueError, match="max_model_len"):
        llm.generate([[3] * 256], SamplingParams(max_tokens=10))
    with pytest.raises(ValueError, match="num_blocks=8"):
        llm.generate([[3] * 20, [3] * 40], SamplingParams(max_tokens=10))
    with pytest.raises(ValueError, match="vocab_size=2048"):
        llm.generate([[3, 5000]])
    with pytest.raises(ValueError, match="max_tokens"):
        llm.generate([[3]], SamplingParams(max_tokens=0))
    with pytest.raises(TypeError, match="max_num_seq"):
        fake_llm(max_num_seq=4)
    assert not llm.scheduler.has_unfinished_requests() and llm.stats()["kv_blocks_used"] == 0
    assert llm.generate([[3, 4]], SamplingParams(max_tokens=2))[0].outputs[0].finish_reason in ("length", "stop")


@pytest.mark.skipif(not (Path(DEFAULT_MODEL) / "model.safetensors").is_file(),
                    reason="default model not built")
def test_real_model_preemption_gives_identical_greedy_outputs():
    prompts = [f"Request {i}: tell me a story about number {i * 7}" for i in range(6)]
    sp = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    results = {}
    for num_blocks in (48, 10):
        with LLM(device="cpu", dtype="float32", block_size=8, num_blocks=num_blocks,
                 max_model_len=64, max_num_seqs=6, max_num_batched_tokens=256) as llm:
            outs = llm.generate(prompts, sp)
            results[num_blocks] = ([o.outputs[0].token_ids for o in outs], llm.stats()["num_preemptions"])
            iid = llm.config.instance_id
            if num_blocks == 48:
                # Prefix and output caching with the real worker: a second turn that repeats
                # prompt + answer starts from cached KV past the prompt, and the KV it reuses
                # gives the same greedy continuation as computing everything.
                first = outs[0]
                turn2 = first.prompt_token_ids + first.outputs[0].token_ids
                again = llm.generate([turn2], SamplingParams(max_tokens=4, temperature=0.0,
                                                             ignore_eos=True))[0]
                assert again.num_cached_tokens > len(first.prompt_token_ids)
        assert not [n for n in os.listdir("/dev/shm") if iid in n]
    assert results[48][1] == 0 and results[10][1] > 0
    assert results[10][0] == results[48][0]
    assert all(len(t) == 16 for t in results[10][0])
    with LLM(device="cpu", dtype="float32", block_size=8, num_blocks=48, max_model_len=64,
             enable_prefix_caching=False) as llm:
        fresh = llm.generate([turn2], SamplingParams(max_tokens=4, temperature=0.0,
                                                     ignore_eos=True))[0]
        assert fresh.num_cached_tokens == 0
    assert again.outputs[0].token_ids == fresh.outputs[0].token_ids


def test_chat_renders_the_template_then_generates():
    llm = fake_llm()
    msgs = [{"role": "user", "content": "Hi there"}]
    if llm.tokenizer.chat_template is None:
        with pytest.raises(ValueError, match="chat template"):
            llm.chat(msgs)
        return
    out = llm.chat(msgs, SamplingParams(max_tokens=3, ignore_eos=True))[0]
    assert out.prompt_token_ids == llm.tokenizer.apply_chat_template(msgs)
    assert len(out.outputs[0].token_ids) == 3


def test_without_a_tokenizer_token_ids_and_timings_still_work():
    llm = LLM("/nonexistent", worker=FakeWorker(64, 4, 128, VOCAB, [1]), skip_tokenizer_init=True)
    out = llm.generate([[4, 5, 6]], SamplingParams(max_tokens=5, ignore_eos=True))[0]
    (c,) = out.outputs
    assert c.text == "" and len(c.token_ids) == 5 and c.finish_reason == "length"
    assert out.metrics.ttft is not None and len(out.metrics.itl) == 4
    assert out.metrics.e2e >= out.metrics.ttft >= 0
    with pytest.raises(ValueError, match="need a tokenizer"):
        llm.generate(["text"])
    with pytest.raises(ValueError, match="stop strings and bad_words need a tokenizer"):
        llm.generate([[4]], SamplingParams(stop=["x"]))
    with pytest.raises(ValueError, match="tokenizer.json"):
        LLM("/nonexistent", worker=FakeWorker(64, 4, 128, VOCAB, [1]))
