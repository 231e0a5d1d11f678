"""SamplingParams as a vLLM user expects it: ``stop`` as a string or a list, every limit
checked when the struct is built or decoded (the error names the field and the limit), the
model's limits in ``validate``, and the text-level fields turned into token ids where the
prompt becomes token ids (``truncate_prompt``, ``resolve_bad_words``)."""
from __future__ import annotations

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from pipeline.frontend import protocol as P
from pipeline.frontend.request_parser import sampling_params
from pipeline.messages import EngineOutput, EngineOutputs, RequestResult
from pipeline.output.detokenizer import DetokenizerTable
from pipeline.output.processor import OutputProcessor
from pipeline.sampling_params import SamplingParams
from pipeline.sampling_params.limits import MAX_LOGPROBS_BYTES


def _tok() -> Tokenizer:
    t = Tokenizer(models.BPE())
    t.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    t.decoder = decoders.ByteLevel()
    t.train_from_iterator(["the good dog and the bad cat sat on a mat"] * 20, trainers.BpeTrainer(
        vocab_size=90, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return t


TOK = _tok()


def test_stop_as_a_string_is_one_stop_string_not_its_characters():
    sp = SamplingParams(stop="dog", max_tokens=50)
    assert sp.stop == ["dog"]
    p = OutputProcessor(DetokenizerTable(TOK), lambda: 0.0)
    p.add_request("r", sp, 0.0)
    got: list[RequestResult] = []
    # "good" holds "d" and "o": a per-character stop would end it at "the goo".
    stopped = p.process(EngineOutputs([EngineOutput("r", TOK.encode("the good dog sat").ids)]), got.append)
    assert stopped == ["r"] and got[0].text == "the good " and got[0].stop_reason == "dog"


@pytest.mark.parametrize("kw, normal", [
    ({"stop": None}, {"stop": []}), ({"stop": ["a", "b"]}, {"stop": ["a", "b"]}),
    ({"stop_token_ids": 7}, {"stop_token_ids": [7]}), ({"stop_token_ids": None}, {"stop_token_ids": []}),
    ({"bad_words": "cat"}, {"bad_words": ["cat"]}),
])
def test_single_values_and_none_are_normalised(kw, normal):
    sp = SamplingParams(**kw)
    assert {k: getattr(sp, k) for k in normal} == normal
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(sp), type=SamplingParams) == sp


BAD = [
    ({"temperature": -1}, "temperature must be in [0, 100], got -1"),
    ({"temperature": float("nan")}, "temperature must be in [0, 100]"),
    ({"top_p": 0}, "top_p must be in (0, 1]"),
    ({"max_tokens": 0}, "max_tokens must be >= 1"),
    ({"max_tokens": 2.5}, "max_tokens must be an integer"),
    ({"min_tokens": 5, "max_tokens": 4}, "min_tokens must be in [0, max_tokens=4]"),
    ({"n": 0}, "n must be in [1, 64]"),
    ({"n": 65}, "n must be in [1, 64]"),
    ({"top_k": -2}, "top_k must be -1, 0 or >= 1"),
    ({"seed": -1}, "seed must be in [0, 2**63)"),
    ({"stop": [""]}, "stop must be non-empty strings of at most 256 UTF-8 bytes"),
    ({"stop": ["é" * 129]}, "at most 256 UTF-8 bytes"),  # 129 characters, 258 bytes
    ({"stop": ["x"] * 17}, "stop must be at most 16 strings"),
    ({"stop_token_ids": [-3]}, "stop_token_ids must be token ids >= 0"),
    ({"logprobs": 21}, "logprobs must be None or in [0, 20]"),
    ({"prompt_logprobs": -1}, "prompt_logprobs must be None or in [0, 20]"),
    ({"logprobs": 20, "max_tokens": 10000, "n": 2}, f"at most {MAX_LOGPROBS_BYTES} bytes of logprobs"),
    ({"logit_bias": {5: 101.0}}, "logit_bias must be in [-100, 100]"),
    ({"logit_bias": {-1: 1.0}}, "logit_bias must be token ids >= 0"),
    ({"allowed_token_ids": []}, "allowed_token_ids must be None or a non-empty list"),
    ({"bad_words_token_ids": [[]]}, "bad_words_token_ids must be non-empty sequences"),
    ({"truncate_prompt_tokens": 0}, "truncate_prompt_tokens must be None, -1 or >= 1"),
]


@pytest.mark.parametrize("kw, needle", BAD)
def test_construction_and_decoding_name_the_field_and_limit(kw, needle):
    with pytest.raises(ValueError) as exc:
        SamplingParams(**kw)
    assert needle in str(exc.value)
    if any(isinstance(v, float) and v != v for v in kw.values()):
        return  # NaN is not JSON
    with pytest.raises(msgspec.ValidationError) as exc2:  # e.g. a struct read off a ring
        msgspec.json.decode(msgspec.json.encode(kw), type=SamplingParams)
    # The same message, or msgspec's own type error at the field.
    assert needle in str(exc2.value) or f"$.{needle.split()[0]}`" in str(exc2.value)


@pytest.mark.parametrize("kw, needle", BAD[:4] + BAD[6:8])
def test_wire_protocol_names_the_field(kw, needle):
    field, _, rest = needle.partition(" ")
    with pytest.raises(P.ProtocolError) as exc:
        sampling_params(msgspec.convert({"op": "generate", "id": "x", "prompt": "p", **kw}, P.Generate))
    assert exc.value.error.message.startswith(f"field `{field}`: {rest}")
    assert exc.value.error.code == "invalid_request" and exc.value.req_id == "x"


def test_wire_protocol_takes_every_new_field():
    gen = msgspec.json.decode(b'{"id": "a", "prompt": "p", "n": 3, "stop": "x", "bad_words": "cat",'
                              b' "logit_bias": {"5": -2.5}, "allowed_token_ids": [1, 2],'
                              b' "prompt_logprobs": 2, "truncate_prompt_tokens": 8}', type=P.Generate)
    sp = sampling_params(gen)
    assert (sp.n, sp.stop, sp.bad_words, sp.logit_bias, sp.allowed_token_ids, sp.prompt_logprobs,
            sp.truncate_prompt_tokens) == (3, ["x"], ["cat"], {5: -2.5}, [1, 2], 2, 8)


@settings(max_examples=150, deadline=None)
@given(kw=st.fixed_dictionaries({}, optional={
    "n": st.integers(-2, 70), "max_tokens": st.integers(-1, 50), "min_tokens": st.integers(-1, 60),
    "temperature": st.floats(-1, 101, allow_nan=False), "top_p": st.floats(-0.5, 1.5, allow_nan=False),
    "top_k": st.integers(-3, 10), "seed": st.integers(-5, 2**64),
    "stop": st.one_of(st.text(max_size=3), st.lists(st.text(max_size=3), max_size=3)),
    "logit_bias": st.dictionaries(st.integers(-2, 9), st.floats(-150, 150, allow_nan=False), max_size=3),
    "logprobs": st.one_of(st.none(), st.integers(-2, 25)),
}))
def test_accepted_exactly_when_decoded_and_round_trips(kw):
    """Building and decoding accept the same values, and what is accepted survives a ring."""
    try:
        sp = SamplingParams(**kw)
    except ValueError:
        with pytest.raises(msgspec.ValidationError):
            msgspec.json.decode(msgspec.json.encode(kw), type=SamplingParams)
        return
    assert msgspec.json.decode(msgspec.json.encode(kw), type=SamplingParams) == sp
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(sp), type=SamplingParams) == sp
    assert isinstance(sp.stop, list)


