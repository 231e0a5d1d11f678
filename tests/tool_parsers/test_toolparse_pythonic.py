"""The pythonic parser (`[f(a=1), g()]`): reference outputs, then the streaming property."""
from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from toolparse_check import check_every_split, check_split, cuts_for, flat, fuzz_text

from pipeline.tool_parsers.pythonic import PythonicToolParser

REFS = [
    ("The weather in Paris is mild.", "The weather in Paris is mild.", []),
    ('[get_weather(city="Paris", unit="celsius")]', "", [("get_weather", '{"city": "Paris", "unit": "celsius"}')]),
    ("[now()]", "", [("now", "{}")]),
    ('[now(), get_weather(city="Oslo")]', "", [("now", "{}"), ("get_weather", '{"city": "Oslo"}')]),
    ("[f(a=1, b=-2.5, c=True, d=None, e=[1, 'x'], g={'k': {'n': false}}, h=null, i=true)]", "",
     [("f", '{"a": 1, "b": -2.5, "c": true, "d": null, "e": [1, "x"], "g": {"k": {"n": false}}, '
            '"h": null, "i": true}')]),
    ("""[say(text='He said "hi" ) é ✓ 日本', t='''a'b)''', u="\\"q\\"")]""", "",
     [("say", json.dumps({"text": 'He said "hi" ) é ✓ 日本', "t": "a'b)", "u": '"q"'}, ensure_ascii=False))]),
    ("  [f(x=1),\n g(y='')] ", "", [("f", '{"x": 1}'), ("g", '{"y": ""}')]),
    ("[f(x=1), ]", "", [("f", '{"x": 1}')]),
    # not a list of calls: content
    ("[Note] read this", "[Note] read this", []),
    ("[1, 2, 3]", "[1, 2, 3]", []),
    ("[]", "[]", []),
    ("[f(1)]", "[f(1)]", []),  # positional arguments
    ("[f(x=y)]", "[f(x=y)]", []),  # no literal
    ("[f(x=1", "[f(x=1", []),
    ("Sure: [f()]", "Sure: [f()]", []),
    # the calls before a part that is no call stay calls
    ("[f(x=1), oops]", ", oops]", [("f", '{"x": 1}')]),
    ("[f()] then text", "then text", [("f", "{}")]),
]


@pytest.mark.parametrize("text,content,calls", REFS)
def test_extract_reference_outputs(text, content, calls):
    assert flat(PythonicToolParser().extract(text)) == (content, calls)


@pytest.mark.parametrize("text", [r[0] for r in REFS])
def test_every_split_streams_what_extract_returns(text):
    check_every_split(PythonicToolParser, text)


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_random_multi_splits(data):
    text = data.draw(st.sampled_from([r[0] for r in REFS]))
    check_split(PythonicToolParser, text, data.draw(cuts_for(text)))


@settings(max_examples=150, deadline=None)
@given(fuzz_text, st.data())
def test_any_text_streams_what_extract_returns(text, data):
    check_split(PythonicToolParser, text, data.draw(cuts_for(text)))


def test_a_triple_quote_split_across_deltas():
    # `''` then `'x''')]`: the scan must not take the first two quotes for an empty string
    p = PythonicToolParser()
    d = [p.feed("[f(a=''"), p.feed("'x)'''"), p.feed(")]"), p.finish()]
    calls = [t for x in d for t in x.tool_calls]
    assert [(t.name, t.arguments) for t in calls] == [("f", '{"a": "x)"}')]
