"""Generated calls (random names, arguments with any JSON: unicode, escapes, nesting) rendered
in each format: ``extract`` returns them (arguments as written), and any split of the text
streams the same."""
from __future__ import annotations

import json
import keyword

from hypothesis import given, settings
from hypothesis import strategies as st
from toolparse_check import check_split, cuts_for, flat

from pipeline.tool_parsers.choice import RequiredParser
from pipeline.tool_parsers.hermes import HermesToolParser
from pipeline.tool_parsers.llama3_json import Llama3JsonToolParser
from pipeline.tool_parsers.mistral import MistralToolParser
from pipeline.tool_parsers.pythonic import PythonicToolParser

IDENT = st.from_regex(r"[A-Za-z_][A-Za-z0-9_]{0,8}", fullmatch=True).filter(lambda s: not keyword.iskeyword(s))
SCALAR = st.none() | st.booleans() | st.integers(-10**6, 10**6) | st.floats(allow_nan=False, allow_infinity=False) \
    | st.text(max_size=8)
VALUE = st.recursive(SCALAR, lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=5), c, max_size=3),
                     max_leaves=6)
ARGS = st.dictionaries(IDENT, VALUE, max_size=3)
CALLS = st.lists(st.tuples(IDENT, ARGS, st.booleans()), min_size=1, max_size=3)
PREFIX = st.text(st.sampled_from("ab <[_\n"), max_size=8)


def dumps(args: dict, ascii_: bool) -> str:
    return json.dumps(args, ensure_ascii=ascii_)


def expected_content(prefix: str) -> str:
    return prefix.rstrip() if prefix.strip() else ""


@settings(max_examples=60, deadline=None)
@given(PREFIX, CALLS, st.data())
def test_hermes(prefix, calls, data):
    text = prefix + "".join(f'<tool_call>\n{{"name": "{n}", "arguments": {dumps(a, e)}}}\n</tool_call>\n'
                            for n, a, e in calls)
    want = (expected_content(prefix), [(n, dumps(a, e)) for n, a, e in calls])
    assert flat(HermesToolParser().extract(text)) == want
    check_split(HermesToolParser, text, data.draw(cuts_for(text)))


@settings(max_examples=60, deadline=None)
@given(CALLS, st.booleans(), st.data())
def test_llama3_json(calls, tag, data):
    text = ("<|python_tag|>" if tag else "") + "; ".join(
        f'{{"name": "{n}", "parameters": {dumps(a, e)}}}' for n, a, e in calls)
    assert flat(Llama3JsonToolParser().extract(text)) == ("", [(n, dumps(a, e)) for n, a, e in calls])
    check_split(Llama3JsonToolParser, text, data.draw(cuts_for(text)))


@settings(max_examples=60, deadline=None)
@given(PREFIX, CALLS, st.booleans(), st.data())
def test_mistral(prefix, calls, v11, data):
    if v11:
        text = prefix + "".join(f"[TOOL_CALLS]{n}[ARGS]{dumps(a, e)}" for n, a, e in calls)
    else:
        text = prefix + "[TOOL_CALLS][" + ", ".join(
            f'{{"name": "{n}", "arguments": {dumps(a, e)}}}' for n, a, e in calls) + "]"
    want = (expected_content(prefix), [(n, dumps(a, e)) for n, a, e in calls])
    assert flat(MistralToolParser().extract(text)) == want
    check_split(MistralToolParser, text, data.draw(cuts_for(text)), r"[A-Za-z0-9]{9}")


@settings(max_examples=60, deadline=None)
@given(CALLS, st.data())
def test_pythonic(calls, data):
    text = "[" + ", ".join(f"{n}(" + ", ".join(f"{k}={v!r}" for k, v in a.items()) + ")" for n, a, _ in calls) + "]"
    want = ("", [(n, json.dumps(a, ensure_ascii=False)) for n, a, _ in calls])
    assert flat(PythonicToolParser().extract(text)) == want
    check_split(PythonicToolParser, text, data.draw(cuts_for(text)))


@settings(max_examples=60, deadline=None)
@given(CALLS, st.data())
def test_required(calls, data):
    text = json.dumps([{"name": n, "parameters": a} for n, a, _ in calls])
    assert flat(RequiredParser().extract(text)) == ("", [(n, json.dumps(a)) for n, a, _ in calls])
    check_split(RequiredParser, text, data.draw(cuts_for(text)))