@pytest.mark.parametrize("kw, needle", [
    ({"allowed_token_ids": [3, 100]}, "allowed_token_ids must be in [0, vocab_size=100)"),
    ({"logit_bias": {100: 1.0}}, "logit_bias must be in [0, vocab_size=100)"),
    ({"bad_words_token_ids": [[1, 100]]}, "bad_words_token_ids must be in [0, vocab_size=100)"),
    ({"bad_words": ["cat"]}, "bad_words must be tokenized before validation"),
    ({"truncate_prompt_tokens": 65}, "truncate_prompt_tokens must be -1 or in [1, max_model_len=64]"),
])
def test_validate_checks_what_needs_the_model(kw, needle):
    with pytest.raises(ValueError, match=needle.replace("[", r"\[").replace("(", r"\(").replace(")", r"\)")):
        SamplingParams(**kw).validate(vocab_size=100, max_model_len=64)


def test_prompt_logprobs_size_is_bounded_by_the_prompt():
    sp = SamplingParams(prompt_logprobs=20)
    sp.validate(vocab_size=100, max_model_len=1 << 20, num_prompt_tokens=1000)
    with pytest.raises(ValueError, match="prompt_logprobs must be at most"):
        sp.validate(vocab_size=100, max_model_len=1 << 20, num_prompt_tokens=100_000)


