"""The reasoning parsers (issue 28): reference outputs of Qwen3 and DeepSeek-R1 split whole
(``extract``), and the same outputs streamed in pieces cut at every position (and at many
positions at once, hypothesis) reassemble to what ``extract`` gives, except the two kinds of
qwen3 output documented in ``pipeline/reasoning/parsers.py``.
"""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline.reasoning.base import THINK_CLOSE, THINK_OPEN, ReasoningParser
from pipeline.reasoning.parsers import REASONING_PARSERS, get_reasoning_parser

Q3 = "qwen3"
R1 = "deepseek_r1"

# output -> {parser: (reasoning, content)} as extract gives them
REFERENCE: list[tuple[str, dict[str, tuple[str | None, str | None]]]] = [
    # Qwen3 thinking (its own <think>), content keeps the template's blank line
    ("<think>\nThe user greets me. Answer briefly.\n</think>\n\nHello! How can I help?",
     {Q3: ("\nThe user greets me. Answer briefly.\n", "\n\nHello! How can I help?"),
      R1: ("\nThe user greets me. Answer briefly.\n", "\n\nHello! How can I help?")}),
    # Qwen3 with enable_thinking false: no tag at all
    ("Hello! How can I help?", {Q3: (None, "Hello! How can I help?"), R1: ("Hello! How can I help?", None)}),
    # DeepSeek-R1: <think> was in the prompt, the output starts inside the reasoning
    ("Okay, 2 + 2 is 4.\n</think>\n\nThe answer is **4**.",
     {Q3: ("Okay, 2 + 2 is 4.\n", "\n\nThe answer is **4**."),
      R1: ("Okay, 2 + 2 is 4.\n", "\n\nThe answer is **4**.")}),
    # cut by max_tokens inside the reasoning
    ("<think>\nLet me count the letters: s, t, r", {Q3: (None, "\nLet me count the letters: s, t, r"),
                                                   R1: ("\nLet me count the letters: s, t, r", None)}),
    ("Let me count the letters: s, t, r", {Q3: (None, "Let me count the letters: s, t, r"),
                                          R1: ("Let me count the letters: s, t, r", None)}),
    # an empty think block (Qwen3 deciding not to think), and one closed at the very end
    ("<think>\n\n</think>\n\n42", {Q3: ("\n\n", "\n\n42"), R1: ("\n\n", "\n\n42")}),
    ("<think></think>42", {Q3: (None, "42"), R1: (None, "42")}),
    ("<think>why</think>", {Q3: ("why", None), R1: ("why", None)}),
    ("</think>", {Q3: (None, None), R1: (None, None)}),
    ("", {Q3: (None, None), R1: (None, None)}),
    # only the first </think> closes; a later one, and tags in the content, are content
    ("<think>a</think>b</think>c<think>d", {Q3: ("a", "b</think>c<think>d"), R1: ("a", "b</think>c<think>d")}),
    # a <think> that does not open the output is text
    ("so <think>x</think>y", {Q3: ("so <think>x", "y"), R1: ("so <think>x", "y")}),
    (" <think>x", {Q3: (None, " <think>x"), R1: (" <think>x", None)}),
    # near-tags are text
    ("<thinking>x</thinks>y", {Q3: (None, "<thinking>x</thinks>y"), R1: ("<thinking>x</thinks>y", None)}),
    ("<think", {Q3: (None, "<think"), R1: ("<think", None)}),
    ("<think>x</think", {Q3: (None, "x</think"), R1: ("x</think", None)}),
    ("<think><<</</t</think>>", {Q3: ("<<</</t", ">"), R1: ("<<</</t", ">")}),
    # a tool call after the reasoning is content (the tool parser's part)
    ('<think>\nCall the weather tool.\n</think>\n\n<tool_call>\n{"name": "get_weather", '
     '"arguments": {"city": "Paris"}}\n</tool_call>',
     {p: ("\nCall the weather tool.\n", '\n\n<tool_call>\n{"name": "get_weather", '
          '"arguments": {"city": "Paris"}}\n</tool_call>') for p in (Q3, R1)}),
    ("<think>\n思考：二加二。\n</think>\n\n答案是四。",
     {p: ("\n思考：二加二。\n", "\n\n答案是四。") for p in (Q3, R1)}),
]


def stream(name: str, pieces: list[str]) -> tuple[str | None, str | None]:
    """Feed ``pieces`` one by one, then finish: the reassembled (reasoning, content)."""
    parser = get_reasoning_parser(name)()
    reasoning = content = ""
    for piece in pieces:
        r, c = parser.feed(piece)
        reasoning, content = reasoning + r, content + c
    r, c = parser.finish()
    return (reasoning + r) or None, (content + c) or None


def streamed_reference(name: str, text: str) -> tuple[str | None, str | None]:
    """What the stream gives: extract's answer, but for the two qwen3 cases where streaming
    decides on the first characters (parsers.py)."""
    whole = get_reasoning_parser(name)().extract(text)
    if name == Q3:
        opened = text.startswith(THINK_OPEN)
        if opened and THINK_CLOSE not in text:  # cut inside the reasoning
            return whole[1], None
        if not opened and THINK_CLOSE in text:  # opened in the prompt: qwen3 cannot know
            return None, text
    return whole


