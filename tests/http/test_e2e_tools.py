"""Issue 28, end to end: tool calling and reasoning over the OpenAI API (`pipeline serve --http
--enable-auto-tool-choice --tool-call-parser hermes --reasoning-parser qwen3`) driven by the
`openai` SDK, and the same in pipe mode's batch files and ``LLM.chat``.

The test model is random: it was never trained on tools. ``required`` and a named function
are still valid calls (the grammar forces them); for ``auto`` and reasoning a regex grammar
makes the model write the hermes and ``<think>`` format, so the server's parsers see exactly
what a trained model would write, streamed token by token.
"""
from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from e2e_helpers import PIPELINE, ROOT, Daemon, env, make_tiny_model, serving

KEY = "tools-key"
CITIES = ["Paris", "Lima", "Oslo"]
TOOLS: list[dict[str, Any]] = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "the weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string", "enum": CITIES}},
                       "required": ["city"], "additionalProperties": False}}},
    {"type": "function", "function": {"name": "get_time", "description": "the time now",
                                      "parameters": {"type": "object", "properties": {},
                                                     "additionalProperties": False}}},
]
NAMES = {t["function"]["name"] for t in TOOLS}
ASK = [{"role": "user", "content": "what is the weather in Paris?"}]
# What a hermes-trained reasoning model answers: thinking, then a call.
THINK_CALL = ('<think>\\nthe user asks about paris\\n</think>\\n\\n<tool_call>\\n'
              '\\{"name": "get_weather", "arguments": \\{"city": "Paris"\\}\\}\\n</tool_call>')
THINK_TEXT = "<think>\\nshort\\n</think>\\n\\nIt is sunny\\."


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    return make_tiny_model(tmp_path_factory.getbasetemp() / "e2e-tiny")


def start(model: Path, *flags: str):
    yield from serving(model, "--api-key", KEY, "--max-model-len", "512", "--enable-auto-tool-choice",
                       "--tool-call-parser", "hermes", *flags, http=True)


@pytest.fixture(scope="module")
def daemon(model):
    yield from start(model)


@pytest.fixture(scope="module")
def thinker(model):
    """A reasoning model's server: its answers' <think> part goes to reasoning_content, and a
    forced answer's grammar waits for the end of the thinking."""
    yield from start(model, "--reasoning-parser", "qwen3")


def client(d: Daemon) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{d.http_url}/v1", api_key=KEY, max_retries=0, timeout=120)


@pytest.fixture
def oai(daemon):
    with client(daemon) as c:
        yield c


@pytest.fixture
def oai_think(thinker):
    with client(thinker) as c:
        yield c


# Qwen3's template with enable_thinking false ends the prompt with an empty, closed thinking:
# here the conversation continues such an assistant turn (the random model never closes one).
NO_THINKING = {"messages": ASK + [{"role": "assistant", "content": "<think>\n\n</think>\n\n"}],
               "extra_body": {"add_generation_prompt": False, "continue_final_message": True}}


def check_call(name: str, arguments: str) -> None:
    """A valid call of one of TOOLS: its name, and arguments its schema accepts."""
    assert name in NAMES
    args = json.loads(arguments)
    assert isinstance(args, dict)
    if name == "get_weather":
        assert set(args) == {"city"} and args["city"] in CITIES
    else:
        assert args == {}


def streamed(chunks: list[Any]) -> dict[str, Any]:
    """One choice's stream put together: content, reasoning, calls (id and name once, then
    argument fragments), finish reasons."""
    content, reasoning, calls, reasons = "", "", {}, []
    for ch in chunks:
        for c in ch.choices:
            d = c.delta
            content += d.content or ""
            reasoning += (d.model_extra or {}).get("reasoning_content") or ""
            for t in d.tool_calls or []:
                if t.index not in calls:
                    assert t.id and t.function.name and t.type == "function"  # the first delta names it
                    calls[t.index] = {"id": t.id, "name": t.function.name, "arguments": ""}
                else:
                    assert t.id is None and (t.function.name is None)  # never repeated
                calls[t.index]["arguments"] += t.function.arguments or ""
            if c.finish_reason:
                reasons.append(c.finish_reason)
    assert sorted(calls) == list(range(len(calls)))
    return {"content": content, "reasoning": reasoning, "calls": [calls[i] for i in sorted(calls)],
            "reasons": reasons}


