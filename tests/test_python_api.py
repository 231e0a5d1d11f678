"""The in-process Python API a vLLM user expects (pipeline.LLM): RequestOutput / CompletionOutput
in vLLM's shape, every prompt form (strings, token ids, vLLM prompt dicts, pipe-mode / ZMQ
request dicts), `chat` with vLLM's options, the progress bar, and the same request dict giving
the same answer in-process and through the real stage processes (pipe mode)."""
from __future__ import annotations

import dataclasses
import json
import os
import select
import sys
from pathlib import Path

import pytest
from e2e_helpers import make_tiny_model, run_pipe

from pipeline import CompletionOutput, Logprob, RequestOutput
from pipeline.config import DEFAULT_MODEL
from pipeline.engine.fake_worker import FakeWorker
from pipeline.llm import LLM
from pipeline.llm_raw import RawOutputs
from pipeline.messages import EngineOutput, RequestResult, Timings, TokenLogprobs, Usage
from pipeline.messages.answers import Completion
from pipeline.outputs import request_output
from pipeline.sampling_params import SamplingParams

VOCAB = 2048  # the default model's tokenizer
GREEDY4 = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)


def fake_llm(**kw) -> LLM:
    worker = FakeWorker(num_blocks=256, block_size=4, max_model_len=256, vocab_size=VOCAB,
                        eos_token_ids=[1])
    return LLM(DEFAULT_MODEL, worker=worker, **kw)


def tokens(outs: list[RequestOutput]) -> list[list[int]]:
    return [c.token_ids for o in outs for c in o.outputs]


def test_output_types_have_vllms_fields():
    # vLLM's, in its order, then ours (LLM.chat's parsed parts: tools, reasoning)
    assert [f.name for f in dataclasses.fields(CompletionOutput)] == [
        "index", "text", "token_ids", "cumulative_logprob", "logprobs", "finish_reason", "stop_reason",
        "content", "tool_calls", "reasoning_content"]
    assert {"request_id", "prompt", "prompt_token_ids", "prompt_logprobs", "outputs", "finished",
            "metrics", "num_cached_tokens"} <= {f.name for f in dataclasses.fields(RequestOutput)}
    assert [f.name for f in dataclasses.fields(Logprob)] == ["logprob", "rank", "decoded_token"]


def test_every_prompt_form_gives_the_same_answer():
    llm = fake_llm()
    text, ids = "Hello there", [5, 6, 7]
    want = tokens(llm.generate([text, ids], GREEDY4))
    assert tokens(llm.generate(text, GREEDY4)) == want[:1]  # one prompt, not in a list
    assert tokens(llm.generate(ids, GREEDY4)) == want[1:]
    outs = llm.generate([{"prompt": text}, {"prompt_token_ids": ids}], GREEDY4)
    assert tokens(outs) == want
    assert (outs[0].prompt, outs[1].prompt, outs[1].prompt_token_ids) == (text, None, ids)
    # A pipe-mode / ZMQ request dict: its sampling fields override the call's.
    piped = {"id": "a", "prompt": text, "max_tokens": 4, "temperature": 0, "ignore_eos": True,
             "priority": 3, "cache_salt": "s", "stream": True}
    (out,) = llm.generate(piped, SamplingParams(max_tokens=9))
    assert out.request_id == "a" and tokens([out]) == want[:1]
    msgs = [{"role": "user", "content": "Hi"}]
    (chat,) = llm.generate({"messages": msgs, "max_tokens": 4, "temperature": 0, "ignore_eos": True})
    (same,) = llm.chat(msgs, GREEDY4)
    assert chat.prompt_token_ids == same.prompt_token_ids and tokens([chat]) == tokens([same])
    assert chat.prompt == same.prompt == llm.get_tokenizer().render_chat(msgs)


