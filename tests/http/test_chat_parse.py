"""Issue 28: a chat body's tools and tool_choice (``chat_parse``), the reasoning parser
before the tool parser, the flags that pick them, and the chat template that renders tools."""
from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline.chat_parse import ChatParseError, ChatParsers, ChatParsing
from pipeline.config import EngineConfig
from pipeline.config_checks import REASONING_PARSERS, TOOL_CALL_PARSERS
from pipeline.http.openai_api import ChatCompletionRequest
from pipeline.http.openai_convert import ApiError, chat_fields, chat_parsing
from pipeline.reasoning import REASONING_PARSERS as REASONING_REGISTRY
from pipeline.tokenizer.tokenizer import Tokenizer, check_chat_options
from pipeline.tool_parsers import TOOL_PARSERS

TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}},
    {"type": "function", "function": {"name": "get_time"}}]
SERVER = ChatParsers("hermes", True, "qwen3")
ANSWER = ('<think>\nweather: call the tool</think>\n\nLet me check. <tool_call>\n{"name": "get_weather", '
          '"arguments": {"city": "Paris \\"center\\""}}\n</tool_call>\n<tool_call>\n{"name": "get_time"}\n</tool_call>')


def test_the_flags_name_the_registered_parsers():
    assert set(TOOL_CALL_PARSERS) == set(TOOL_PARSERS)
    assert set(REASONING_PARSERS) == set(REASONING_REGISTRY)
    with pytest.raises(ValueError, match="--enable-auto-tool-choice needs --tool-call-parser"):
        EngineConfig.of(enable_auto_tool_choice=True).check()
    with pytest.raises(ValueError, match="--tool-call-parser must be one of"):
        EngineConfig.of(tool_call_parser="nope").check()


@pytest.mark.parametrize("tools,choice,server,field", [
    (None, "required", SERVER, "tool_choice"),  # a choice without tools
    (TOOLS, "auto", ChatParsers(), "tool_choice"),  # auto without the server's parser
    (TOOLS, None, ChatParsers("hermes", False), "tool_choice"),  # the default is auto
    (TOOLS, {"type": "function", "function": {"name": "nope"}}, SERVER, "tool_choice"),
])
def test_choices_the_server_cannot_honour(tools, choice, server, field):
    with pytest.raises(ChatParseError) as err:
        ChatParsing(tools, choice, None, server)
    assert err.value.field == field and "tool_choice" in str(err.value)


def test_forced_choices_become_the_grammar():
    req = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "hi"}],
                                                "tools": TOOLS, "tool_choice": "required",
                                                "parallel_tool_calls": False})
    fields = chat_fields(req, 256, None, chat_parsing(req, ChatParsers()))
    schema = fields["structured_outputs"]["json"]
    assert schema["type"] == "array" and schema["maxItems"] == 1
    assert fields["tools"] == TOOLS
    named = ChatCompletionRequest.model_validate(
        req.model_dump(exclude_none=True) | {"tool_choice": {"type": "function", "function": {"name": "get_weather"}}})
    fields = chat_fields(named, 256, None, chat_parsing(named, ChatParsers()))
    assert fields["structured_outputs"]["json"] == TOOLS[0]["function"]["parameters"]
    both = ChatCompletionRequest.model_validate(
        req.model_dump(exclude_none=True) | {"response_format": {"type": "json_object"}})
    with pytest.raises(ApiError) as err:
        chat_fields(both, 256, None, chat_parsing(both, ChatParsers()))
    assert err.value.param == "tool_choice"


def test_a_forced_choice_over_tools_too_large_names_the_tools():
    big = [{"type": "function", "function": {"name": f"f{i}", "parameters": {
        "type": "object", "properties": {f"p{j}": {"type": "string", "description": "x" * 200}
                                         for j in range(20)}}}} for i in range(20)]
    req = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "hi"}],
                                                "tools": big, "tool_choice": "required"})
    with pytest.raises(ApiError) as err:
        chat_fields(req, 256, None, chat_parsing(req, ChatParsers()))
    assert err.value.param == "tools" and "65536" in err.value.message


