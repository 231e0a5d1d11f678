"""The one request validator: every limit that needs the model, with an error naming the
field and the limit; the tokenizer stage and the in-process LLM both call it. Also the byte
limits of prompts (the gateway's checks before accepting) and the answer-size bound."""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline.messages.requests import MAX_PROMPT_BYTES, MAX_PROMPT_TOKENS
from pipeline.runtime.ring_sizes import answer_bytes_bound
from pipeline.sampling_params import SamplingParams
from pipeline.tokenizer.validate import (
    InvalidRequest,
    check_answer_fits,
    check_messages_bytes,
    check_prompt_text,
    one_prompt_field,
    validate_request,
)

VOCAB, MAX_LEN = 1000, 64


def check(ids, field="prompt_token_ids", **sp) -> SamplingParams:
    return validate_request(ids, SamplingParams(**sp), field=field, vocab_size=VOCAB,
                            max_model_len=MAX_LEN)


@pytest.mark.parametrize("ids, field, sp, needle", [
    ([1], "prompt", {"top_k": 5000}, "vocab_size=1000"),
    ([1], "prompt", {"stop_token_ids": [1000]}, "field `stop_token_ids`"),
    ([1], "prompt", {"max_tokens": 65}, "field `max_tokens`: must be <= max_model_len (64)"),
    (list(range(64)), "prompt_token_ids", {},
     "field `prompt_token_ids`: 64 tokens, at most 63 (max_model_len (64) minus one"),
    ([5, 1000], "prompt_token_ids", {}, "field `prompt_token_ids[1]`"),
    ([5, -1], "prompt_token_ids", {}, "got -1"),
    ([], "prompt_token_ids", {}, "field `prompt_token_ids`: must not be empty"),
    ([], "messages", {}, "field `messages`: must not be empty"),
    ([1] * 60, "prompt", {"max_tokens": 10, "min_tokens": 5},
     "field `min_tokens`: 5, but only 4 tokens fit after the 60-token prompt (max_model_len 64)"),
])
def test_bad_requests_name_the_field_and_limit(ids, field, sp, needle):
    with pytest.raises(InvalidRequest) as exc:
        check(ids, field, **sp)
    assert needle in str(exc.value)


def test_prompt_of_max_model_len_minus_one_runs_with_max_tokens_cut_to_the_room_left():
    """One rule: the prompt leaves room for one token; max_tokens is cut to the room left
    (the old validator refused max_model_len - 1 tokens + max_tokens 5 while its message
    said only "< max_model_len" was needed)."""
    sp = check([1] * 63, max_tokens=5)
    assert sp.max_tokens == 1
    assert check([1] * 40, max_tokens=30, min_tokens=24).max_tokens == 24
    same = SamplingParams(max_tokens=3)
    assert validate_request([1] * 10, same, field="prompt", vocab_size=VOCAB,
                            max_model_len=MAX_LEN) is same  # untouched when it fits


def test_one_prompt_field():
    assert one_prompt_field(prompt="x", prompt_token_ids=None, messages=None) == "prompt"
    with pytest.raises(InvalidRequest, match="exactly one of `prompt`"):
        one_prompt_field(prompt=None, prompt_token_ids=None, messages=None)
    with pytest.raises(InvalidRequest, match="got \\['prompt', 'messages'\\]"):
        one_prompt_field(prompt="x", prompt_token_ids=None, messages=[])


@pytest.mark.parametrize("char", ["x", "é", "€", "\U0001F600"])
def test_prompt_limit_is_in_utf8_bytes(char):
    """A prompt of 4-byte characters under the old character limit but over the byte limit
    used to pass the check, then crash the gateway on the ring send."""
    width = len(char.encode())
    fits = char * (MAX_PROMPT_BYTES // width)
    check_prompt_text(fits)
    over = fits + char
    if width > 1:
        assert len(over) <= 4 << 20  # within the old limit, counted in characters
    with pytest.raises(InvalidRequest) as exc:
        check_prompt_text(over)
    assert str(exc.value) == (f"field `prompt`: {len(over.encode())} bytes (UTF-8), the limit "
                              f"is {MAX_PROMPT_BYTES} bytes")


def test_messages_limit_counts_them_together():
    one = {"role": "user", "content": "x" * (1 << 20)}
    check_messages_bytes([one] * 3)
    with pytest.raises(InvalidRequest, match=f"field `messages`: 5 messages of \\d+ bytes together "
                                             f"\\(encoded\\), the limit is {MAX_PROMPT_BYTES} bytes"):
        check_messages_bytes([one] * 5)


def test_prompt_token_ids_are_also_bounded_by_max_prompt_tokens():
    with pytest.raises(InvalidRequest, match=f"at most {MAX_PROMPT_TOKENS} \\(MAX_PROMPT_TOKENS"):
        validate_request([1] * (MAX_PROMPT_TOKENS + 1), SamplingParams(), field="prompt_token_ids",
                         vocab_size=VOCAB, max_model_len=MAX_PROMPT_TOKENS + 10)


def test_answer_that_could_outgrow_its_ring_message_is_refused_naming_the_knobs():
    sp = SamplingParams(n=4, max_tokens=1000, logprobs=5)
    size = answer_bytes_bound(sp, 10, token_text_bytes=100)
    check_answer_fits(sp, 10, 100, limit=size)
    with pytest.raises(InvalidRequest) as exc:
        check_answer_fits(sp, 10, 100, limit=size - 1)
    msg = str(exc.value)
    assert f"up to {size} bytes" in msg and f"limit of {size - 1} bytes" in msg
    assert "n=4, max_tokens=1000, logprobs=5" in msg and "lower n or max_tokens or logprobs" in msg


@settings(max_examples=200, deadline=None)
@given(ids=st.lists(st.integers(-5, VOCAB + 5), max_size=80), max_tokens=st.integers(1, MAX_LEN),
       min_tokens=st.integers(0, MAX_LEN))
def test_accepts_exactly_what_fits(ids, max_tokens, min_tokens):
    min_tokens = min(min_tokens, max_tokens)
    room = MAX_LEN - len(ids)
    fits = 0 < len(ids) < MAX_LEN and all(0 <= t < VOCAB for t in ids) and min_tokens <= room
    try:
        sp = check(ids, max_tokens=max_tokens, min_tokens=min_tokens)
    except InvalidRequest:
        assert not fits
    else:
        assert fits
        assert sp.max_tokens == min(max_tokens, room) and sp.min_tokens == min_tokens
