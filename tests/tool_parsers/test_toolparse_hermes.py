"""The hermes parser (Qwen2.5/Qwen3 `<tool_call>`): reference outputs, then the streaming
property (every split, random multi-splits, fuzzed near-misses)."""
from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from toolparse_check import check_every_split, check_split, cuts_for, flat, fuzz_text, stream

from pipeline.tool_parsers.hermes import HermesToolParser

W = '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}'
WA = '{"city": "Paris", "unit": "celsius"}'
REFS = [
    ("The weather in Paris is mild.", "The weather in Paris is mild.", []),
    (f"<tool_call>\n{W}\n</tool_call>", "", [("get_weather", WA)]),
    ('<tool_call>\n{"name": "now", "arguments": {}}\n</tool_call>', "", [("now", "{}")]),
    ('<tool_call>\n{"name": "now"}\n</tool_call>', "", [("now", "{}")]),
    # several calls; the arguments after an empty call are not lost
    (f'<tool_call>\n{{"name": "now", "arguments": {{}}}}\n</tool_call>\n<tool_call>\n{W}\n</tool_call>',
     "", [("now", "{}"), ("get_weather", WA)]),
    (f"Let me check.\n\n<tool_call>\n{W}\n</tool_call>", "Let me check.", [("get_weather", WA)]),
    ('<tool_call>\n{"name": "say", "arguments": {"text": "He said \\"hi\\" \\u00e9 — café ✓ 日本", "n": -1.5e3}}\n'
     '</tool_call>', "", [("say", '{"text": "He said \\"hi\\" \\u00e9 — café ✓ 日本", "n": -1.5e3}')]),
    # no closing tag at the end (Qwen stops after the object)
    (f"Sure. <tool_call>\n{W}", "Sure.", [("get_weather", WA)]),
    # the arguments before the name; arguments as a JSON string; null arguments
    ('<tool_call>{"arguments": {"a": [1, {"b": "}"}]}, "name": "f"}</tool_call>', "",
     [("f", '{"a": [1, {"b": "}"}]}')]),
    ('<tool_call>{"name": "f", "arguments": "{\\"a\\": 1}"}</tool_call>', "", [("f", '{"a": 1}')]),
    ('<tool_call>{"name": "f", "arguments": null}</tool_call>', "", [("f", "{}")]),
    # broken or unclosed calls with no name are content, tags and all
    ("<tool_call>\nnot json\n</tool_call>", "<tool_call>\nnot json\n</tool_call>", []),
    ('I will <tool_call>{"nam', 'I will <tool_call>{"nam', []),
    ('<tool_call>{"arguments": {"a": 1}}</tool_call>', '<tool_call>{"arguments": {"a": 1}}</tool_call>', []),
    ("Use the <tool_call> tag.", "Use the <tool_call> tag.", []),
    ("a <tool_", "a <tool_", []),
    # a call truncated after its name stays a call with the arguments it got (the commit rule)
    ('<tool_call>{"name": "f", "arguments": {"a": "x', "", [("f", '{"a": "x')]),
    # an object left unclosed before the next tag: the arguments end with their object
    ('<tool_call>{"name": "f", "arguments": {"a": 1}\n<tool_call>{"name": "g"}</tool_call>', "",
     [("f", '{"a": 1}'), ("g", "{}")]),
    # a doubled tag: the first is content, the second opens the call
    (f"<tool_call>\n<tool_call>\n{W}\n</tool_call>", "<tool_call>", [("get_weather", WA)]),
    # content between and after calls, as written, trimmed next to the calls
    (f"A.\n<tool_call>{W}</tool_call>\nB.\n", "A.\n\nB.\n", [("get_weather", WA)]),
    (f"<tool_call>{W}</tool_call> trailing", "trailing", [("get_weather", WA)]),
]


@pytest.mark.parametrize("text,content,calls", REFS)
def test_extract_reference_outputs(text, content, calls):
    e = HermesToolParser().extract(text)
    assert flat(e) == (content, calls)
    assert (e.content is None) == (content == "")
    for c in e.calls:
        assert c.id.startswith("call_") and len(c.id) == 29
        if c.arguments.startswith("{") and c.arguments.endswith("}"):
            json.loads(c.arguments)


@pytest.mark.parametrize("text", [r[0] for r in REFS])
def test_every_split_streams_what_extract_returns(text):
    check_every_split(HermesToolParser, text)


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_random_multi_splits(data):
    text = data.draw(st.sampled_from([r[0] for r in REFS]))
    check_split(HermesToolParser, text, data.draw(cuts_for(text)))


@settings(max_examples=150, deadline=None)
@given(fuzz_text, st.data())
def test_any_text_streams_what_extract_returns(text, data):
    check_split(HermesToolParser, text, data.draw(cuts_for(text)))


def test_the_name_comes_first_then_the_arguments_as_they_arrive():
    p = HermesToolParser()
    assert p.feed("Hi <tool_") .content == "Hi"  # the partial tag is held back
    d = p.feed('call>\n{"name": "get_weather", "arg')
    assert d.content == "" and [(t.index, t.name) for t in d.tool_calls] == [(0, "get_weather")]
    d = p.feed('uments": {"city": "Par')
    assert [t.arguments for t in d.tool_calls] == ['{"city": "Par']
    d = p.feed('is"}}\n</tool_call>')
    assert [t.arguments for t in d.tool_calls] == ['is"}']
    assert p.called and p.finish() == type(d)()


def test_extract_leaves_the_streaming_state_alone():
    p = HermesToolParser()
    p.feed("<tool_call>")
    assert p.extract(f"<tool_call>{W}</tool_call>").calls[0].name == "get_weather"
    assert stream(lambda: p, [W])[1] == [("get_weather", WA)]