def test_none_renders_the_tools_but_parses_nothing():
    parsing = ChatParsing(TOOLS, "none", None, ChatParsers("hermes", True))
    assert parsing.structured is None and not parsing.active
    answer = parsing.answer().message(ANSWER)
    assert answer == {"content": ANSWER}


def test_reasoning_then_calls_whole():
    parser = ChatParsing(TOOLS, None, None, SERVER).answer()
    msg = parser.message(ANSWER)
    assert msg["reasoning_content"].strip() == "weather: call the tool"
    assert msg["content"].strip() == "Let me check."
    calls = [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in msg["tool_calls"]]
    assert calls == [("get_weather", {"city": 'Paris "center"'}), ("get_time", {})]
    assert parser.finish_reason("stop") == "tool_calls" and parser.finish_reason("length") == "length"
    one = ChatParsing(TOOLS, "auto", False, SERVER).answer().message(ANSWER)
    assert [c["function"]["name"] for c in one["tool_calls"]] == ["get_weather"]


def assemble(parser, pieces: list[str]) -> dict:
    out: dict = {"content": "", "reasoning_content": "", "calls": {}}
    for d in [parser.feed(p) for p in pieces] + [parser.finish()]:
        out["content"] += d.get("content", "")
        out["reasoning_content"] += d.get("reasoning_content", "")
        for t in d.get("tool_calls", []):
            call = out["calls"].setdefault(t["index"], {"name": None, "arguments": ""})
            if "name" in t["function"]:
                assert call["name"] is None and t["id"]
                call["name"] = t["function"]["name"]
            call["arguments"] += t["function"]["arguments"]
    return out


@settings(max_examples=150, deadline=None)
@given(st.lists(st.integers(0, len(ANSWER)), max_size=12))
def test_streamed_reasoning_and_calls_equal_whole(cuts):
    parsing = ChatParsing(TOOLS, None, None, SERVER)
    whole = parsing.answer().message(ANSWER)
    bounds = [0, *sorted(cuts), len(ANSWER)]
    got = assemble(parsing.answer(), [ANSWER[a:b] for a, b in zip(bounds, bounds[1:]) if b > a])
    assert got["reasoning_content"] == (whole["reasoning_content"] or "")
    assert got["content"] == (whole["content"] or "")
    assert [(c["name"], c["arguments"]) for _, c in sorted(got["calls"].items())] == \
        [(c["function"]["name"], c["function"]["arguments"]) for c in whole["tool_calls"]]


def test_the_template_renders_tools_calls_and_tool_answers():
    tok = Tokenizer("pipeline/default_model")
    plain = [{"role": "user", "content": "hi"}]
    assert "get_weather" not in tok.render_chat(plain)
    options = check_chat_options(has_messages=True, add_generation_prompt=True, continue_final_message=False,
                                 chat_template_kwargs=None, tools=TOOLS)
    text = tok.render_chat(plain + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "snow"}], True, **options)
    assert '"name": "get_weather"' in text and '{"city": "Oslo"}' in text and "tool: snow" in text
    with pytest.raises(ValueError, match="chat_template_kwargs"):
        check_chat_options(has_messages=True, add_generation_prompt=True, continue_final_message=False,
                           chat_template_kwargs={"tools": TOOLS})
    with pytest.raises(ValueError, match=r"tools\[0\]\.function\.name"):
        check_chat_options(has_messages=True, add_generation_prompt=True, continue_final_message=False,
                           chat_template_kwargs=None, tools=[{"type": "function", "function": {}}])
    with pytest.raises(ValueError, match="only valid with `messages`"):
        check_chat_options(has_messages=False, add_generation_prompt=True, continue_final_message=False,
                           chat_template_kwargs=None, tools=TOOLS)
