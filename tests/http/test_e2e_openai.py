"""End to end, the OpenAI API: `pipeline serve --http ... --api-key ...` driven by the `openai`
SDK, httpx and curl, checked against the daemon's own stats (ZMQ ``Client.stats()``) and an
in-process ``pipeline.LLM``.

Owns one daemon per module (HTTP and ZMQ both on loopback); every test leaves it idle (no
request running, no KV block held), and the module checks /dev/shm is clean after it stops.
"""
from __future__ import annotations

import asyncio
import json
import random
import shutil
import socket
import subprocess
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from e2e_helpers import ENGINE_FLAGS, Daemon, make_tiny_model, serving, shm_entries, wait_for
from prometheus_client.parser import text_string_to_metric_families

from pipeline.client import Client

KEY = "test-key"
WORDS = "the for statement is used to iterate over the elements of a sequence".split()
LONG_GEN = 240  # tokens: with a short prompt, near --max-model-len 256 (~0.7 s here)


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    return make_tiny_model(tmp_path_factory.getbasetemp() / "e2e-tiny")  # one per session


@pytest.fixture(scope="module")
def daemon(model):
    yield from serving(model, "--api-key", KEY, http=True)


@pytest.fixture(scope="module")
def name(model) -> str:
    return str(model)  # the served model name: the --model path as given


@pytest.fixture
def oai(daemon):
    # No retries: a 5xx or a timeout must show, not be papered over by the SDK.
    with openai.OpenAI(base_url=f"{daemon.http_url}/v1", api_key=KEY, max_retries=0,
                       timeout=120) as c:
        yield c
    wait_idle(daemon)  # whatever a test started has finished or been aborted


def stats(daemon: Daemon) -> dict[str, Any]:
    with Client(daemon.address, timeout=10) as c:
        return c.stats()


def idle(s: dict[str, Any]) -> bool:
    return (s["running"] == 0 and s["waiting"] == 0 and s["kv_blocks_used"] == 0
            and s["requests_inflight"] == 0)


def wait_idle(daemon: Daemon) -> dict[str, Any]:
    """The daemon idle (the engine publishes its stats a few times a second); its stats."""
    last: dict[str, Any] = {}

    def check() -> bool:
        last.update(stats(daemon))
        return idle(last)
    wait_for(check, "the daemon to be idle (no request running, no KV block held)")
    return last


def finished(s: dict[str, Any]) -> dict[str, float]:
    return dict(s["requests_finished"])


def unique_prompt(words: int) -> str:
    rng = random.Random()
    return " ".join(rng.choice(WORDS) for _ in range(words))


def tokenize(daemon: Daemon, prompt: str) -> list[int]:
    r = httpx.post(f"{daemon.http_url}/tokenize", json={"prompt": prompt},
                   headers={"Authorization": f"Bearer {KEY}"})
    assert r.status_code == 200, r.text
    return r.json()["tokens"]


# ---- models, completions, chat ---------------------------------------------------------
def test_models_list_names_the_model_path(oai, name):
    (m,) = oai.models.list().data
    assert m.id == name and m.owned_by == "pipeline"
    assert m.model_extra is not None and m.model_extra["max_model_len"] == 256


def test_completion_streamed_equals_non_streamed(oai, daemon, name):
    prompt = "the for statement is used"
    full = oai.completions.create(model=name, prompt=prompt, max_tokens=12, temperature=0,
                                  extra_body={"ignore_eos": True})
    (c,) = full.choices
    assert c.index == 0 and c.finish_reason == "length" and c.text
    assert full.system_fingerprint and full.system_fingerprint.startswith("pipeline")
    assert full.model == name and full.object == "text_completion"
    assert full.usage is not None
    assert full.usage.prompt_tokens == len(tokenize(daemon, prompt))
    assert full.usage.completion_tokens == 12
    assert full.usage.total_tokens == full.usage.prompt_tokens + 12

    chunks = list(oai.completions.create(model=name, prompt=prompt, max_tokens=12, temperature=0,
                                         stream=True, stream_options={"include_usage": True},
                                         extra_body={"ignore_eos": True}))
    assert len({ch.id for ch in chunks}) == 1
    text = "".join(ch.choices[0].text for ch in chunks if ch.choices)
    reasons = [ch.choices[0].finish_reason for ch in chunks if ch.choices and ch.choices[0].finish_reason]
    assert text == c.text and reasons == ["length"]
    assert all(ch.system_fingerprint == full.system_fingerprint for ch in chunks)
    last = chunks[-1]  # include_usage: a last chunk with no choice and the usage
    assert last.choices == [] and last.usage is not None
    assert (last.usage.prompt_tokens, last.usage.completion_tokens) == (full.usage.prompt_tokens, 12)


