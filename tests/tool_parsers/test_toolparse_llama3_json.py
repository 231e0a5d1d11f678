"""The llama3_json parser (`<|python_tag|>{"name": ..., "parameters": ...}; ...`): reference
outputs, then the streaming property."""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from toolparse_check import check_every_split, check_split, cuts_for, flat, fuzz_text

from pipeline.tool_parsers.llama3_json import Llama3JsonToolParser

W = '{"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}}'
WA = '{"city": "Paris", "unit": "celsius"}'
REFS = [
    ("The weather in Paris is mild.", "The weather in Paris is mild.", []),
    (W, "", [("get_weather", WA)]),
    (f"<|python_tag|>{W}", "", [("get_weather", WA)]),
    ('{"name": "now", "parameters": {}}', "", [("now", "{}")]),
    ('<|python_tag|>{"name": "now"}', "", [("now", "{}")]),
    ('{"name": "f", "arguments": {"x": 1}}', "", [("f", '{"x": 1}')]),  # the other key
    (f'{{"name": "now", "parameters": {{}}}}; {W};{{"name": "g"}}', "",
     [("now", "{}"), ("get_weather", WA), ("g", "{}")]),
    (f"\n  {W}\n", "", [("get_weather", WA)]),
    ('{"name": "say", "parameters": {"text": "\\"quoted\\" é ✓ 日本 \\\\ }", "n": [1, 2.5e-3]}}', "",
     [("say", '{"text": "\\"quoted\\" é ✓ 日本 \\\\ }", "n": [1, 2.5e-3]}')]),
    # not starting with `{` after the tag and whitespace: content, all of it
    ("Sure, " + W, "Sure, " + W, []),
    ("<|python_tag|>print(1)", "<|python_tag|>print(1)", []),
    ('{"a": 1}', '{"a": 1}', []),
    ('{"nam', '{"nam', []),
    ("<|python", "<|python", []),
    # after the calls, what is no call is content
    (f"{W} thanks", "thanks", [("get_weather", WA)]),
    (f"{W}; oops", "; oops", [("get_weather", WA)]),
    ('{"name": "f", "parameters": {"a": [1, 2', "", [("f", '{"a": [1, 2')]),
]


@pytest.mark.parametrize("text,content,calls", REFS)
def test_extract_reference_outputs(text, content, calls):
    assert flat(Llama3JsonToolParser().extract(text)) == (content, calls)


@pytest.mark.parametrize("text", [r[0] for r in REFS])
def test_every_split_streams_what_extract_returns(text):
    check_every_split(Llama3JsonToolParser, text)


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_random_multi_splits(data):
    text = data.draw(st.sampled_from([r[0] for r in REFS]))
    check_split(Llama3JsonToolParser, text, data.draw(cuts_for(text)))


@settings(max_examples=150, deadline=None)
@given(fuzz_text, st.data())
def test_any_text_streams_what_extract_returns(text, data):
    check_split(Llama3JsonToolParser, text, data.draw(cuts_for(text)))


def test_the_tag_split_anywhere_is_never_content():
    p = Llama3JsonToolParser()
    assert p.feed("<|pyth").content == ""
    d = p.feed('on_tag|>{"name": "f", ')
    assert d.content == "" and d.tool_calls[0].name == "f"