# ---- forced choices: always a valid call, even from a random model -----------------------
def test_required_answers_with_valid_calls(oai, model):
    r = oai.chat.completions.create(model=str(model), messages=ASK, tools=TOOLS, tool_choice="required",
                                    max_tokens=200, temperature=0)
    (c,) = r.choices
    assert c.finish_reason == "tool_calls" and c.message.content is None
    assert c.message.tool_calls
    for call in c.message.tool_calls:
        assert call.type == "function" and call.id.startswith("call_")
        check_call(call.function.name, call.function.arguments)
    assert len({call.id for call in c.message.tool_calls}) == len(c.message.tool_calls)


def test_required_without_parallel_calls_makes_one(oai, model):
    for stream in (False, True):
        kw = dict(model=str(model), messages=ASK, tools=TOOLS, tool_choice="required",
                  parallel_tool_calls=False, max_tokens=200, temperature=1.0, seed=7)
        if stream:
            got = streamed(list(oai.chat.completions.create(stream=True, **kw)))
            calls = [(x["name"], x["arguments"]) for x in got["calls"]]
            assert got["reasons"] == ["tool_calls"]
        else:
            (c,) = oai.chat.completions.create(**kw).choices
            calls = [(t.function.name, t.function.arguments) for t in c.message.tool_calls or []]
        assert len(calls) == 1
        check_call(*calls[0])


def test_named_function_streamed_equals_non_streamed(oai, model):
    choice = {"type": "function", "function": {"name": "get_weather"}}
    kw = dict(model=str(model), messages=ASK, tools=TOOLS, tool_choice=choice, max_tokens=64, temperature=0)
    (c,) = oai.chat.completions.create(**kw).choices
    (call,) = c.message.tool_calls
    assert call.function.name == "get_weather" and c.finish_reason == "stop"  # OpenAI's for a forced call
    check_call("get_weather", call.function.arguments)
    got = streamed(list(oai.chat.completions.create(stream=True, **kw)))
    assert [(x["name"], x["arguments"]) for x in got["calls"]] == [("get_weather", call.function.arguments)]
    assert got["content"] == "" and got["reasons"] == ["stop"]


def test_a_zero_argument_function_is_still_called(oai, model):
    choice = {"type": "function", "function": {"name": "get_time"}}
    for stream in (False, True):
        kw = dict(model=str(model), messages=ASK, tools=TOOLS, tool_choice=choice, max_tokens=16)
        if stream:
            calls = [(x["name"], x["arguments"]) for x in
                     streamed(list(oai.chat.completions.create(stream=True, **kw)))["calls"]]
        else:
            calls = [(t.function.name, t.function.arguments)
                     for t in oai.chat.completions.create(**kw).choices[0].message.tool_calls]
        assert calls == [("get_time", "{}")]


# ---- auto: the hermes parser and the qwen3 reasoning parser ------------------------------
@pytest.mark.parametrize("stream", [False, True])
def test_auto_parses_reasoning_then_a_call(oai_think, model, stream):
    oai = oai_think
    kw: dict[str, Any] = dict(model=str(model), messages=ASK, tools=TOOLS, max_tokens=120,
                              extra_body={"structured_outputs": {"regex": THINK_CALL}})
    if stream:
        got = streamed(list(oai.chat.completions.create(stream=True, **kw)))
    else:
        (c,) = oai.chat.completions.create(**kw).choices
        got = {"content": c.message.content or "", "reasoning": c.message.model_extra["reasoning_content"],
               "calls": [{"name": t.function.name, "arguments": t.function.arguments}
                         for t in c.message.tool_calls or []], "reasons": [c.finish_reason]}
    assert got["reasoning"].strip() == "the user asks about paris"
    assert [(x["name"], json.loads(x["arguments"])) for x in got["calls"]] == [("get_weather", {"city": "Paris"})]
    assert got["content"].strip() == "" and got["reasons"] == ["tool_calls"]