@pytest.mark.parametrize("prompts, error", [
    (["ok", {"prompt": "x", "multi_modal_data": {"image": 1}}],
     r"prompts\[1\]: field `multi_modal_data`: multi-modal input is not supported"),
    ([{"prompt": "x", "prompt_token_ids": [3]}], r"prompts\[0\]: exactly one of `prompt`, `prompt_token_ids`"),
    ([{"promt": "x"}], r"prompts\[0\]: .*unknown field `promt`"),
    ([{"prompt": "x", "max_tokens": "8"}], r"prompts\[0\]: field `max_tokens`"),
    ([[3, 4], [3, 2.5]], r"prompts\[1\]: field `prompt_token_ids\[1\]`: token ids must be integers, got float"),
    (["ok", 3.5], r"prompts\[1\]: a prompt must be a string, a list of token ids or a dict, got float"),
    ([[3], [4]], r"sampling_params: got 1 for 2 prompts"),
    ([[3, 5000]], r"prompts\[0\]: field `prompt_token_ids\[1\]`: token ids must be in \[0, vocab_size=2048\)"),
])
def test_bad_prompts_name_the_prompt_and_the_field_and_queue_nothing(prompts, error):
    llm = fake_llm()
    with pytest.raises(ValueError, match=error):
        llm.generate(prompts, [GREEDY4] if "sampling_params" in error else GREEDY4)
    assert not llm.scheduler.has_unfinished_requests()
    assert len(tokens(llm.generate(["ok"], GREEDY4))[0]) == 4  # and it keeps serving


def test_chat_takes_vllms_options():
    llm = fake_llm()
    conv = [{"role": "user", "content": "Name a colour"}, {"role": "assistant", "content": "The colour is"}]
    (out,) = llm.chat(conv, GREEDY4, add_generation_prompt=False, continue_final_message=True)
    assert out.prompt.endswith("assistant: The colour is")
    assert out.prompt_token_ids == llm.get_tokenizer().encode(out.prompt, add_special_tokens=False)
    custom = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}{{ suffix }}"
    two = llm.chat([conv[:1], conv], [GREEDY4, SamplingParams(max_tokens=2, ignore_eos=True)],
                   chat_template=custom, chat_template_kwargs={"suffix": "!"})
    assert [o.prompt for o in two] == ["<user>Name a colour!", "<user>Name a colour<assistant>The colour is!"]
    assert [len(c) for c in tokens(two)] == [4, 2]
    with pytest.raises(ValueError, match=r"conversations\[1\]: field `messages\[0\]\.role`: .*got 'robot'"):
        llm.chat([conv, [{"role": "robot", "content": "beep"}]])
    with pytest.raises(ValueError, match="add_generation_prompt and continue_final_message"):
        llm.chat(conv, continue_final_message=True)
    assert not llm.scheduler.has_unfinished_requests()


def test_prompt_truncation_and_bad_words_as_the_tokenizer_stage_does():
    llm = fake_llm()
    (out,) = llm.generate([[5, 6, 7, 8, 9]], SamplingParams(max_tokens=2, truncate_prompt_tokens=3))
    assert out.prompt_token_ids == [7, 8, 9]
    bare = LLM("/nonexistent", worker=FakeWorker(64, 4, 128, VOCAB, [1]), skip_tokenizer_init=True)
    with pytest.raises(ValueError, match="bad_words need a tokenizer"):
        bare.generate([[5]], SamplingParams(bad_words=["x"]))


def test_get_tokenizer():
    llm = fake_llm()
    assert llm.get_tokenizer() is llm.tokenizer and llm.get_tokenizer().encode("Hi")
    bare = LLM("/nonexistent", worker=FakeWorker(64, 4, 128, VOCAB, [1]), skip_tokenizer_init=True)
    with pytest.raises(ValueError, match="skip_tokenizer_init"):
        bare.get_tokenizer()