CASES = [(name, text, want[name]) for text, want in REFERENCE for name in (Q3, R1)]


@pytest.mark.parametrize("name,text,want", CASES)
def test_extract_reference_outputs(name, text, want):
    assert get_reasoning_parser(name)().extract(text) == want


@pytest.mark.parametrize("name,text,want", CASES)
def test_stream_split_at_every_position_reassembles(name, text, want):
    expected = streamed_reference(name, text)
    assert stream(name, [text]) == expected
    assert stream(name, list(text)) == expected  # one character at a time
    for i in range(len(text) + 1):
        assert stream(name, [text[:i], text[i:]]) == expected, i
    for i in range(len(text) + 1):  # and around an empty delta
        assert stream(name, [text[:i], "", text[i:], ""]) == expected, i


def test_streamed_and_whole_differ_only_where_documented():
    assert stream(Q3, ["<think>", "cut short"]) == ("cut short", None)
    assert get_reasoning_parser(Q3)().extract("<think>cut short") == (None, "cut short")
    assert stream(Q3, ["prompt-opened", "</think>", "answer"]) == (None, "prompt-opened</think>answer")
    assert get_reasoning_parser(Q3)().extract("prompt-opened</think>answer") == ("prompt-opened", "answer")
    # deepseek_r1 agrees with itself on both
    for text in ("<think>cut short", "prompt-opened</think>answer"):
        assert stream(R1, list(text)) == get_reasoning_parser(R1)().extract(text)


# texts dense in tags and tag fragments, so cuts land inside tags
FRAGMENTS = st.sampled_from([THINK_OPEN, THINK_CLOSE, "<", "</", "<th", "</thi", "ink>", ">", "k",
                             "\n", " ", "a", "思", "<think", "</think"])
TEXTS = st.lists(FRAGMENTS, max_size=12).map("".join) | st.sampled_from([t for t, _ in REFERENCE])


@settings(max_examples=300, deadline=None)
@given(text=TEXTS, cuts=st.lists(st.integers(min_value=0, max_value=200), max_size=8),
       name=st.sampled_from(sorted(REASONING_PARSERS)))
def test_stream_cut_anywhere_reassembles(text, cuts, name):
    bounds = sorted({min(c, len(text)) for c in cuts})
    pieces = [text[a:b] for a, b in zip([0, *bounds], [*bounds, len(text)])]
    assert "".join(pieces) == text
    assert stream(name, pieces) == streamed_reference(name, text)


@settings(max_examples=200, deadline=None)
@given(text=TEXTS, name=st.sampled_from(sorted(REASONING_PARSERS)))
def test_the_stream_holds_back_no_more_than_a_partial_tag(text, name):
    """After each delta, what has not come out yet is at most a tag's beginning: the tags
    dropped aside, the stream lags the input by under len("</think>") characters."""
    parser = get_reasoning_parser(name)()
    seen = out = 0
    for ch in text:
        r, c = parser.feed(ch)
        seen, out = seen + 1, out + len(r) + len(c)
        tags = len(text[:seen]) - len(text[:seen].replace(THINK_OPEN, "", 1).replace(THINK_CLOSE, "", 1))
        assert seen - out - tags < len(THINK_CLOSE)


def test_in_reasoning_follows_the_stream():
    q = get_reasoning_parser(Q3)()
    assert q.feed("<th") == ("", "") and q.in_reasoning  # undecided, nothing given out
    assert q.feed("ink>plan</th") == ("plan", "") and q.in_reasoning
    assert q.feed("ink>\n\nok") == ("", "\n\nok") and not q.in_reasoning
    assert q.feed("</think>") == ("", "</think>") and q.finish() == ("", "")

    q = get_reasoning_parser(Q3)()
    assert q.feed("Hi") == ("", "Hi") and not q.in_reasoning  # no <think>: content at once

    r1 = get_reasoning_parser(R1)()
    assert r1.feed("Hmm") == ("Hmm", "") and r1.in_reasoning
    assert r1.feed("</") == ("", "") and r1.in_reasoning
    assert r1.feed("think>A") == ("", "A") and not r1.in_reasoning

    r1 = get_reasoning_parser(R1)()
    assert r1.feed("x</thi") == ("x", "")
    assert r1.finish() == ("</thi", "")  # the tag never completed: reasoning text


def test_each_answer_has_its_own_state():
    a, b = get_reasoning_parser(R1)(), get_reasoning_parser(R1)()
    assert a.feed("r</think>") == ("r", "")
    assert b.feed("still thinking") == ("still thinking", "")
    assert a.feed("c") == ("", "c") and b.in_reasoning


def test_lookup_by_name():
    assert sorted(REASONING_PARSERS) == ["deepseek_r1", "qwen3"]
    for name, cls in REASONING_PARSERS.items():
        assert get_reasoning_parser(name) is cls and cls.name == name
        assert issubclass(cls, ReasoningParser)
    with pytest.raises(ValueError, match="deepseek_r1, qwen3") as e:
        get_reasoning_parser("qwen")
    assert "'qwen'" in str(e.value)