@pytest.mark.parametrize("stream", [False, True])
def test_auto_without_a_call_is_content(oai_think, model, stream):
    oai = oai_think
    kw: dict[str, Any] = dict(model=str(model), messages=ASK, tools=TOOLS, max_tokens=60,
                              extra_body={"structured_outputs": {"regex": THINK_TEXT}})
    if stream:
        got = streamed(list(oai.chat.completions.create(stream=True, **kw)))
    else:
        (c,) = oai.chat.completions.create(**kw).choices
        assert c.message.tool_calls in (None, [])
        got = {"content": c.message.content, "reasoning": c.message.model_extra["reasoning_content"],
               "calls": [], "reasons": [c.finish_reason]}
    assert got["content"].strip() == "It is sunny." and got["reasoning"].strip() == "short"
    assert got["calls"] == [] and got["reasons"] == ["stop"]


def test_a_reasoning_models_forced_answer_follows_its_thinking(oai_think, model):
    """With a reasoning parser a forced call (and response_format) starts after </think>; a
    prompt whose thinking is closed (thinking off) gets it from the first token."""
    named = {"type": "function", "function": {"name": "get_weather"}}
    (c,) = oai_think.chat.completions.create(model=str(model), tools=TOOLS, tool_choice=named, max_tokens=64,
                                             **NO_THINKING).choices
    (call,) = c.message.tool_calls
    check_call(call.function.name, call.function.arguments)
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}
    fmt = {"type": "json_schema", "json_schema": {"name": "ok", "schema": schema}}
    (c,) = oai_think.chat.completions.create(model=str(model), response_format=fmt, max_tokens=32,
                                             **NO_THINKING).choices
    assert c.finish_reason == "stop" and json.loads(c.message.content)["ok"] in (True, False)
    # Thinking on (nothing closed it): the grammar waits; the random model thinks on freely.
    (c,) = oai_think.chat.completions.create(model=str(model), messages=ASK, response_format=fmt,
                                             max_tokens=24, temperature=0).choices
    assert c.finish_reason == "length"


def test_a_conversation_with_calls_and_tool_answers(oai, model):
    messages = ASK + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"}]
    r = oai.chat.completions.create(model=str(model), messages=messages, tools=TOOLS, tool_choice="none",
                                    max_tokens=8)
    (c,) = r.choices
    assert c.message.tool_calls in (None, []) and c.finish_reason in ("stop", "length")
    assert r.usage is not None and r.usage.prompt_tokens > 40  # the tools and the call were rendered


def test_tokenize_renders_the_tools(daemon):
    def count(**extra: Any) -> int:
        r = httpx.post(f"{daemon.http_url}/tokenize", json={"messages": ASK, **extra},
                       headers={"Authorization": f"Bearer {KEY}"})
        assert r.status_code == 200, r.text
        return r.json()["count"]
    assert count(tools=TOOLS) > count() + 40


def test_bad_tool_requests_name_the_field(oai, model):
    cases = [
        ({"tool_choice": "required"}, "tool_choice"),  # no tools
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
        ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
        ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools"),
    ]
    for extra, field in cases:
        with pytest.raises(openai.BadRequestError) as err:
            oai.chat.completions.create(model=str(model), messages=ASK, max_tokens=4, **extra)
        assert err.value.body["param"].startswith(field), (extra, err.value.body)


# ---- pipe mode's batch files, LLM.chat ---------------------------------------------------
def test_batch_file_lines_call_tools(model):
    line = {"custom_id": "t1", "method": "POST", "url": "/v1/chat/completions",
            "body": {"messages": NO_THINKING["messages"], **NO_THINKING["extra_body"], "tools": TOOLS,
                     "tool_choice": "required", "max_tokens": 200}}
    auto = {"custom_id": "t2", "method": "POST", "url": "/v1/chat/completions",
            "body": {"messages": ASK, "tools": TOOLS, "max_tokens": 120,
                     "structured_outputs": {"regex": THINK_CALL}}}
    p = subprocess.run([*PIPELINE, "run", "--model", str(model), "--device", "cpu", "--ordered",
                        "--enable-auto-tool-choice", "--tool-call-parser", "hermes", "--reasoning-parser", "qwen3"],
                       input=json.dumps(line) + "\n" + json.dumps(auto) + "\n", capture_output=True,
                       text=True, timeout=240, cwd=ROOT, env=env())
    assert p.returncode == 0, p.stderr
    out = [json.loads(x) for x in p.stdout.splitlines() if x.strip()]
    assert [x["custom_id"] for x in out] == ["t1", "t2"]
    for x in out:
        (choice,) = x["response"]["body"]["choices"]
        assert choice["finish_reason"] == "tool_calls"
        for call in choice["message"]["tool_calls"]:
            check_call(call["function"]["name"], call["function"]["arguments"])
    assert out[1]["response"]["body"]["choices"][0]["message"]["reasoning_content"].strip() == \
        "the user asks about paris"