def test_progress_bar_on_stderr_when_asked_or_a_terminal(capsys, monkeypatch):
    llm = fake_llm()
    prompts = [[5, 6, 7 + i] for i in range(3)]
    llm.generate(prompts, GREEDY4, use_tqdm=True)
    err = capsys.readouterr().err
    assert "Processed prompts: 100%|" in err and "3/3 [" in err and "tok/s" in err
    llm.generate(prompts, GREEDY4)  # stderr is not a terminal here: no bar by default
    assert capsys.readouterr().err == ""
    master, slave = os.openpty()
    with open(slave, "w") as tty:
        monkeypatch.setattr(sys, "stderr", tty)
        llm.generate(prompts, GREEDY4, use_tqdm=False)
        llm.generate(prompts[:2], GREEDY4)  # a terminal: the bar by default
        tty.flush()
    monkeypatch.undo()
    shown = b""  # everything the terminal got: read until the closed slave side says EIO
    while select.select([master], [], [], 10)[0]:
        try:
            chunk = os.read(master, 1 << 16)
        except OSError:
            break
        if not chunk:
            break
        shown += chunk
    os.close(master)
    assert "2/2 [" in shown.decode() and "3/3" not in shown.decode()
    with pytest.raises(TypeError, match="use_tqdm"):
        llm.generate(prompts, GREEDY4, use_tqdm=1)  # a callable is a tqdm class (vLLM)


def test_n_completions_without_a_tokenizer_from_the_engine():
    llm = LLM("/nonexistent", worker=FakeWorker(64, 4, 128, VOCAB, [1]), skip_tokenizer_init=True)
    (out,) = llm.generate([[4, 5, 6]], SamplingParams(n=3, max_tokens=5, ignore_eos=True))
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert all(len(c.token_ids) == 5 and c.finish_reason == "length" for c in out.outputs)
    assert llm.stats()["kv_blocks_used"] == 0


def test_raw_outputs_collect_children_logprobs_and_prompt_logprobs():
    # Without a tokenizer the LLM assembles answers itself: completions arrive interleaved,
    # each with its own finish; the answer comes once all n are done.
    raw, got = RawOutputs(), []
    sp = SamplingParams(n=2, max_tokens=3, logprobs=0, prompt_logprobs=0)
    raw.add("r", sp, 100.0, 3)
    lp = lambda t, x: TokenLogprobs(t, x, [], [])  # noqa: E731
    raw.process([EngineOutput("r", [7], None, None, [lp(7, -1.0)], 3, 0, 100.5, None, 0, [lp(4, -2.0)]),
                 EngineOutput("r", [8], None, None, [lp(8, -0.5)], 3, 0, 100.5, None, 1)], 101.0, got.append)
    raw.process([EngineOutput("r", [9], "length", None, [lp(9, -0.25)], index=1)], 102.0, got.append)
    assert got == []
    raw.process([EngineOutput("r", [10], "stop", 10, [lp(10, -3.0)], index=0)], 103.0, got.append)
    (r,) = got
    assert [(c.index, c.token_ids, c.finish_reason, c.cumulative_logprob) for c in r.outputs] == [
        (0, [7, 10], "stop", -4.0), (1, [8, 9], "length", -0.75)]
    assert (r.token_ids, r.finish_reason, r.stop_reason, r.cumulative_logprob) == ([7, 10], "stop", 10, -4.0)
    assert r.prompt_logprobs == [None, lp(4, -2.0)] and r.usage.completion_tokens == 4
    t = r.timings
    assert (t.queue_time, t.ttft, t.itl, t.e2e) == (0.5, 1.0, [1.0, 1.0], 3.0)  # one gap per step


