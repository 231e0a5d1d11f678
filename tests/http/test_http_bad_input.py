"""Issue 25 items 6 and 8 on a real `pipeline serve --http`.

Item 6: what JSON lets through but nothing after it can carry (a lone UTF-16 surrogate in any
string or object key, an integer outside [-2**63, 2**64), a priority outside int32, a
logit_bias key past 64 bits) is a 400 naming the field, on every route, never a 500.

Item 8: on a 131072-token model, a body without max_tokens is not refused over limits the
client never set (n: 3; logprobs with top_logprobs): it gets as many tokens as fit; an explicit
max_tokens is still held to every limit, named.
"""
from __future__ import annotations

import json

import httpx
import pytest
from e2e_helpers import Daemon, make_tiny_model
from hypothesis import given
from hypothesis import strategies as st

from pipeline.runtime.ring_sizes import answer_bytes_bound
from pipeline.sampling_params import SamplingParams
from pipeline.sampling_params.limits import max_tokens_that_fit

LONG = 131072
LONE = "\ud800"  # json.dumps writes it as the escape "\ud800": valid JSON, no Unicode
BIG = 2**64
MSG = [{"role": "user", "content": "hi"}]
# The answer's first token is a stop token: a request the engine may run for its whole implied
# max_tokens (~100k on a random model) ends at once, while what it asked is still checked.
STOP_AT_ONCE = {"allowed_token_ids": [5, 6], "stop_token_ids": [5, 6]}


@pytest.fixture(scope="module")
def url(tmp_path_factory):
    model = make_tiny_model(tmp_path_factory.mktemp("http-bad-input") / "tiny", max_positions=LONG)
    d = Daemon(model, "--max-model-len", str(LONG), "--num-blocks", "8300", http=True)
    d.wait_ready()
    yield d.http_url
    d.stop()


