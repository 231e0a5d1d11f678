"""Issue 25, item 9 over disaggregated pools: `pipeline router --http PORT --prefill P --decode D`
serves the OpenAI API (completions, chat, streaming) through split requests, driven by the
`openai` package; the greedy answers equal a mixed daemon's own, and a stream's pieces add
up to the whole answer (the prefill instance's first token once, then the decode instance's).

Before: `pipeline router` had no --http.
"""
from __future__ import annotations

import openai
import pytest
from e2e_helpers import Daemon, RouterProc, free_port, make_tiny_model, shm_entries, wait_for

from pipeline.client import Client

KEY = "router-pd-key"
CHUNKED = ["--max-num-batched-tokens", "32"]  # long prompts prefill over several steps
PROMPTS = ["the for statement", "iterate over the elements of a sequence " * 6]


@pytest.fixture(scope="module")
def pd_front(tmp_path_factory):
    model = make_tiny_model(tmp_path_factory.getbasetemp() / "router-tiny", max_positions=2048)
    mixed = Daemon(model, *CHUNKED)
    dec = Daemon(model, "--role", "decode")
    pre = Daemon(model, "--role", "prefill", "--kv-transfer", "ipc", *CHUNKED)
    router = None
    try:
        for d in (mixed, dec, pre):
            d.wait_ready()
        port = free_port()
        router = RouterProc("--http", f"127.0.0.1:{port}", "--api-key", KEY,
                            "--prefill", pre.address, "--decode", dec.address)
        wait_for(lambda: "OpenAI API on" in router.output(), "the router's HTTP front end", 120)
        yield f"http://127.0.0.1:{port}/v1", mixed, pre, dec, str(model)
    finally:
        if router is not None:
            assert router.stop() == 0, router.output()
        for d in (pre, dec, mixed):
            assert d.stop() == 0, d.output()
            assert shm_entries(d.instance_id) == []


@pytest.fixture
def oai(pd_front):
    with openai.OpenAI(base_url=pd_front[0], api_key=KEY, max_retries=0, timeout=120) as c:
        yield c


def received(d: Daemon) -> int:
    with Client(d.address, timeout=30) as c:
        return int(c.stats()["requests_received"])


@pytest.mark.parametrize("prompt", PROMPTS, ids=["short", "long"])
def test_completions_over_the_pools_equal_a_mixed_daemons(oai, pd_front, prompt):
    _, mixed, pre, dec, name = pd_front
    with Client(mixed.address, timeout=60) as c:
        direct = c.generate(prompt, max_tokens=8, ignore_eos=True, temperature=0).text
    before = received(pre), received(dec)
    got = oai.completions.create(model=name, prompt=prompt, max_tokens=8, temperature=0,
                                 extra_body={"ignore_eos": True})
    assert got.choices[0].text == direct and got.usage.completion_tokens == 8
    assert (received(pre), received(dec)) == (before[0] + 1, before[1] + 1)  # split over both


def test_streaming_over_the_pools_adds_up_to_the_whole_answer(oai, pd_front):
    name = pd_front[4]
    whole = oai.completions.create(model=name, prompt=PROMPTS[1], max_tokens=12, temperature=0,
                                   extra_body={"ignore_eos": True}).choices[0].text
    parts = [ch.choices[0].text for ch in oai.completions.create(
        model=name, prompt=PROMPTS[1], max_tokens=12, temperature=0, stream=True,
        extra_body={"ignore_eos": True}) if ch.choices]
    assert len(parts) > 1 and "".join(parts) == whole


def test_chat_streaming_over_the_pools(oai, pd_front):
    name = pd_front[4]
    messages = [{"role": "user", "content": "hi there"}]
    whole = oai.chat.completions.create(model=name, messages=messages, max_tokens=6, temperature=0,
                                        extra_body={"ignore_eos": True})
    assert whole.choices[0].finish_reason == "length" and whole.usage.completion_tokens == 6
    chunks = list(oai.chat.completions.create(model=name, messages=messages, max_tokens=6,
                                              temperature=0, stream=True,
                                              extra_body={"ignore_eos": True}))
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert text == whole.choices[0].message.content
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == "length"