def test_logprobs_in_vllms_shape():
    llm = fake_llm()
    tok = llm.get_tokenizer()
    inside = TokenLogprobs(9, -0.5, [12, 9], [-0.1, -0.5])  # sampled token ranked 2nd
    outside = TokenLogprobs(9, -4.0, [12], [-0.1])  # sampled token not in the top-1
    comps = [Completion(0, "a", [9, 9], "length", None, [inside, outside], -4.5),
             Completion(1, "b", [9], "stop", "x", [inside], -0.5)]
    r = RequestResult(id="llm-0", text="a", token_ids=[9, 9], finish_reason="length", usage=Usage(2, 3, 0),
                      timings=Timings(), logprobs=[inside, outside], outputs=comps, cumulative_logprob=-4.5,
                      prompt_logprobs=[None, outside])
    pr = llm.prompts.make("p", [5, 6], "prompt", SamplingParams(), 0, None, None)
    out = request_output(r, pr.request_id, pr.text, pr.token_ids, llm._decode1)
    first, second = out.outputs
    assert list(first.logprobs[0]) == [9, 12] and list(first.logprobs[1]) == [9, 12]  # sampled first
    assert first.logprobs[0][9] == Logprob(-0.5, 2, tok.decode([9], skip_special_tokens=False))
    assert first.logprobs[1][9].rank is None and first.logprobs[1][12] == Logprob(-0.1, 1, tok.decode([12]))
    assert (first.cumulative_logprob, second.index, second.stop_reason) == (-4.5, 1, "x")
    assert out.prompt_logprobs[0] is None and list(out.prompt_logprobs[1]) == [9, 12]


def test_real_model_logprobs_and_n(tmp_path):
    with LLM(device="cpu", dtype="float32", block_size=8, num_blocks=64, max_model_len=64) as llm:
        sp = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, logprobs=2)
        (out,) = llm.generate("The for statement", sp)
        (c,) = out.outputs
        assert len(c.logprobs) == 4
        for tid, pos in zip(c.token_ids, c.logprobs):
            assert list(pos)[0] == tid and pos[tid].rank == 1  # greedy: the sampled one is the top one
            assert len(pos) == 2 and sorted(p.rank for p in pos.values()) == [1, 2]
        assert c.cumulative_logprob == pytest.approx(sum(pos[t].logprob for t, pos in zip(c.token_ids, c.logprobs)))
        (many,) = llm.generate("The for statement", SamplingParams(n=3, max_tokens=4, temperature=0.0,
                                                                   ignore_eos=True))
        assert [o.index for o in many.outputs] == [0, 1, 2]
        assert all(o.token_ids == c.token_ids for o in many.outputs)  # greedy: all alike
        (scored,) = llm.generate("The for statement", SamplingParams(max_tokens=1, prompt_logprobs=1))
        plp = scored.prompt_logprobs
        assert len(plp) == len(scored.prompt_token_ids) and plp[0] is None
        for tid, pos in zip(scored.prompt_token_ids[1:], plp[1:]):
            assert list(pos)[0] == tid and len(pos) <= 2 and any(p.rank == 1 for p in pos.values())
        # bad_words become token ids here, as in the tokenizer stage: a greedy token that is a
        # word of its own, once banned, is not generated where it was.
        tok = llm.get_tokenizer()
        k = next(i for i, t in enumerate(c.token_ids)
                 if tok.encode(tok.decode([t]).strip(), add_special_tokens=False) == [t])
        (banned,) = llm.generate("The for statement", SamplingParams(
            max_tokens=4, temperature=0.0, ignore_eos=True, bad_words=[tok.decode([c.token_ids[k]])]))
        assert banned.outputs[0].token_ids[:k] == c.token_ids[:k]
        assert banned.outputs[0].token_ids[k] != c.token_ids[k]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.getbasetemp() / "e2e-tiny")