C, CHAT, TOK, DETOK = "/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"
CASES = [
    # (route, body, the field the error names)
    (C, {"prompt": LONE}, "prompt"),
    (C, {"prompt": ["a", "b" + LONE]}, "prompt[1]"),
    (C, {"prompt": "a", "model": LONE}, "model"),
    (C, {"prompt": "a", "stop": [LONE]}, "stop[0]"),
    (C, {"prompt": "a", "bad_words": [LONE]}, "bad_words[0]"),
    (C, {"prompt": "a", "cache_salt": LONE}, "cache_salt"),
    (C, {"prompt": "a", "user": LONE}, "user"),
    (C, {"prompt": "a", "metadata": {"k": LONE}}, "metadata.k"),
    (C, {"prompt": "a", "structured_outputs": {"regex": LONE}}, "structured_outputs.regex"),
    (C, {"prompt": "a", "structured_outputs": {"choice": ["x", LONE]}}, "structured_outputs.choice[1]"),
    (C, {"prompt": "a", "guided_json": {"type": "string", "pattern": LONE}}, "guided_json.pattern"),
    (C, {"prompt": "a", "guided_grammar": LONE}, "guided_grammar"),
    (CHAT, {"messages": [{"role": "user", "content": LONE}]}, "messages[0].content"),
    (CHAT, {"messages": [{"role": "user", "content": [{"type": "text", "text": LONE}]}]},
     "messages[0].content[0].text"),
    (CHAT, {"messages": [{"role": "user", "content": "hi", "name": LONE}]}, "messages[0].name"),
    (CHAT, {"messages": [{"role": LONE, "content": "hi"}]}, "messages[0].role"),
    (CHAT, {"messages": MSG, "chat_template_kwargs": {"x": LONE}}, "chat_template_kwargs.x"),
    (CHAT, {"messages": MSG, "chat_template_kwargs": {LONE: 1}}, "chat_template_kwargs"),
    (CHAT, {"messages": MSG, "response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "string", "pattern": LONE}}}}, "response_format.json_schema.schema.pattern"),
    (TOK, {"prompt": LONE}, "prompt"),
    (TOK, {"messages": [{"role": "user", "content": LONE}]}, "messages[0].content"),
    (TOK, {"prompt": "a", "model": LONE}, "model"),
    # integers past what msgpack carries, anywhere
    (C, {"prompt": "a", "max_tokens": BIG}, "max_tokens"),
    (C, {"prompt": "a", "max_tokens": -(2**63) - 1}, "max_tokens"),
    (C, {"prompt": "a", "stop_token_ids": [1, BIG]}, "stop_token_ids[1]"),
    (C, {"prompt": [1, BIG]}, "prompt[1]"),
    (C, {"prompt": "a", "seed": BIG}, "seed"),
    (C, {"prompt": "a", "top_k": BIG}, "top_k"),
    (C, {"prompt": "a", "n": BIG}, "n"),
    (C, {"prompt": "a", "min_tokens": BIG}, "min_tokens"),
    (C, {"prompt": "a", "truncate_prompt_tokens": BIG}, "truncate_prompt_tokens"),
    (C, {"prompt": "a", "allowed_token_ids": [BIG]}, "allowed_token_ids[0]"),
    (C, {"prompt": "a", "temperature": BIG}, "temperature"),
    (C, {"prompt": "a", "logit_bias": {str(BIG): 1}}, "logit_bias"),
    (CHAT, {"messages": MSG, "max_completion_tokens": BIG}, "max_completion_tokens"),
    (DETOK, {"tokens": [BIG]}, "tokens[0]"),
    # priority is int32 on the wire
    (C, {"prompt": "a", "priority": 2**31}, "priority"),
    (CHAT, {"messages": MSG, "priority": -(2**31) - 1}, "priority"),
]


@pytest.mark.parametrize("route, body, field", CASES, ids=[f"{r}:{f}" for r, _, f in CASES])
def test_bad_values_are_400_naming_the_field(url, route, body, field):
    r = httpx.post(url + route, content=json.dumps(body), timeout=60)  # ASCII: "\ud800" escaped
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == field, err
    assert f"`{field}`" in err["message"], err


def test_deep_nesting_is_400(url):
    deep = "[" * 5000 + '"x"' + "]" * 5000
    r = httpx.post(url + C, content=f'{{"prompt": "a", "metadata": {deep}}}', timeout=60)
    assert r.status_code == 400, r.text


@pytest.mark.parametrize("extra", [{"n": 3}, {"logprobs": True, "top_logprobs": 5},
                                   {"n": 3, "logprobs": True, "top_logprobs": 20}])
def test_long_context_chat_without_max_tokens_is_served(url, extra):
    r = httpx.post(url + CHAT, json={"messages": MSG, **STOP_AT_ONCE, **extra}, timeout=300)
    assert r.status_code == 200, r.text
    assert len(r.json()["choices"]) == extra.get("n", 1)


def test_completion_with_null_max_tokens_is_served(url):
    r = httpx.post(url + C, json={"prompt": "a", "n": 3, "max_tokens": None, "logprobs": 5,
                                           **STOP_AT_ONCE}, timeout=300)
    assert r.status_code == 200, r.text


def test_an_explicit_max_tokens_is_still_held_to_the_limits(url):
    r = httpx.post(url + CHAT, json={"messages": MSG, "n": 3, "max_tokens": LONG - 100}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens", r.text
    r = httpx.post(url + CHAT, json={"messages": MSG, "logprobs": True, "top_logprobs": 5,
                                     "max_tokens": LONG - 100}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "logprobs", r.text


@given(n=st.integers(1, 64), logprobs=st.none() | st.integers(0, 20), text=st.integers(1, 300),
       limit=st.integers(1 << 20, 64 << 20))
def test_max_tokens_that_fit_is_the_largest_that_fits(n, logprobs, text, limit):
    fit = max_tokens_that_fit(n, logprobs, text, limit)

    def ok(mt: int) -> bool:
        try:  # SamplingParams refuses logprobs over MAX_LOGPROBS_BYTES itself
            sp = SamplingParams(n=n, max_tokens=mt, logprobs=logprobs)
        except ValueError:
            return False
        return answer_bytes_bound(sp, 1, text) <= limit

    if fit > 1:  # 1 is the floor: a request that cannot fit one token is refused, named
        assert ok(fit) and not ok(fit + 1)
