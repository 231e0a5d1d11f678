"""OutputProcessor: deltas add up to the answer, one answer per request, stop strings cut
and reported to the engine, first tokens first, timings from the clock it is given."""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from pipeline.messages import EngineOutput, EngineOutputs, ErrorInfo, RequestDelta, RequestResult, TokenLogprobs
from pipeline.output.detokenizer import DetokenizerTable
from pipeline.output.processor import OutputProcessor
from pipeline.sampling_params import SamplingParams

CORPUS = ["the quick brown fox jumps over the lazy dog. 你好世界 😀 café </stop> END"] * 30


def _tokenizer() -> Tokenizer:
    t = Tokenizer(models.BPE())
    t.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    t.decoder = decoders.ByteLevel()
    t.train_from_iterator(CORPUS, trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<eos>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    t.add_tokens(["<tool>"])
    return t


TOK = _tokenizer()
TABLE = DetokenizerTable(TOK)
EOS = TOK.token_to_id("<eos>")


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def ids(text: str) -> list[int]:
    return TOK.encode(text).ids


def collect() -> tuple[list, callable]:
    got: list[RequestDelta | RequestResult] = []
    return got, got.append


def out(rid: str, toks: list[int], finish: str | None = None, **kw) -> EngineOutputs:
    return EngineOutputs([EngineOutput(rid, toks, finish, **kw)])


def test_stream_deltas_add_up_and_timings():
    clock = Clock()
    p = OutputProcessor(TABLE, clock)
    p.add_request("r", SamplingParams(max_tokens=50), arrival_time=99.0, stream=True, num_prompt_tokens=7)
    toks = ids("你好世界 😀 café")
    got, emit = collect()
    for i, t in enumerate(toks):
        clock.t = 100.0 + i
        last = i == len(toks) - 1
        p.process(out("r", [t], "length" if last else None, num_prompt_tokens=7, num_cached_tokens=4,
                      first_scheduled_time=99.5), emit)
    deltas = [g for g in got if isinstance(g, RequestDelta)]
    [final] = [g for g in got if isinstance(g, RequestResult)]
    assert got[-1] is final
    assert "".join(d.text for d in deltas) == final.text == "你好世界 😀 café"
    assert [t for d in deltas for t in d.token_ids] == final.token_ids == toks
    assert all("\ufffd" not in d.text for d in deltas)
    assert final.finish_reason == "length" and final.error is None
    assert (final.usage.prompt_tokens, final.usage.completion_tokens, final.usage.cached_tokens) == (7, len(toks), 4)
    tm = final.timings
    assert (tm.queue_time, tm.ttft, tm.e2e) == (0.5, 1.0, len(toks))
    assert tm.itl == [1.0] * (len(toks) - 1)
    assert p.num_unfinished == 0


def test_stop_string_across_tokens_finishes_and_drops_late_outputs():
    p = OutputProcessor(TABLE, Clock())
    p.add_request("r", SamplingParams(max_tokens=50, stop=["</stop>"]), 0.0, stream=True)
    toks = ids("the fox</stop> END")
    got, emit = collect()
    stopped: list[str] = []
    for t in toks:
        stopped += p.process(out("r", [t]), emit)
    assert stopped == ["r"]
    finals = [g for g in got if isinstance(g, RequestResult)]
    assert len(finals) == 1 and finals[0].finish_reason == "stop" and finals[0].stop_reason == "</stop>"
    assert finals[0].text == "the fox"
    assert all("<" not in g.text for g in got if isinstance(g, RequestDelta))
    assert TOK.decode(finals[0].token_ids).startswith("the fox</stop>")
    assert p.num_dropped > 0  # tokens the engine produced before it heard of the stop


def test_include_stop_str_and_engine_already_done():
    p = OutputProcessor(TABLE, Clock())
    p.add_request("r", SamplingParams(stop=["END"], include_stop_str_in_output=True), 0.0)
    got, emit = collect()
    stopped = p.process(out("r", ids("dog END"), "length"), emit)
    assert stopped == []  # the engine already finished it: nothing to abort
    assert [g.text for g in got] == ["dog END"]


def test_eos_text_hidden_but_counted():
    p = OutputProcessor(TABLE, Clock())
    tool = TOK.token_to_id("<tool>")
    p.add_request("a", SamplingParams(), 0.0)
    p.add_request("b", SamplingParams(skip_special_tokens=False), 0.0)
    p.add_request("c", SamplingParams(skip_special_tokens=False), 0.0)
    got, emit = collect()
    # The engine ends on EOS with no stop_reason (vLLM's shape): its text is hidden all the
    # same, also where special tokens are kept (a tool parser's request).
    p.process(EngineOutputs([EngineOutput("a", ids("fox") + [tool], "stop", stop_reason=tool),
                             EngineOutput("b", ids("fox") + [EOS], "stop", stop_reason=EOS),
                             EngineOutput("c", ids("fox") + [EOS], "stop")]), emit)
    a, b, c = got
    assert (a.text, a.token_ids[-1], a.stop_reason) == ("fox", tool, tool)
    assert (b.text, b.usage.completion_tokens) == ("fox", len(ids("fox")) + 1)
    assert (c.text, c.token_ids[-1], c.stop_reason) == ("fox", EOS, None)


def test_first_token_jumps_the_batch():
    p = OutputProcessor(TABLE, Clock())
    for r in "abc":
        p.add_request(r, SamplingParams(), 0.0, stream=True)
    got, emit = collect()
    p.process(EngineOutputs([EngineOutput("a", [5])]), emit)
    got.clear()
    p.process(EngineOutputs([EngineOutput("a", [6]), EngineOutput("b", [7]), EngineOutput("c", []),
                             EngineOutput("c", [8])]), emit)
    # b's first token goes out first; c's first output has no token, so c keeps its order.
    assert [g.id for g in got] == ["b", "a", "c"]


def test_abort_and_error_answers_once():
    p = OutputProcessor(TABLE, Clock())
    p.add_request("a", SamplingParams(stop=["zz"]), 0.0, stream=True)
    p.add_request("e", SamplingParams(), 0.0)
    got, emit = collect()
    p.process(out("a", ids("fox z")), emit)
    res = p.abort("a")
    # "z" may start the stop string: never streamed, so not in the final either.
    assert res is not None and res.finish_reason == "abort" and res.text == "fox " == got[0].text
    got.clear()
    assert res.timings.ttft is not None
    assert p.abort("a") is None
    p.process(out("a", [1], "abort"), emit)
    p.process(out("e", [], "error", error="worker died"), emit)
    [err] = got
    assert err.finish_reason == "error" and err.error.code == "engine_error" and "worker died" in err.error.message
    assert err.timings.ttft is None
    with pytest.raises(ValueError, match="already in flight"):
        p.add_request("x", SamplingParams(), 0.0)
        p.add_request("x", SamplingParams(), 0.0)


def test_min_tokens_ignores_early_stop_and_logprobs_cut():
    p = OutputProcessor(TABLE, Clock())
    p.add_request("r", SamplingParams(stop=["fox"], min_tokens=3, logprobs=0), 0.0)
    toks = ids("fox dog fox END")
    lps = [TokenLogprobs(t, -0.5, [], []) for t in toks]
    got, emit = collect()
    stopped = p.process(out("r", toks, logprobs=lps), emit)
    [res] = got
    assert stopped == ["r"] and res.text.startswith("fox dog ") and not res.text.endswith("fox")
    assert [lp.token_id for lp in res.logprobs] == res.token_ids


@settings(max_examples=80, deadline=None)
@given(text=st.text(alphabet="ab 你😀</stop>", max_size=30),
       stops=st.lists(st.text(alphabet="ab 你😀/", min_size=1, max_size=3), max_size=2),
       sizes=st.lists(st.integers(1, 4), min_size=1, max_size=20), stream=st.booleans())
def test_any_batching_one_answer(text, stops, sizes, stream):
    toks = ids(text) + [EOS]
    p = OutputProcessor(TABLE, Clock())
    p.add_request("r", SamplingParams(stop=stops), 0.0, stream=stream)
    got, emit = collect()
    i = k = 0
    while i < len(toks):
        n = sizes[k % len(sizes)]
        chunk = toks[i:i + n]
        i, k = i + n, k + 1
        p.process(out("r", chunk, "stop" if i >= len(toks) else None, stop_reason=EOS if i >= len(toks) else None), emit)
    finals = [g for g in got if isinstance(g, RequestResult)]
    assert len(finals) == 1 and got[-1] is finals[0]
    final = finals[0]
    if stream:
        assert "".join(g.text for g in got[:-1]) == final.text
        assert [t for g in got[:-1] for t in g.token_ids] == final.token_ids
    full = TOK.decode(toks[:-1])
    hits = [(full.find(s) + len(s), -len(s), s) for s in stops if s in full]
    if hits:
        _, neg, s = min(hits)
        assert final.stop_reason == s and final.text == full[: full.find(s)]
    else:
        assert final.text == full and final.token_ids == toks


def test_aborts_answer_the_agreed_shape_naming_who():
    p = OutputProcessor(TABLE, Clock())
    for r in "abc":
        p.add_request(r, SamplingParams(), 0.0)
    got, emit = collect()
    # Client aborts reach the token processor as the engine's "abort" outputs.
    p.process(EngineOutputs([EngineOutput("a", [], "abort", error="aborted by the client"),
                             EngineOutput("b", [], "abort", error="aborted: timeout")]), emit)
    res = {r.id: r for r in got}
    assert all(r.finish_reason == "abort" and r.error.code == "aborted" for r in res.values())
    assert (res["a"].error.message, res["b"].error.message) == ("aborted by the client", "aborted: timeout")
    c = p.abort("c", error=ErrorInfo("aborted", "aborted: the server shut down"))
    assert (c.finish_reason, c.error.code, c.error.message) == ("abort", "aborted", "aborted: the server shut down")
    p.add_request("d", SamplingParams(), 0.0)
    d = p.abort("d")
    assert (d.finish_reason, d.error.code) == ("abort", "aborted")


def test_answer_too_large_for_its_ring_becomes_an_error_answer(inst, capsys):
    from pipeline.ipc.ring import Ring
    from pipeline.output.stage import OutputLoop
    from pipeline.runtime.rings import Channel

    writer = Ring.create(inst, "answers", 4096, role="writer", claim=True)
    reader = Channel(Ring.attach(writer.name, "reader"), "answers")
    loop = OutputLoop.__new__(OutputLoop)  # only its answers ring: no stage around it
    loop.answers, loop.spec = Channel(writer, "answers"), type("S", (), {"name": "output"})()
    p = OutputProcessor(TABLE, Clock())
    p.add_request("big", SamplingParams(max_tokens=5000), 0.0)
    p.add_request("ok", SamplingParams(), 0.0)
    p.process(EngineOutputs([EngineOutput("big", [5] * 3000, "length"), EngineOutput("ok", [5], "length")]),
              loop._send)
    big, ok = reader.try_recv(), reader.try_recv()
    assert (big.id, big.finish_reason, big.error.code, big.token_ids) == ("big", "error", "answer_too_large", [])
    assert "bytes exceeds the limit of" in big.error.message and big.usage.completion_tokens == 3000
    assert ok.id == "ok" and ok.error is None and reader.try_recv() is None
    reader.close()
    writer.close()
