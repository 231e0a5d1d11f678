"""Structured outputs over the OpenAI API (`pipeline serve --http`), driven by the `openai`
SDK: `response_format` (`json_object`, `json_schema`), vLLM's `structured_outputs` extra and
its older `guided_*` extras, on chat and text completions, streamed and not; and the 400s
(a spec xgrammar refuses, an unknown `response_format` type, two specs at once, a spec over
its byte limit), each naming the field.

Owns one daemon on the embedded default model: it babbles, so only the grammar can make its
output valid. Greedy outputs must end with `finish_reason` `stop` (the grammar closed) well
within `max_tokens`.
"""
from __future__ import annotations

import json
import re
import signal
from pathlib import Path
from typing import Any

import jsonschema
import openai
import pytest
from e2e_helpers import Daemon, shm_entries

from pipeline.config import DEFAULT_MODEL
from pipeline.sampling_params.structured import MAX_STRUCTURED_BYTES

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 20},
    "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "tags": {"type": "array", "items": {"enum": ["red", "green"]}, "maxItems": 2}},
    "required": ["name", "age", "tags"], "additionalProperties": False}
REGEX = r"[a-z]{3,8}@[a-z]{2,6}\.(com|org)"
CHOICES = ["yes", "no", "it depends"]
GRAMMAR = 'root ::= "(" [1-9] [0-9]? ("+" | "-") [1-9] ")"'
CHAT = [{"role": "user", "content": "Describe a person."}]
GREEDY: dict[str, Any] = {"model": "default", "temperature": 0, "max_tokens": 200}


@pytest.fixture(scope="module")
def oai():
    d = Daemon(Path(DEFAULT_MODEL), http=True)
    try:
        d.wait_ready()
        # No retries: a 5xx must show, not be retried away by the SDK.
        with openai.OpenAI(base_url=f"{d.http_url}/v1", api_key="unused", max_retries=0, timeout=120) as c:
            yield c
    finally:
        code = d.stop(signal.SIGTERM)
    assert code == 0
    assert shm_entries(d.instance_id) == []


def test_json_schema_chat_validates_streamed_or_not(oai):
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA, "strict": True}}
    r = oai.chat.completions.create(messages=CHAT, response_format=fmt, **GREEDY)  # type: ignore[arg-type]
    c = r.choices[0]
    assert c.finish_reason == "stop", c
    assert c.message.content is not None
    jsonschema.validate(json.loads(c.message.content), SCHEMA)
    # The stream carries the same constraint (greedy: the same text, delta by delta).
    chunks = list(oai.chat.completions.create(messages=CHAT, response_format=fmt, stream=True,  # type: ignore[arg-type]
                                              **GREEDY))
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == c.message.content
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_json_object_completion_and_chat_are_objects(oai):
    r = oai.completions.create(prompt="Return JSON.", extra_body={"response_format": {"type": "json_object"}},
                               **GREEDY)
    assert r.choices[0].finish_reason == "stop", r.choices[0]
    assert isinstance(json.loads(r.choices[0].text), dict)
    chat = oai.chat.completions.create(messages=CHAT, response_format={"type": "json_object"}, **GREEDY)
    assert chat.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(chat.choices[0].message.content or ""), dict)
    # {"type": "text"} constrains nothing: the model's own babble.
    free = oai.completions.create(prompt="Return JSON.", extra_body={"response_format": {"type": "text"}},
                                  **GREEDY | {"max_tokens": 24})
    assert free.choices[0].text != r.choices[0].text