def test_one_request_dict_works_in_process_and_in_pipe_mode(tiny):
    # The same dict through the real stage processes and in-process gives the same answer;
    # an unknown chat role is refused on both, naming the role, and pipe mode keeps serving.
    req = {"id": "q", "messages": [{"role": "system", "content": "Be brief."},
                                   {"role": "user", "content": "Say something"}],
           "max_tokens": 6, "temperature": 0, "ignore_eos": True}
    bad = {"id": "bad", "messages": [{"role": "robot", "content": "beep"}]}
    rc, answers, err = run_pipe(tiny, [json.dumps(bad), json.dumps(req)], "--ordered")
    assert rc == 1, err  # one request failed
    refused, served = answers
    assert refused["id"] == "bad" and refused["error"]["code"] == "invalid_request"
    assert "messages[0].role" in refused["error"]["message"] and "'robot'" in refused["error"]["message"]
    assert served["id"] == "q" and served["finish_reason"] == "length"
    with LLM(str(tiny), device="cpu", dtype="float32", max_num_seqs=32, max_model_len=256,
             num_blocks=256) as llm:
        (out,) = llm.generate(req)
        assert out.request_id == "q" and out.outputs[0].token_ids == served["token_ids"]
        assert out.outputs[0].text == served["text"]
        with pytest.raises(ValueError, match=r"field `messages\[0\]\.role`: .*got 'robot'"):
            llm.generate(bad)


class _FailingWorker(FakeWorker):
    """Fails its `fail_at`-th step, like a worker hitting an error mid-batch."""
    fail_at = 0

    def execute(self, sched):
        if self.num_steps + 1 == self.fail_at:
            self.num_steps += 1
            raise RuntimeError("worker failed")
        return super().execute(sched)


@pytest.mark.parametrize("skip_tokenizer_init", [False, True])
def test_a_failing_step_raises_and_leaves_nothing_queued(skip_tokenizer_init):
    worker = _FailingWorker(64, 4, 128, VOCAB, [1])
    llm = LLM(DEFAULT_MODEL, worker=worker, skip_tokenizer_init=skip_tokenizer_init)
    worker.fail_at = 3
    with pytest.raises(RuntimeError, match="worker failed"):
        llm.generate([[5, 6, 7], [8, 9]], SamplingParams(max_tokens=8, ignore_eos=True))
    assert not llm.scheduler.has_unfinished_requests() and llm.stats()["kv_blocks_used"] == 0
    assert llm.processor is None or llm.processor.num_unfinished == 0
    assert not llm._raw._reqs
    assert tokens(llm.generate([[5, 6, 7]], GREEDY4)) == tokens(fake_llm().generate([[5, 6, 7]], GREEDY4))


# ---- vLLM users' habits (issue 28) --------------------------------------------------------
def test_vllm_arguments_accepted_with_a_warning_where_they_mean_nothing(recwarn):
    fake_llm(trust_remote_code=False, enforce_eager=False, swap_space=0, disable_log_stats=True)
    assert not [w for w in recwarn if issubclass(w.category, UserWarning)]  # they change nothing
    for kw, says in [({"trust_remote_code": True}, r"trust_remote_code=True\) ignored"),
                     ({"swap_space": 4}, r"swap_space=4\) ignored")]:
        with pytest.warns(UserWarning, match=says) as got:
            fake_llm(**kw)
        assert len(got) == 1 and "\n" not in str(got[0].message)
        assert got[0].filename == __file__  # pointed at the LLM(...) call: stacklevel
    with pytest.raises(TypeError, match="unknown engine arguments"):
        fake_llm(tensor_paralel_size=2)  # still refused: a misspelt argument is not a habit


def test_enforce_eager_is_an_engine_field():
    """vLLM's enforce_eager: no captured CUDA decode graphs (a CPU step is always eager)."""
    llm = fake_llm(enforce_eager=True)
    assert llm.config.model_config.enforce_eager is True
    assert tokens(llm.generate([[5, 6, 7]], GREEDY4)) == tokens(fake_llm().generate([[5, 6, 7]], GREEDY4))


def test_tokenizer_argument(tmp_path):
    assert fake_llm(tokenizer=DEFAULT_MODEL).get_tokenizer().encode("Hi")
    other = tmp_path / "tok"
    other.mkdir()
    (other / "tokenizer.json").write_bytes((Path(DEFAULT_MODEL) / "tokenizer.json").read_bytes())
    llm = fake_llm(tokenizer=str(other))
    assert llm.get_tokenizer().chat_template is None  # read from there: no tokenizer_config
    with pytest.raises(ValueError, match="tokenizer='meta-llama/x': not the model directory"):
        fake_llm(tokenizer="meta-llama/x")