def test_validate_rechecks_a_struct_changed_after_it_was_built():
    sp = SamplingParams()
    sp.stop = "dog"  # type: ignore[assignment] - what a caller may do
    sp.validate()
    assert sp.stop == ["dog"]
    sp.temperature = -3
    with pytest.raises(ValueError, match="temperature must be in"):
        sp.validate()


def test_truncate_prompt_keeps_the_last_tokens():
    ids = list(range(10))
    assert SamplingParams().truncate_prompt(ids, 64) == ids
    assert SamplingParams(truncate_prompt_tokens=3).truncate_prompt(ids, 64) == [7, 8, 9]
    assert SamplingParams(truncate_prompt_tokens=30).truncate_prompt(ids, 64) == ids
    # -1: as many as leave room for max_tokens.
    assert SamplingParams(truncate_prompt_tokens=-1, max_tokens=60).truncate_prompt(ids, 64) == [6, 7, 8, 9]


def test_resolve_bad_words_with_the_tokenizer():
    def encode(s: str) -> list[int]:
        return TOK.encode(s).ids

    sp = SamplingParams(bad_words=["cat", "good dog"], bad_words_token_ids=[[1]])
    r = sp.resolve_bad_words(encode)
    assert r.bad_words == [] and sp.bad_words == ["cat", "good dog"]  # a copy
    assert r.bad_words_token_ids[0] == [1] and encode("cat") in r.bad_words_token_ids
    assert encode("good dog") in r.bad_words_token_ids
    # " cat" is one distinct token: banned after a space too.
    if len(encode(" cat")) == len(encode("cat")):
        assert encode(" cat") in r.bad_words_token_ids
    r.validate(vocab_size=TOK.get_vocab_size())
    assert SamplingParams().resolve_bad_words(encode) == SamplingParams()


def test_stage_to_stage_decoding_skips_the_checks_the_submit_ring_keeps():
    """Past the submit ring, SamplingParams were checked where the request came in; a stage
    decoding another stage's message does not check them again (runtime.rings.Channel)."""
    import msgspec

    from pipeline.messages import EngineRequest, GatewayRequest
    from pipeline.runtime.rings import Channel

    class OneMessage:  # the ring end Channel reads from
        def __init__(self, buf: bytes) -> None:
            self.buf = buf

        def recv(self, timeout=None) -> bytes:
            return self.buf

    bad = SamplingParams(temperature=0.5)
    bad.temperature = -1.0  # what no check would let through
    engine_req = EngineRequest("r", b"", bad, 0.0)
    gateway_req = GatewayRequest(req_id="r", sampling_params=bad, prompt="x")
    requests = Channel(OneMessage(b""), "requests")
    requests.ring = OneMessage(bytes(requests.encode(engine_req)))
    assert requests.recv().sampling_params.temperature == -1.0  # trusted: not re-checked
    submit = Channel(OneMessage(b""), "submit")
    submit.ring = OneMessage(bytes(submit.encode(gateway_req)))
    with pytest.raises(msgspec.ValidationError, match="temperature must be in"):
        submit.recv()
    # And the flag is per decode: building one here is checked again.
    with pytest.raises(ValueError, match="temperature must be in"):
        SamplingParams(temperature=-1.0)