def test_choice_regex_and_grammar_extras(oai):
    r = oai.completions.create(prompt="Answer:", extra_body={"structured_outputs": {"choice": CHOICES}}, **GREEDY)
    assert r.choices[0].finish_reason == "stop" and r.choices[0].text in CHOICES
    # Sampled, n per prompt: every completion is a choice (the older guided_choice spelling).
    many = oai.completions.create(prompt="Answer:", n=4, temperature=1.0, seed=3, max_tokens=200,
                                  model="default", extra_body={"guided_choice": CHOICES})
    assert [c.finish_reason for c in many.choices] == ["stop"] * 4
    assert all(c.text in CHOICES for c in many.choices)
    chat = oai.chat.completions.create(messages=CHAT, extra_body={"structured_outputs": {"regex": REGEX}}, **GREEDY)
    text = chat.choices[0].message.content or ""
    assert chat.choices[0].finish_reason == "stop" and re.fullmatch(REGEX, text), text
    old = oai.chat.completions.create(messages=CHAT, extra_body={"guided_regex": REGEX}, **GREEDY)
    assert old.choices[0].message.content == text
    g = oai.completions.create(prompt="Compute:", extra_body={"structured_outputs": {"grammar": GRAMMAR}},
                               **GREEDY)
    assert g.choices[0].finish_reason == "stop"
    assert re.fullmatch(r"\([1-9][0-9]?[-+][1-9]\)", g.choices[0].text), g.choices[0].text


def refused(oai: openai.OpenAI, stream: bool = False, **kw: Any) -> dict[str, Any]:
    with pytest.raises(openai.BadRequestError) as exc:
        r = oai.chat.completions.create(messages=CHAT, model="default", max_tokens=8, stream=stream, **kw)
        list(r) if stream else None  # type: ignore[call-overload]
    assert exc.value.status_code == 400
    body = exc.value.body
    assert isinstance(body, dict) and body["type"] == "invalid_request_error", body
    return body


def test_bad_specs_are_400s_naming_the_field(oai):
    bad_type = {"type": "bogus"}
    e = refused(oai, extra_body={"structured_outputs": {"json": bad_type}})
    assert e["param"] == "structured_outputs.json" and "bogus" in e["message"], e
    # The schema xgrammar refuses (the tokenizer stage's verdict), given as response_format.
    e = refused(oai, response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": bad_type}})
    assert e["param"] == "structured_outputs.json" and "not a valid JSON schema" in e["message"], e
    e = refused(oai, stream=True, extra_body={"structured_outputs": {"regex": "[a-"}})  # before any chunk
    assert e["param"] == "structured_outputs.regex" and "not a valid regex" in e["message"], e
    e = refused(oai, response_format={"type": "json_schema", "json_schema": {"name": "x"}})
    assert e["param"] == "response_format.json_schema.schema" and "missing" in e["message"], e
    e = refused(oai, response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": "{}"}})
    assert e["param"] == "response_format.json_schema.schema", e
    e = refused(oai, response_format={"type": "xml"})
    assert e["param"] == "response_format.type" and "json_schema" in e["message"], e
    e = refused(oai, response_format={"type": "json_object"}, extra_body={"structured_outputs": {"choice": ["a"]}})
    assert "`response_format`" in e["message"] and "`structured_outputs`" in e["message"], e
    e = refused(oai, extra_body={"guided_regex": "a", "guided_choice": ["a"]})
    assert "`guided_regex`" in e["message"] and "`guided_choice`" in e["message"], e
    e = refused(oai, extra_body={"structured_outputs": {"regex": "a", "choice": ["a"]}})
    assert e["param"] == "structured_outputs" and "exactly one" in e["message"], e
    big = {"type": "object", "description": "x" * MAX_STRUCTURED_BYTES}
    e = refused(oai, response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": big}})
    assert e["param"] == "response_format.json_schema.schema" and str(MAX_STRUCTURED_BYTES) in e["message"], e
    e = refused(oai, extra_body={"structured_outputs": {"choice": []}})
    assert e["param"] == "structured_outputs.choice", e
    # Nothing of that reached the engine: the instance serves on.
    ok = oai.completions.create(prompt="Answer:", extra_body={"structured_outputs": {"choice": CHOICES}}, **GREEDY)
    assert ok.choices[0].text in CHOICES