def test_chat_streamed_equals_non_streamed(oai, name):
    messages = [{"role": "user", "content": "iterate over the elements"}]
    full = oai.chat.completions.create(model=name, messages=messages, max_tokens=10, temperature=0,
                                       extra_body={"ignore_eos": True})
    (c,) = full.choices
    assert c.message.role == "assistant" and c.message.content and c.finish_reason == "length"
    assert full.object == "chat.completion" and full.system_fingerprint
    assert full.usage is not None and full.usage.completion_tokens == 10
    assert full.usage.total_tokens == full.usage.prompt_tokens + 10 and full.usage.prompt_tokens > 0

    chunks = list(oai.chat.completions.create(model=name, messages=messages, max_tokens=10,
                                              temperature=0, stream=True,
                                              extra_body={"ignore_eos": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks)
    reasons = [ch.choices[0].finish_reason for ch in chunks if ch.choices[0].finish_reason]
    assert text == c.message.content and reasons == ["length"]
    assert all(ch.object == "chat.completion.chunk" and ch.id == chunks[0].id for ch in chunks)


def test_n2_gives_two_choices(oai, name):
    out = oai.completions.create(model=name, prompt="over the", n=2, max_tokens=6, temperature=1,
                                 seed=7, extra_body={"ignore_eos": True})
    assert sorted(c.index for c in out.choices) == [0, 1]
    assert out.usage is not None and out.usage.completion_tokens == 12

    seen: dict[int, list[str]] = {0: [], 1: []}
    for ch in oai.chat.completions.create(model=name, messages=[{"role": "user", "content": "hi"}],
                                          n=2, max_tokens=5, stream=True,
                                          extra_body={"ignore_eos": True}):
        for c in ch.choices:
            if c.finish_reason:
                seen[c.index].append(c.finish_reason)
    assert seen == {0: ["length"], 1: ["length"]}


def test_stop_string_ends_the_text_before_it(oai, name):
    prompt = "the elements of a sequence"
    free = oai.completions.create(model=name, prompt=prompt, max_tokens=24, temperature=0,
                                  extra_body={"ignore_eos": True}).choices[0].text
    # an alphanumeric 3-character piece of the text, first seen after its start
    stop = next((free[i:i + 3] for i in range(len(free) // 3, len(free) - 3)
                 if free[i:i + 3].isalnum() and free.index(free[i:i + 3]) > 0), None)
    assert stop is not None, f"no usable stop string in {free!r}"
    c = oai.completions.create(model=name, prompt=prompt, max_tokens=24, temperature=0, stop=stop,
                               extra_body={"ignore_eos": True}).choices[0]
    assert c.finish_reason == "stop" and c.text == free[:free.index(stop)]
    assert c.model_extra is not None and c.model_extra["stop_reason"] == stop


def test_same_seed_same_text(oai, name):
    def sample(seed: int) -> str:
        return oai.completions.create(model=name, prompt="a sequence", max_tokens=12, temperature=1,
                                      seed=seed, extra_body={"ignore_eos": True}).choices[0].text
    assert sample(1234) == sample(1234)
    # different seeds usually differ, but may collide: not asserted.
    messages = [{"role": "user", "content": "hello"}]
    chat = [oai.chat.completions.create(model=name, messages=messages, max_tokens=8, temperature=1,
                                        seed=99).choices[0].message.content for _ in range(2)]
    assert chat[0] == chat[1]


def test_completion_logprobs(oai, name):
    out = oai.completions.create(model=name, prompt="used to iterate", max_tokens=6, logprobs=2,
                                 extra_body={"ignore_eos": True})
    lp = out.choices[0].logprobs
    assert out.usage is not None and out.usage.completion_tokens == 6
    assert lp is not None and lp.tokens and lp.token_logprobs and lp.top_logprobs and lp.text_offset
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 6
    for top, own in zip(lp.top_logprobs, lp.token_logprobs):
        assert 2 <= len(top) <= 3  # the 2 best, and the sampled token (vLLM's shape)
        assert own <= 0 and all(v <= 0 for v in top.values())


def test_chat_logprobs_top2(oai, name):
    out = oai.chat.completions.create(model=name, messages=[{"role": "user", "content": "hi"}],
                                      max_tokens=5, temperature=0, logprobs=True, top_logprobs=2,
                                      extra_body={"ignore_eos": True})
    lp = out.choices[0].logprobs
    assert lp is not None and lp.content is not None and len(lp.content) == 5
    for e in lp.content:
        assert len(e.top_logprobs) == 2
        # greedy: the token taken is the most likely one
        assert e.top_logprobs[0].logprob == pytest.approx(e.logprob, abs=1e-5)
        assert e.top_logprobs[0].logprob >= e.top_logprobs[1].logprob
        assert e.bytes == list(e.token.encode())


def test_repeated_long_prompt_is_served_from_the_prefix_cache(oai, name):
    prompt = unique_prompt(80)  # several 16-token blocks, unlike any other prompt here
    first, second = (oai.completions.create(model=name, prompt=prompt, max_tokens=2).usage
                     for _ in range(2))
    assert first is not None and second is not None
    assert first.prompt_tokens == second.prompt_tokens > 32
    assert first.prompt_tokens_details is not None and second.prompt_tokens_details is not None
    assert first.prompt_tokens_details.cached_tokens == 0
    assert 0 < (second.prompt_tokens_details.cached_tokens or 0) < second.prompt_tokens


def test_list_of_prompts_and_token_id_prompts(oai, daemon, name):
    a, b = "the for statement", "elements of a sequence"
    kw: dict[str, Any] = {"model": name, "max_tokens": 6, "temperature": 0,
                          "extra_body": {"ignore_eos": True}}
    one = {p: oai.completions.create(prompt=p, **kw).choices[0].text for p in (a, b)}
    both = oai.completions.create(prompt=[a, b], **kw)
    assert [(c.index, c.text) for c in both.choices] == [(0, one[a]), (1, one[b])]
    ids_a, ids_b = tokenize(daemon, a), tokenize(daemon, b)
    assert both.usage is not None and both.usage.prompt_tokens == len(ids_a) + len(ids_b)
    assert both.usage.completion_tokens == 12

    by_ids = oai.completions.create(prompt=ids_a, **kw)
    assert by_ids.choices[0].text == one[a]
    assert by_ids.usage is not None and by_ids.usage.prompt_tokens == len(ids_a)
    lists = oai.completions.create(prompt=[ids_a, ids_b], n=2, **kw)  # choice i * n + j
    assert [(c.index, c.text) for c in lists.choices] == [(0, one[a]), (1, one[a]), (2, one[b]), (3, one[b])]


def test_greedy_chat_equals_in_process_llm(oai, model, name):
    from pipeline.llm import LLM
    from pipeline.sampling_params import SamplingParams

    messages = [{"role": "system", "content": "be brief"},
                {"role": "user", "content": "what is the for statement used for"}]
    got = oai.chat.completions.create(model=name, messages=messages, max_tokens=20, temperature=0)
    flags = dict(zip(ENGINE_FLAGS[::2], ENGINE_FLAGS[1::2]))
    with LLM(str(model), device="cpu", dtype="float32", max_num_seqs=int(flags["--max-num-seqs"]),
             max_model_len=int(flags["--max-model-len"]), num_blocks=int(flags["--num-blocks"])) as llm:
        want = llm.chat(messages, SamplingParams(temperature=0, max_tokens=20))[0]
    assert shm_entries(llm.config.instance_id) == []
    assert got.choices[0].message.content == want.outputs[0].text
    assert got.choices[0].finish_reason == want.outputs[0].finish_reason
    assert got.usage is not None and got.usage.prompt_tokens == len(want.prompt_token_ids)


# ---- errors, auth, health, metrics -------------------------------------------------------
def test_bad_parameter_is_a_400_naming_it(oai, name):
    with pytest.raises(openai.BadRequestError, match="temperature"):
        oai.completions.create(model=name, prompt="hi", temperature=-1)
    with pytest.raises(openai.BadRequestError, match="bogus_field") as e:
        oai.chat.completions.create(model=name, messages=[{"role": "user", "content": "hi"}],
                                    extra_body={"bogus_field": 1})
    assert isinstance(e.value.body, dict) and e.value.body.get("param") == "bogus_field"
    with pytest.raises(openai.BadRequestError, match="prompt.*max_model_len"):
        oai.completions.create(model=name, prompt="hi " * 300, max_tokens=2)  # > 256 tokens


def test_streamed_request_with_a_refused_prompt_is_a_400(oai, name):
    # The tokenizer stage refuses the prompt before any token: nothing was streamed yet, so
    # the answer can still be the 400 the same request gets unstreamed (vLLM's behaviour).
    too_long = "hi " * 300  # > --max-model-len 256 tokens
    with pytest.raises(openai.BadRequestError, match="prompt"):
        list(oai.completions.create(model=name, prompt=too_long, max_tokens=2, stream=True))
    with pytest.raises(openai.BadRequestError, match="messages"):
        list(oai.chat.completions.create(model=name, messages=[{"role": "user", "content": too_long}],
                                         max_tokens=2, stream=True))


def test_wrong_key_and_unknown_model(daemon, oai, name):
    with openai.OpenAI(base_url=f"{daemon.http_url}/v1", api_key="wrong", max_retries=0) as bad:
        with pytest.raises(openai.AuthenticationError):
            bad.completions.create(model=name, prompt="hi", max_tokens=2)
        with pytest.raises(openai.AuthenticationError):
            bad.models.list()
    with pytest.raises(openai.NotFoundError, match="no-such-model"):
        oai.completions.create(model="no-such-model", prompt="hi", max_tokens=2)


def test_health_is_open_and_metrics_need_the_key(daemon):
    r = httpx.get(f"{daemon.http_url}/health")
    assert r.status_code == 200 and r.json() == {"status": "ok"}
    assert httpx.get(f"{daemon.http_url}/metrics").status_code == 401
    r = httpx.get(f"{daemon.http_url}/metrics", headers={"Authorization": f"Bearer {KEY}"})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    names = {f.name for f in text_string_to_metric_families(r.text)}
    assert {"pipeline_requests_finished", "pipeline_kv_blocks_used"} <= names


def test_version_and_ping_as_vllms(daemon):
    """vLLM's /version and /ping (its /health for SageMaker, GET or POST), open as /health."""
    from pipeline import __version__

    r = httpx.get(f"{daemon.http_url}/version")
    assert r.status_code == 200 and r.json() == {"version": __version__}
    for method in ("GET", "POST"):
        r = httpx.request(method, f"{daemon.http_url}/ping")
        assert r.status_code == 200 and r.json() == {"status": "ok"}


# ---- load, disconnects, limits -----------------------------------------------------------
def test_256_concurrent_streams_each_answered_once(daemon, name):
    before = finished(wait_idle(daemon))

    async def one(c: openai.AsyncOpenAI, i: int) -> tuple[set[str], list[str], str]:
        ids, reasons, text = set(), [], []
        stream = await c.chat.completions.create(
            model=name, messages=[{"role": "user", "content": f"request {i}"}], max_tokens=8,
            stream=True)
        async for ch in stream:  # the SDK ends the iteration at `data: [DONE]`
            ids.add(ch.id)
            for choice in ch.choices:
                text.append(choice.delta.content or "")
                if choice.finish_reason:
                    reasons.append(choice.finish_reason)
        return ids, reasons, "".join(text)

    async def run() -> list[tuple[set[str], list[str], str]]:
        async with openai.AsyncOpenAI(base_url=f"{daemon.http_url}/v1", api_key=KEY,
                                      max_retries=0, timeout=120) as c:
            return await asyncio.gather(*(one(c, i) for i in range(256)))

    results = asyncio.run(run())
    for ids, reasons, _ in results:
        assert len(ids) == 1 and len(reasons) == 1 and reasons[0] in ("stop", "length")
    assert len({next(iter(ids)) for ids, _, _ in results}) == 256
    after = wait_idle(daemon)
    done = finished(after)
    assert sum(done.values()) - sum(before.values()) == 256
    assert done["error"] == before["error"] and done["abort"] == before["abort"]


def test_client_gone_mid_stream_aborts_and_frees_blocks(oai, daemon, name):
    before = finished(wait_idle(daemon))
    stream = oai.completions.create(model=name, prompt="hello", max_tokens=LONG_GEN, stream=True,
                                    extra_body={"ignore_eos": True})
    it = iter(stream)
    assert next(it).choices[0].finish_reason is None
    assert next(it).choices[0].finish_reason is None
    stream.close()
    wait_idle(daemon)
    done = finished(stats(daemon))
    assert done["abort"] - before["abort"] == 1 and done["length"] == before["length"]


def test_client_gone_before_a_whole_answer_aborts_it(daemon, name):
    before = finished(wait_idle(daemon))
    # 32 x 240 tokens: twice what the 256 KV blocks hold, so they are preempted and recomputed
    # in turn; the tiny model decodes 8 x 240 in under 0.3 s now, 32 of them take seconds.
    body = {"model": name, "prompt": [f"prompt {i}" for i in range(32)], "max_tokens": LONG_GEN,
            "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{daemon.http_url}/v1/completions", json=body,
                   headers={"Authorization": f"Bearer {KEY}"},
                   timeout=httpx.Timeout(10.0, read=0.3))
    wait_idle(daemon)
    done = finished(stats(daemon))
    aborted, ended = done["abort"] - before["abort"], done["length"] - before["length"]
    # Every request got one final answer; those not done when the client left were aborted.
    assert aborted + ended == 32 and aborted >= 1, (aborted, ended)


def test_body_over_32_mib_is_413(daemon):
    # Declared length: refused before any of the body is read (a raw socket: a client that
    # keeps writing 32 MiB into a closed connection may see a reset before the answer).
    size = 32 * 2**20 + 1
    host, port = daemon.http_url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as s:
        s.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nAuthorization: Bearer {KEY}\r\n"
                  f"Content-Type: application/json\r\nContent-Length: {size}\r\n\r\n".encode())
        answer = b""
        while chunk := s.recv(65536):  # the server closes the connection after its answer
            answer += chunk
    head, _, payload = answer.decode().partition("\r\n\r\n")
    assert head.startswith("HTTP/1.1 413") and json.loads(payload)["error"]["code"] == "request_too_large"
    # Sent whole with httpx (its Content-Length is declared too).
    r = httpx.post(f"{daemon.http_url}/v1/completions", content=b" " * size,
                   headers={"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"},
                   timeout=30)
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"


def test_curl_shows_chunks_as_they_are_produced(daemon, name):
    if shutil.which("curl") is None:
        pytest.skip("curl is not installed")
    body = json.dumps({"model": name, "prompt": "hello", "max_tokens": LONG_GEN, "stream": True,
                       "ignore_eos": True})
    proc = subprocess.Popen(["curl", "-sS", "-N", f"{daemon.http_url}/v1/completions",
                             "-H", f"Authorization: Bearer {KEY}", "-H", "Content-Type: application/json",
                             "-d", body], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        first = proc.stdout.readline()
        assert first.startswith("data: {")
        assert proc.poll() is None, "curl ended before its first chunk could be read"
        rest = [line.strip() for line in proc.stdout if line.startswith("data:")]
        assert proc.wait(60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert rest[-1] == "data: [DONE]" and len(rest) > 2