def test_pipe_mode_chat_lines_call_tools(model):
    """A plain JSON chat line takes tool_choice / parallel_tool_calls as the API does; its
    final line carries content, tool_calls, reasoning_content beside the raw text."""
    lines = [{"id": "req", "messages": NO_THINKING["messages"], **NO_THINKING["extra_body"], "tools": TOOLS,
              "tool_choice": "required", "max_tokens": 200, "parallel_tool_calls": False},
             {"id": "auto", "messages": ASK, "tools": TOOLS, "max_tokens": 120,
              "structured_outputs": {"regex": THINK_CALL}},
             {"id": "bad", "messages": ASK, "tools": TOOLS, "tool_choice": "sometimes"},
             {"id": "plain", "prompt": "hi", "tool_choice": "required"}]
    p = subprocess.run([*PIPELINE, "run", "--model", str(model), "--device", "cpu", "--ordered",
                        "--enable-auto-tool-choice", "--tool-call-parser", "hermes", "--reasoning-parser", "qwen3"],
                       input="".join(json.dumps(x) + "\n" for x in lines), capture_output=True,
                       text=True, timeout=240, cwd=ROOT, env=env())
    assert p.returncode == 1, p.stderr  # two lines were refused
    req, auto, bad, plain = [json.loads(x) for x in p.stdout.splitlines() if x.strip()]
    assert req["id"] == "req" and req["finish_reason"] == "tool_calls" and req["content"] is None
    (call,) = req["tool_calls"]
    check_call(call["function"]["name"], call["function"]["arguments"])
    assert auto["reasoning_content"].strip() == "the user asks about paris"
    assert [c["function"]["name"] for c in auto["tool_calls"]] == ["get_weather"]
    assert auto["text"].startswith("<think>")  # the raw answer stays
    assert bad["finish_reason"] == "error" and "tool_choice" in bad["error"]["message"]
    assert plain["finish_reason"] == "error" and "only valid with `messages`" in plain["error"]["message"]


def test_llm_chat_with_tools(model):
    from pipeline import LLM, SamplingParams
    with LLM(model=str(model), device="cpu", max_model_len=512) as llm:
        (out,) = llm.chat(ASK, SamplingParams(max_tokens=64, temperature=0), tools=TOOLS,
                          tool_choice={"type": "function", "function": {"name": "get_weather"}})
        (c,) = out.outputs
        (call,) = c.tool_calls
        assert call["function"]["name"] == "get_weather" and c.content is None
        check_call("get_weather", call["function"]["arguments"])
        assert call["function"]["arguments"] == c.text  # the whole answer is the arguments
        with pytest.raises(ValueError, match="tool_choice"):
            llm.chat(ASK, tools=TOOLS, tool_choice="auto")  # no tool_call_parser on this LLM
        (plain,) = llm.chat(ASK, SamplingParams(max_tokens=4), tools=TOOLS)  # rendered, not parsed
        assert plain.outputs[0].tool_calls is None
    from pipeline.sampling_params.structured import StructuredOutputsParams
    with LLM(model=str(model), device="cpu", max_model_len=512, tool_call_parser="hermes",
             enable_auto_tool_choice=True, reasoning_parser="qwen3") as llm:
        sp = SamplingParams(max_tokens=120, structured_outputs=StructuredOutputsParams(regex=THINK_CALL))
        (c,) = llm.chat(ASK, sp, tools=TOOLS)[0].outputs
        assert c.reasoning_content is not None and c.reasoning_content.strip() == "the user asks about paris"
        assert [(t["function"]["name"], json.loads(t["function"]["arguments"])) for t in c.tool_calls or []] \
            == [("get_weather", {"city": "Paris"})]
        assert c.finish_reason == "tool_calls" and c.text.startswith("<think>")
