"""The one request validator: every limit that needs the model, with an error naming the
field and the limit; the tokenizer stage and the in-process LLM both call it."""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline.messages import MAX_PROMPT_CHARS
from pipeline.sampling_params import SamplingParams
from pipeline.tokenizer.validate import InvalidRequest, check_prompt_text, one_prompt_field, validate_request

VOCAB, MAX_LEN = 1000, 64


def check(ids, field="prompt_token_ids", **sp) -> None:
    validate_request(ids, SamplingParams(**sp), field=field, vocab_size=VOCAB, max_model_len=MAX_LEN)


@pytest.mark.parametrize("ids, field, sp, needle", [
    ([1], "prompt", {"temperature": 101}, "field `temperature`: must be in [0, 100]"),
    ([1], "prompt", {"top_k": 5000}, "vocab_size=1000"),
    ([1], "prompt", {"max_tokens": 0}, "field `max_tokens`: must be >= 1"),
    ([1], "prompt", {"stop_token_ids": [1000]}, "field `stop_token_ids`"),
    ([1], "prompt", {"top_p": 0}, "field `top_p`"),
    (list(range(64)), "prompt_token_ids", {}, "64 tokens, must be < max_model_len (64)"),
    ([5, 1000], "prompt_token_ids", {}, "field `prompt_token_ids[1]`"),
    ([5, -1], "prompt_token_ids", {}, "got -1"),
    ([], "prompt_token_ids", {}, "field `prompt_token_ids`: must not be empty"),
    ([], "messages", {}, "field `messages`: must not be empty"),
    ([1] * 40, "prompt", {"max_tokens": 30}, "40 prompt tokens + max_tokens 30 = 70 exceeds max_model_len (64)"),
])
def test_bad_requests_name_the_field_and_limit(ids, field, sp, needle):
    with pytest.raises(InvalidRequest) as exc:
        check(ids, field, **sp)
    assert needle in str(exc.value)


def test_one_prompt_field_and_text_bound():
    assert one_prompt_field(prompt="x", prompt_token_ids=None, messages=None) == "prompt"
    with pytest.raises(InvalidRequest, match="exactly one of `prompt`"):
        one_prompt_field(prompt=None, prompt_token_ids=None, messages=None)
    with pytest.raises(InvalidRequest, match="got \\['prompt', 'messages'\\]"):
        one_prompt_field(prompt="x", prompt_token_ids=None, messages=[])
    check_prompt_text("x" * MAX_PROMPT_CHARS)
    with pytest.raises(InvalidRequest, match=f"at most {MAX_PROMPT_CHARS} characters"):
        check_prompt_text("x" * (MAX_PROMPT_CHARS + 1))


@settings(max_examples=200, deadline=None)
@given(ids=st.lists(st.integers(-5, VOCAB + 5), max_size=80), max_tokens=st.integers(1, 80))
def test_accepts_exactly_what_fits(ids, max_tokens):
    fits = (0 < len(ids) < MAX_LEN and all(0 <= t < VOCAB for t in ids)
            and len(ids) + max_tokens <= MAX_LEN)
    try:
        check(ids, max_tokens=max_tokens)
    except InvalidRequest:
        assert not fits
    else:
        assert fits
