"""``http.body.check_json``: any JSON value msgpack and UTF-8 carry passes; one value they
cannot carry, put anywhere, is refused naming its path (hypothesis)."""
from __future__ import annotations

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pipeline.http.body import check_json, decode
from pipeline.http.openai_api import CompletionRequest
from pipeline.http.openai_convert import ApiError

keys = st.text(st.characters(exclude_categories=("Cs",)), max_size=4)
scalars = (st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.floats(allow_nan=False)
           | st.text(st.characters(exclude_categories=("Cs",)), max_size=8))
values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(keys, inner, max_size=4),
                      max_leaves=20)
bad = st.sampled_from(["\ud800", "a\udfff", 2**64, -(2**63) - 1, 10**30])


def where(path: list) -> str:
    return "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in path).lstrip(".")


@given(values)
def test_what_the_wire_carries_passes(v):
    check_json({"x": v})


@given(values, bad, st.data())
def test_one_bad_value_anywhere_is_named(v, b, data):
    root = {"x": v}
    node, path = root, ["x"]
    while isinstance(child := node[path[-1]], (list, dict)) and child:  # down to a random leaf
        k = data.draw(st.sampled_from(list(child.keys()) if isinstance(child, dict) else range(len(child))))
        node, path = child, [*path, k]
    node[path[-1]] = b
    with pytest.raises(ApiError) as e:
        check_json(root)
    assert e.value.status == 400 and e.value.param == where(path)  # (keys may hold dots: same spelling)


def test_decode_names_the_field_and_refuses_non_objects():
    with pytest.raises(ApiError) as e:
        decode(json.dumps({"prompt": "\ud800"}).encode(), CompletionRequest)
    assert e.value.param == "prompt"
    with pytest.raises(ApiError, match="JSON object"):
        decode(b"[1]", CompletionRequest)
    with pytest.raises(ApiError, match="not valid JSON"):
        decode(b"\xff", CompletionRequest)
