"""The mistral parser (`[TOOL_CALLS]` then a JSON array, or `name[ARGS]{...}` per call):
reference outputs, then the streaming property."""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from toolparse_check import check_every_split, check_split, cuts_for, flat, fuzz_text

from pipeline.tool_parsers.mistral import MistralToolParser

ID = r"[A-Za-z0-9]{9}"
W = '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}'
WA = '{"city": "Paris", "unit": "celsius"}'
REFS = [
    ("The weather in Paris is mild.", "The weather in Paris is mild.", []),
    (f"[TOOL_CALLS] [{W}]", "", [("get_weather", WA)]),
    ('[TOOL_CALLS][{"name": "now", "arguments": {}}]', "", [("now", "{}")]),
    ('[TOOL_CALLS][{"name": "now"}]', "", [("now", "{}")]),
    (f'[TOOL_CALLS][{{"name": "now", "arguments": {{}}}}, {W}]', "", [("now", "{}"), ("get_weather", WA)]),
    (f"Checking.[TOOL_CALLS][{W}]", "Checking.", [("get_weather", WA)]),
    ('[TOOL_CALLS][{"name": "say", "arguments": {"t": "a \\"b\\" ]} é ✓"}}]', "",
     [("say", '{"t": "a \\"b\\" ]} é ✓"}')]),
    # the v11+ form
    (f"[TOOL_CALLS]get_weather[ARGS]{WA}", "", [("get_weather", WA)]),
    (f"Checking.[TOOL_CALLS]now[ARGS]{{}}[TOOL_CALLS]get_weather[ARGS]{WA}", "Checking.",
     [("now", "{}"), ("get_weather", WA)]),
    ('[TOOL_CALLS]say[ARGS]{"t": "x}\\"y", "n": {"m": []}}', "", [("say", '{"t": "x}\\"y", "n": {"m": []}}')]),
    (f"[TOOL_CALLS]get_weather{WA}", "", [("get_weather", WA)]),  # no [ARGS]
    # broken: content
    ("[TOOL_CALLS]", "[TOOL_CALLS]", []),
    ("[TOOL_CALLS] nope", "[TOOL_CALLS] nope", []),
    ('[TOOL_CALLS][{"nam', '[TOOL_CALLS][{"nam', []),
    ('x [TOOL_CALLS][{"arguments": {}}]', 'x [TOOL_CALLS][{"arguments": {}}]', []),
    ("[TOOL_CALLS]get_weather", "[TOOL_CALLS]get_weather", []),
    ("a [TOOL", "a [TOOL", []),
    # truncated after the name: a call; text after the calls: content
    ('[TOOL_CALLS]f[ARGS]{"a": "b', "", [("f", '{"a": "b')]),
    (f"[TOOL_CALLS][{W}] Done.", "Done.", [("get_weather", WA)]),
]


@pytest.mark.parametrize("text,content,calls", REFS)
def test_extract_reference_outputs(text, content, calls):
    e = MistralToolParser().extract(text)
    assert flat(e) == (content, calls)
    assert all(len(c.id) == 9 and c.id.isalnum() for c in e.calls)


@pytest.mark.parametrize("text", [r[0] for r in REFS])
def test_every_split_streams_what_extract_returns(text):
    check_every_split(MistralToolParser, text, ID)


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_random_multi_splits(data):
    text = data.draw(st.sampled_from([r[0] for r in REFS]))
    check_split(MistralToolParser, text, data.draw(cuts_for(text)), ID)


@settings(max_examples=150, deadline=None)
@given(fuzz_text, st.data())
def test_any_text_streams_what_extract_returns(text, data):
    check_split(MistralToolParser, text, data.draw(cuts_for(text)), ID)