def test_generate_prompt_token_ids_and_lora_request_none():
    llm = fake_llm()
    want = tokens(llm.generate([[5, 6, 7], [8, 9]], GREEDY4))
    assert tokens(llm.generate(prompt_token_ids=[[5, 6, 7], [8, 9]], sampling_params=GREEDY4)) == want
    assert tokens(llm.generate(prompt_token_ids=[5, 6, 7], sampling_params=GREEDY4)) == want[:1]
    assert tokens(llm.generate([[5, 6, 7]], GREEDY4, lora_request=None)) == want[:1]
    with pytest.raises(TypeError, match="not both"):
        llm.generate([[1]], prompt_token_ids=[[1]])
    with pytest.raises(ValueError, match="LoRA adapters are not supported"):
        llm.generate([[5]], GREEDY4, lora_request=object())
    with pytest.raises(ValueError, match="LoRA adapters are not supported"):
        llm.chat([{"role": "user", "content": "hi"}], GREEDY4, lora_request=object())


def test_prompt_typeddicts():
    from pipeline.inputs import TextPrompt, TokensPrompt

    llm = fake_llm()
    outs = llm.generate([TextPrompt(prompt="Hello"), TokensPrompt(prompt_token_ids=[5, 6])], GREEDY4)
    assert outs[0].prompt == "Hello" and outs[1].prompt_token_ids == [5, 6]
    assert TokensPrompt.__required_keys__ == {"prompt_token_ids"}
    assert TextPrompt.__required_keys__ == {"prompt"} and "cache_salt" in TextPrompt.__optional_keys__


def test_use_tqdm_callable_is_the_bar(capsys):
    made = []

    class Bar:  # what vLLM calls on its tqdm class
        def __init__(self, **kw):
            self.kw, self.n, self.closed = kw, 0, False
            made.append(self)

        def update(self, n):
            self.n += n

        def close(self):
            self.closed = True

    fake_llm().generate([[5, 6, 7 + i] for i in range(3)], GREEDY4, use_tqdm=Bar)
    (bar,) = made
    assert bar.kw["total"] == 3 and bar.n == 3 and bar.closed
    assert capsys.readouterr().err == ""  # ours does not draw too
    with pytest.raises(TypeError, match="tqdm-like callable"):
        fake_llm().generate([[5]], GREEDY4, use_tqdm="yes")


def test_sampling_params_clone():
    sp = SamplingParams(max_tokens=4, stop=["x"], logit_bias={3: 1.0})
    c = sp.clone()
    assert c == sp and c is not sp
    c.stop.append("y")
    c.logit_bias[4] = 2.0
    assert sp.stop == ["x"] and sp.logit_bias == {3: 1.0}


def test_tokenizer_as_hugging_faces():
    tok = fake_llm().get_tokenizer()
    assert tok.eos_token_id is not None and tok.eos_token_id in tok.eos_token_ids
    assert tok.decode([tok.eos_token_id], skip_special_tokens=False) == tok.eos_token
    enc = tok("Hello there")
    assert enc["input_ids"] == tok.encode("Hello there") and enc["attention_mask"] == [1] * len(enc["input_ids"])
    assert tok(["a", "b c"])["input_ids"] == [tok.encode("a"), tok.encode("b c")]
    msgs = [{"role": "user", "content": "Hi"}]
    text = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert isinstance(text, str) and text == tok.render_chat(msgs) and "tokenize" not in text
    ids = tok.apply_chat_template(msgs, tokenize=True, add_generation_prompt=True)
    assert ids == tok.encode(text, add_special_tokens=False) == tok.apply_chat_template(msgs)
