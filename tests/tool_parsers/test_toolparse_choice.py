"""tool_choice's parsers and schemas: ``required`` (a JSON array of calls) and a named
function (the output is its arguments); the registry of ``--tool-call-parser`` names."""
from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from toolparse_check import assemble, check_every_split, check_split, cuts_for, flat, fuzz_text

from pipeline.tool_parsers import TOOL_PARSERS, get_tool_parser
from pipeline.tool_parsers.choice import NamedParser, RequiredParser, named_schema, required_schema

try:
    import jsonschema
except ImportError:  # the schemas are then checked by shape only
    jsonschema = None

WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "now"}}]

REQUIRED_REFS = [
    ('[{"name": "get_weather", "parameters": {"city": "Paris"}}]', "", [("get_weather", '{"city": "Paris"}')]),
    ('[{"name": "now", "parameters": {}}, {"name": "get_weather", "parameters": {"city": "é \\"q\\""}}]', "",
     [("now", "{}"), ("get_weather", '{"city": "é \\"q\\""}')]),
    ('[{"name":"now","parameters":{}},{"name":"now","parameters":{}}]', "", [("now", "{}"), ("now", "{}")]),
    ('[{"name": "now"}]', "", [("now", "{}")]),
    ("no array", "no array", []),
    ('[{"name": "get_weather", "parameters": {"ci', "", [("get_weather", '{"ci')]),
]


@pytest.mark.parametrize("text,content,calls", REQUIRED_REFS)
def test_required_reference_outputs(text, content, calls):
    assert flat(RequiredParser(TOOLS).extract(text)) == (content, calls)
    check_every_split(lambda: RequiredParser(TOOLS), text)


@settings(max_examples=100, deadline=None)
@given(fuzz_text, st.data())
def test_required_any_text_streams_what_extract_returns(text, data):
    check_split(RequiredParser, text, data.draw(cuts_for(text)))


@pytest.mark.parametrize("text,args", [
    ('{"city": "Paris"}', '{"city": "Paris"}'),
    ('{"city": "é ✓ \\"x\\" }"}', '{"city": "é ✓ \\"x\\" }"}'),
    ("{}", "{}"),
    ("", "{}"),
    ("  ", "{}"),
])
def test_named_parser_sends_one_call_with_the_whole_output(text, args):
    e = NamedParser(TOOLS, "get_weather").extract(text)
    assert flat(e) == ("", [("get_weather", args)])
    check_every_split(lambda: NamedParser(TOOLS, "get_weather"), text)


def test_named_parser_sends_the_name_on_the_first_delta():
    p = NamedParser(TOOLS, "now")
    d = p.feed("")
    assert [(t.index, t.name) for t in d.tool_calls] == [(0, "now")] and d.tool_calls[0].id
    assert p.called
    assert assemble([d, p.feed("{"), p.feed("}"), p.finish()]) == ("", [("now", "{}")])


def test_required_schema_forces_the_array_of_calls():
    schema = required_schema(TOOLS)
    assert schema["type"] == "array" and schema["minItems"] == 1 and "maxItems" not in schema
    items = schema["items"]["anyOf"]
    assert [i["properties"]["name"]["const"] for i in items] == ["get_weather", "now"]
    assert items[0]["properties"]["parameters"] == WEATHER
    assert items[1]["properties"]["parameters"] == {"type": "object"}
    assert required_schema(TOOLS, parallel=False)["maxItems"] == 1
    if jsonschema is None:
        pytest.skip("jsonschema is not installed")
    jsonschema.Draft202012Validator.check_schema(schema)
    ok = json.loads(REQUIRED_REFS[1][0])
    jsonschema.validate(ok, schema)
    for bad in ([], [{"name": "get_weather", "parameters": {}}], [{"name": "other", "parameters": {}}],
                [{"name": "now"}]):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)


def test_named_schema_is_the_parameters_schema():
    assert named_schema(TOOLS, "get_weather") == WEATHER
    assert named_schema(TOOLS, "now") == {"type": "object"}
    with pytest.raises(ValueError, match="field `tool_choice`: no function named nope in `tools`"):
        named_schema(TOOLS, "nope")
    if jsonschema is not None:
        jsonschema.validate({"city": "Paris"}, named_schema(TOOLS, "get_weather"))


def test_the_registry():
    assert set(TOOL_PARSERS) == {"hermes", "llama3_json", "mistral", "pythonic"}
    assert all(get_tool_parser(n).name == n for n in TOOL_PARSERS)
    with pytest.raises(ValueError, match="hermes, llama3_json, mistral, pythonic"):
        get_tool_parser("qwen")
