"""End to end, pipe mode on OpenAI batch files: `pipeline run` with its real stage processes
reads batch input lines and writes one batch output line per input line; every answer is the
one the same request gets as a pipe JSON line (greedy, or seeded)."""
from __future__ import annotations

import json

import pytest
from e2e_helpers import make_tiny_model, run_pipe

CHAT = "/v1/chat/completions"
CMPL = "/v1/completions"
MSGS = [{"role": "user", "content": "hi there"}]
GREEDY = {"temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.getbasetemp() / "e2e-tiny")  # one per session


def batch(custom_id, url, body, **over) -> str:
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": url, "body": body} | over)


def bodies(served: str) -> dict[str, tuple[str, dict]]:
    return {
        "chat": (CHAT, {"messages": MSGS, "max_tokens": 6, **GREEDY}),
        "cmpl": (CMPL, {"model": served, "prompt": "The for statement", "max_tokens": 5,
                        "logprobs": 2, **GREEDY}),
        "two": (CMPL, {"prompt": ["The for statement", "x y z"], "max_tokens": 4, **GREEDY}),
        "ids": (CMPL, {"prompt": [5, 6, 7, 8], "max_tokens": 3, **GREEDY}),
        "n2": (CHAT, {"messages": MSGS, "n": 2, "temperature": 0.8, "seed": 3, "max_tokens": 5,
                      "ignore_eos": True}),
    }


def pipe_lines() -> list[str]:
    """The same requests as pipe JSON lines (a completion body's prompts one line each)."""
    return [json.dumps(x) for x in (
        {"id": "chat", "messages": MSGS, "max_tokens": 6, **GREEDY},
        {"id": "cmpl", "prompt": "The for statement", "max_tokens": 5, "logprobs": 2, **GREEDY},
        {"id": "two.0", "prompt": "The for statement", "max_tokens": 4, **GREEDY},
        {"id": "two.1", "prompt": "x y z", "max_tokens": 4, **GREEDY},
        {"id": "ids", "prompt_token_ids": [5, 6, 7, 8], "max_tokens": 3, **GREEDY},
        {"id": "n2", "messages": MSGS, "n": 2, "temperature": 0.8, "seed": 3, "max_tokens": 5,
         "ignore_eos": True})]


def test_batch_file_answers_like_pipe_lines_in_order(model):
    good = bodies(str(model))  # the served name: the --model path as given (as vLLM)
    lines = [
        batch("chat", *good["chat"]),
        batch("cmpl", *good["cmpl"]),
        batch("unknown", CMPL, {"prompt": "x", "bogus": 1}),
        batch("two", *good["two"]),
        "",  # blank: no output line
        batch("url", "/v1/embeddings", {"input": "x"}),
        batch("chat", CMPL, {"prompt": "x"}),  # the custom_id of line 0
        batch("ids", *good["ids"]),
        batch("stream", CHAT, {"messages": MSGS, "stream": True}),
        "a plain prompt",
        json.dumps({"id": "j", "prompt": "x"}),
        batch("n2", *good["n2"]),
        batch("model", CMPL, {"prompt": "x", "model": "not-" + str(model)}),
    ]
    rc, out, err = run_pipe(model, lines, "--ordered")
    assert rc == 1, err  # some lines failed
    assert [o["custom_id"] for o in out] == ["chat", "cmpl", "unknown", "two", "url", "chat", "ids",
                                             "stream", None, None, "n2", "model"], err
    assert all(o["id"].startswith("batch_req_") for o in out)
    assert len({o["id"] for o in out}) == len(out)
    ok = {o["custom_id"]: o["response"]["body"] for o in out
          if o["response"] and o["response"]["status_code"] == 200}
    assert set(ok) == {"chat", "cmpl", "two", "ids", "n2"}
    assert all(o["error"] is None for o in out if o["response"])

    rc2, ref, err2 = run_pipe(model, [*pipe_lines(), batch("b", *good["chat"])], "--ordered")
    assert rc2 == 1, err2
    by_id = {a["id"]: a for a in ref}
    assert all(by_id[i]["error"] is None for i in ("chat", "cmpl", "two.0", "two.1", "ids", "n2"))
    # A batch line among pipe lines is refused, naming the mixing.
    assert by_id["6"]["finish_reason"] == "error" and "mixing" in by_id["6"]["error"]["message"]

    chat = ok["chat"]
    assert chat["object"] == "chat.completion" and chat["id"].startswith("chatcmpl-")
    assert chat["model"] == str(model) and chat["system_fingerprint"].startswith("pipeline")
    (c,) = chat["choices"]
    assert c["message"] == {"role": "assistant", "content": by_id["chat"]["text"]}
    assert c["finish_reason"] == "length" and c["logprobs"] is None
    assert chat["usage"]["completion_tokens"] == 6 == len(by_id["chat"]["token_ids"])
    assert chat["usage"]["prompt_tokens"] == by_id["chat"]["usage"]["prompt_tokens"]

    cmpl = ok["cmpl"]
    assert cmpl["object"] == "text_completion" and cmpl["id"].startswith("cmpl-")
    (c,) = cmpl["choices"]
    assert c["text"] == by_id["cmpl"]["text"] and c["index"] == 0
    lp = c["logprobs"]
    assert lp["token_logprobs"] == pytest.approx([t[1] for t in by_id["cmpl"]["logprobs"]],  # [id, logprob, ...]
                                                 abs=1e-4)
    assert len(lp["tokens"]) == 5 and all(s in top for s, top in zip(lp["tokens"], lp["top_logprobs"]))

    two = ok["two"]  # one engine request per prompt, choice i is prompt i's
    assert [(c["index"], c["text"]) for c in two["choices"]] == \
        [(0, by_id["two.0"]["text"]), (1, by_id["two.1"]["text"])]
    assert two["usage"]["prompt_tokens"] == \
        by_id["two.0"]["usage"]["prompt_tokens"] + by_id["two.1"]["usage"]["prompt_tokens"]
    assert two["usage"]["completion_tokens"] == 8
    assert ok["ids"]["choices"][0]["text"] == by_id["ids"]["text"]
    assert ok["ids"]["usage"]["prompt_tokens"] == 4

    n2 = ok["n2"]  # seeded: the same completions as the pipe line's
    assert [(c["index"], c["message"]["content"]) for c in n2["choices"]] == \
        [(o["index"], o["text"]) for o in by_id["n2"]["outputs"]] and len(n2["choices"]) == 2

    res = {o["custom_id"]: o for o in out[2:]}
    for cid, status, param in (("unknown", 400, "bogus"), ("stream", 400, "stream"),
                               ("model", 404, "model")):
        r = res[cid]["response"]
        assert r["status_code"] == status and r["request_id"], r
        assert r["body"]["error"]["param"] == param and param in r["body"]["error"]["message"], r
    assert res["url"]["response"] is None and "url" in res["url"]["error"]["message"]
    dup = out[5]
    assert dup["response"] is None and dup["error"]["code"] == "duplicate_custom_id"
    assert "index 0" in dup["error"]["message"]
    for o in out[8:10]:  # a plain prompt, a pipe JSON line: refused, naming the mixing
        assert o["response"] is None and "mixing" in o["error"]["message"], o


def test_all_good_batch_exits_0(model):
    lines = [batch(f"r{i}", CMPL, {"prompt": "x" * (i + 1), "max_tokens": 3, **GREEDY})
             for i in range(4)]
    rc, out, err = run_pipe(model, lines)  # unordered: one line each, in any order
    assert rc == 0, err
    assert sorted(o["custom_id"] for o in out) == ["r0", "r1", "r2", "r3"]
    assert all(o["response"]["status_code"] == 200 and o["error"] is None for o in out)
    assert all(o["response"]["body"]["usage"]["completion_tokens"] == 3 for o in out)


LONG = 131072
# The answer's first token is a stop token: a request the engine may run for its whole implied
# max_tokens ends at once, while what it asked is still checked.
STOP_AT_ONCE = {"allowed_token_ids": [5, 6], "stop_token_ids": [5, 6]}


def test_long_context_lines_without_max_tokens_are_served(tmp_path):
    """Issue 25 item 8 in pipe mode: on a 131072-token model a batch line that sets no
    max_tokens gets as many as fit (not a refusal over limits it never set); an explicit
    max_tokens is still held to them, naming the field."""
    model = make_tiny_model(tmp_path / "long", max_positions=LONG)
    extras = [{"n": 3}, {"logprobs": True, "top_logprobs": 5},
              {"n": 3, "logprobs": True, "top_logprobs": 20}]
    lines = [batch(f"c{i}", CHAT, {"messages": MSGS, **STOP_AT_ONCE, **x}) for i, x in enumerate(extras)]
    lines += [batch("p", CMPL, {"prompt": "a", "n": 3, "max_tokens": None, "logprobs": 5, **STOP_AT_ONCE}),
              batch("explicit", CHAT, {"messages": MSGS, "n": 3, "max_tokens": LONG - 100})]
    code, out, err = run_pipe(model, lines, "--max-model-len", str(LONG), "--num-blocks", "8300")
    by_id = {o["custom_id"]: o for o in out}
    for i, x in enumerate(extras):
        o = by_id[f"c{i}"]
        assert o["error"] is None and o["response"]["status_code"] == 200, (o, err[-2000:])
        assert len(o["response"]["body"]["choices"]) == x.get("n", 1)
    assert by_id["p"]["error"] is None and by_id["p"]["response"]["status_code"] == 200, by_id["p"]
    bad = by_id["explicit"]
    assert bad["response"]["status_code"] == 400 and "max_tokens" in json.dumps(bad["response"]["body"]), bad
    assert code != 0  # a refused line makes the run's exit status say so
