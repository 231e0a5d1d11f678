"""Issue 25, item 9: `pipeline router --http PORT --api-key KEY` serves the OpenAI API of
`pipeline serve --http` over mixed replicas (two daemons), driven by the `openai` package;
the answers equal a daemon's own (greedy), streaming included.

Before: `pipeline router` had no --http.
"""
from __future__ import annotations

import asyncio
import os
import signal

import openai
import pytest
from e2e_helpers import Daemon, RouterProc, free_port, make_tiny_model, shm_entries, wait_for

from pipeline.client import Client
from pipeline.ipc.sweep import sweep_stale

KEY = "router-key"


@pytest.fixture(scope="module")
def front(tmp_path_factory):
    model = make_tiny_model(tmp_path_factory.getbasetemp() / "router-tiny", max_positions=2048)
    # The instances parse tool calls and reasoning: the router's front end takes their flags.
    chat = ("--enable-auto-tool-choice", "--tool-call-parser", "hermes", "--reasoning-parser", "qwen3")
    daemons = [Daemon(model, *chat), Daemon(model, *chat)]
    router = None
    try:
        for d in daemons:
            d.wait_ready()
        port = free_port()
        router = RouterProc("--http", f"127.0.0.1:{port}", "--api-key", KEY,
                            "--instance", *(d.address for d in daemons))
        wait_for(lambda: "OpenAI API on" in router.output(), "the router's HTTP front end", 120)
        yield f"http://127.0.0.1:{port}/v1", daemons, str(model), router
    finally:
        if router is not None:
            assert router.stop() == 0, router.output()
        for d in daemons:
            killed = d.proc.poll() is not None  # the retry test's (its debris: next start sweeps it)
            assert d.stop() == 0 or killed
            if killed:
                sweep_stale()  # what a restart's start-up sweeps
            assert shm_entries(d.instance_id) == []


@pytest.fixture
def oai(front):
    with openai.OpenAI(base_url=front[0], api_key=KEY, max_retries=0, timeout=120) as c:
        yield c


def test_models_lists_the_instances_model(oai, front):
    assert [m.id for m in oai.models.list().data] == [front[2]]


def test_completions_and_chat_equal_a_daemons_own(oai, front):
    _, daemons, name, _ = front
    with Client(daemons[0].address, timeout=60) as c:
        direct = c.generate("the for statement", max_tokens=8, ignore_eos=True, temperature=0).text
    for _ in range(2):  # both instances, by the policy's spread: the same greedy answer
        got = oai.completions.create(model=name, prompt="the for statement", max_tokens=8,
                                     temperature=0, extra_body={"ignore_eos": True})
        assert got.choices[0].text == direct and got.usage.completion_tokens == 8
    chat = oai.chat.completions.create(model=name, messages=[{"role": "user", "content": "hi"}],
                                       max_tokens=5, temperature=0, extra_body={"ignore_eos": True})
    assert chat.choices[0].finish_reason == "length" and chat.usage.completion_tokens == 5


def test_streaming_through_the_router(oai, front):
    name = front[2]
    whole = oai.completions.create(model=name, prompt="iterate over", max_tokens=12, temperature=0,
                                   extra_body={"ignore_eos": True}).choices[0].text
    parts = [ch.choices[0].text for ch in oai.completions.create(
        model=name, prompt="iterate over", max_tokens=12, temperature=0, stream=True,
        extra_body={"ignore_eos": True}) if ch.choices]
    assert len(parts) > 1 and "".join(parts) == whole


def test_tool_calls_and_reasoning_through_the_router(oai, front):
    """Issue 28: tools reach the instances' chat template, a named tool_choice is a valid call,
    and "auto" and the reasoning parser follow the instances' flags (here hermes and qwen3; a
    regex grammar makes the random model write that format), streamed and not."""
    name = front[2]
    tools = [{"type": "function", "function": {"name": "get_time", "parameters": {
        "type": "object", "properties": {}, "additionalProperties": False}}}]
    ask = [{"role": "user", "content": "time?"}]
    # A forced call waits for the end of the thinking: this turn's thinking is closed already
    # (as Qwen3's template writes it with thinking off), so the call comes at once.
    closed = ask + [{"role": "assistant", "content": "<think>\n\n</think>\n\n"}]
    r = oai.chat.completions.create(model=name, messages=closed, tools=tools, max_tokens=16,
                                    tool_choice={"type": "function", "function": {"name": "get_time"}},
                                    extra_body={"add_generation_prompt": False, "continue_final_message": True})
    (call,) = r.choices[0].message.tool_calls
    assert (call.function.name, call.function.arguments) == ("get_time", "{}")
    regex = '<think>hm</think>\\n<tool_call>\\n\\{"name": "get_time", "arguments": \\{\\}\\}\\n</tool_call>'
    kw = dict(model=name, messages=ask, tools=tools, max_tokens=120,
              extra_body={"structured_outputs": {"regex": regex}})
    (c,) = oai.chat.completions.create(**kw).choices
    assert c.message.model_extra["reasoning_content"] == "hm" and c.finish_reason == "tool_calls"
    assert [(t.function.name, t.function.arguments) for t in c.message.tool_calls] == [("get_time", "{}")]
    reasoning, calls, reasons = "", [], []
    for ch in oai.chat.completions.create(stream=True, **kw):
        for d in ch.choices:
            reasoning += (d.delta.model_extra or {}).get("reasoning_content") or ""
            calls += [(t.function.name, t.function.arguments) for t in d.delta.tool_calls or []]
            reasons += [d.finish_reason] if d.finish_reason else []
    assert reasoning == "hm" and reasons == ["tool_calls"]
    assert [n for n, _ in calls if n] == ["get_time"] and "".join(a or "" for _, a in calls) == "{}"


def test_a_bad_key_is_refused(front):
    with openai.OpenAI(base_url=front[0], api_key="wrong", max_retries=0) as c, \
            pytest.raises(openai.AuthenticationError):
        c.models.list()


def test_embeddings_through_the_router_equal_a_daemons_own(oai, front):
    _, daemons, name, _ = front
    with Client(daemons[1].address, timeout=60) as c:
        direct = c.embed("the for statement").embedding
    r = oai.embeddings.create(model=name, input=["the for statement", "x"], encoding_format="float")
    assert len(r.data) == 2 and len(r.data[0].embedding) == 64  # the tiny model's hidden size
    assert max(abs(a - b) for a, b in zip(r.data[0].embedding, direct)) < 1e-5
    with pytest.raises(openai.BadRequestError, match="dimensions"):
        oai.embeddings.create(model=name, input="x", dimensions=8)


def test_requests_lost_before_their_first_token_run_on_another_instance(front):
    """Runs last: it kills one instance. Stopped, the instance holds what the router sends
    it; its health probe times out, and those requests (no token sent yet) run on the other."""
    url, (a, b), name, router = front
    os.killpg(b.proc.pid, signal.SIGSTOP)

    async def run() -> list:
        async with openai.AsyncOpenAI(base_url=url, api_key=KEY, max_retries=0, timeout=120) as c:
            return await asyncio.gather(*(c.completions.create(
                model=name, prompt=f"request {i}", max_tokens=4, temperature=0,
                extra_body={"ignore_eos": True}) for i in range(6)))

    try:
        results = asyncio.run(run())
    finally:
        os.killpg(b.proc.pid, signal.SIGKILL)
    assert all(r.usage.completion_tokens == 4 for r in results)
    lost = [line for line in router.output().splitlines() if "lost with it" in line]
    assert any(" 0 request(s)" not in line for line in lost), router.output()
