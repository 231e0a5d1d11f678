"""End to end, pipe mode: `pipeline run` with its real stage processes on a tiny checkpoint."""
from __future__ import annotations

import json
import signal
import subprocess

import pytest
from e2e_helpers import ENGINE_FLAGS, PIPELINE, ROOT, env, make_tiny_model, process_name, shm_entries


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.getbasetemp() / "e2e-tiny")  # one per session


def pipe(model, lines, *flags):
    p = subprocess.Popen([*PIPELINE, "run", "--model", str(model), *ENGINE_FLAGS, *flags],
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True, cwd=ROOT, env=env())
    try:
        out, err = p.communicate("\n".join(lines) + "\n", timeout=240)
    finally:
        if p.poll() is None:  # a hung run: leave nothing behind
            p.kill()
            p.wait()
    assert shm_entries(f"{p.pid:x}") == [], "shared memory outlived the run"
    return p.returncode, [json.loads(x) for x in out.splitlines()], err


def test_mixed_lines_ordered_and_streamed(model):
    long_prompt = list(range(3, 303))  # 300 tokens > --max-model-len 256
    lines = [
        "The for statement",
        json.dumps({"id": "greedy", "prompt": "The for statement", "max_tokens": 8,
                    "temperature": 0, "ignore_eos": True}),
        json.dumps({"id": 7, "prompt_token_ids": [5, 6, 7, 8], "max_tokens": 5,
                    "temperature": 0, "ignore_eos": True}),
        json.dumps({"id": "chat", "messages": [{"role": "user", "content": "hi"}],
                    "max_tokens": 4, "ignore_eos": True}),
        '{"id": "broken", "prompt": ',
        json.dumps({"id": "unknown", "prompt": "x", "bogus": 1}),
        json.dumps({"id": "range", "prompt": "x", "top_p": 5}),
        json.dumps({"id": "long", "prompt_token_ids": long_prompt}),
        "",
        json.dumps({"id": "greedy2", "prompt": "The for statement", "max_tokens": 8,
                    "temperature": 0, "ignore_eos": True}),
        *(json.dumps({"id": f"s{i}", "prompt": "x" * (i + 1), "max_tokens": 6 + i,
                      "temperature": 0.8, "seed": i, "ignore_eos": True, "stream": True})
          for i in range(3)),
    ]
    rc, answers, err = pipe(model, lines, "--ordered", "--max-tokens", "6")
    assert rc == 1, err  # some requests failed
    finals = [a for a in answers if "finish_reason" in a]
    assert [a["id"] for a in finals] == ["0", "greedy", "7", "chat", "4", "unknown", "range",
                                         "long", "greedy2", "s0", "s1", "s2"], err
    by_id = {a["id"]: a for a in finals}
    for rid, n in (("0", 6), ("greedy", 8), ("7", 5), ("chat", 4), ("greedy2", 8)):
        a = by_id[rid]
        assert a["error"] is None and a["finish_reason"] in ("length", "stop"), a
        if rid != "0":
            assert len(a["token_ids"]) == n and a["finish_reason"] == "length"
        assert a["usage"]["completion_tokens"] == len(a["token_ids"])
        assert a["usage"]["prompt_tokens"] > 0 and a["timings"]["e2e"] > 0
    assert by_id["7"]["usage"]["prompt_tokens"] == 4
    # Greedy is deterministic whatever the batch it shared.
    assert by_id["greedy"]["token_ids"] == by_id["greedy2"]["token_ids"]
    for rid, field in (("4", "JSON"), ("unknown", "bogus"), ("range", "top_p"),
                       ("long", "max_model_len")):
        a = by_id[rid]
        assert a["finish_reason"] == "error" and a["token_ids"] == [], a
        assert field in a["error"]["message"], a["error"]
    assert "256" in by_id["long"]["error"]["message"]
    # Streamed requests: deltas first, and they add up to the final answer exactly.
    for i in range(3):
        final = by_id[f"s{i}"]
        deltas = [a for a in answers if a["id"] == f"s{i}" and "finish_reason" not in a]
        assert deltas and len(final["token_ids"]) == 6 + i
        assert "".join(d["text"] for d in deltas) == final["text"]
        assert [t for d in deltas for t in d["token_ids"]] == final["token_ids"]
        assert answers.index(final) > max(answers.index(d) for d in deltas)
    assert not [a for a in answers if a["id"] in by_id and a["id"][0] != "s"
                and "finish_reason" not in a], "deltas of requests that did not ask to stream"


def test_bad_model_path_fails_clearly(tmp_path):
    p = subprocess.run([*PIPELINE, "run", "--model", str(tmp_path / "missing"), *ENGINE_FLAGS],
                       input="hello\n", capture_output=True, text=True, timeout=120, cwd=ROOT,
                       env=env())
    assert p.returncode == 2
    assert "cannot start" in p.stderr and "missing" in p.stderr and "config.json" in p.stderr


def test_ctrl_c_drains_then_aborts_the_rest(model):
    """SIGINT: stop reading, give in-flight requests --drain-timeout, abort the rest with an
    answer each, exit 130, leave no shared memory."""
    p = subprocess.Popen([*PIPELINE, "run", "--model", str(model), *ENGINE_FLAGS,
                          "--drain-timeout", "0"],
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True, cwd=ROOT, env=env())
    for i in range(6):
        p.stdin.write(json.dumps({"id": f"c{i}", "prompt": "x", "max_tokens": 250,
                                  "ignore_eos": True, "stream": i == 0}) + "\n")
    p.stdin.flush()  # stdin stays open: the run would otherwise wait for more lines
    first = json.loads(p.stdout.readline())  # a delta of c0: requests are running
    assert first["id"] == "c0" and "finish_reason" not in first
    assert process_name(p.pid) == "pl-gateway"  # named as `serve`'s gateway
    p.send_signal(signal.SIGINT)
    out, err = p.communicate(timeout=120)
    finals = [a for a in map(json.loads, out.splitlines()) if "finish_reason" in a]
    assert sorted(a["id"] for a in finals) == [f"c{i}" for i in range(6)], err
    assert {a["finish_reason"] for a in finals} == {"abort"}, finals
    # One shape on every path: who aborted is in the message (here pipe mode, interrupted).
    assert {a["error"]["code"] for a in finals} == {"aborted"}, finals
    assert all("interrupted" in a["error"]["message"] for a in finals), finals
    assert p.returncode == 130, err
    assert "draining" in err
    assert shm_entries(f"{p.pid:x}") == []


def test_closed_stdout_ends_the_run(model):
    """`pipeline run ... | head -1`: the rest is aborted, the run exits, nothing is left."""
    p = subprocess.Popen([*PIPELINE, "run", "--model", str(model), *ENGINE_FLAGS],
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True, cwd=ROOT, env=env())
    p.stdin.write("".join(json.dumps({"prompt": "x", "max_tokens": 250, "ignore_eos": True,
                                      "stream": True}) + "\n" for _ in range(8)))
    p.stdin.close()
    assert json.loads(p.stdout.readline())["id"] in {str(i) for i in range(8)}
    p.stdout.close()
    assert p.wait(120) == 1
    assert "stdout was closed" in p.stderr.read()
    assert shm_entries(f"{p.pid:x}") == []


def test_embed_lines_beside_generation(model):
    # task "embed": the answer line carries the pooled vector (the tiny model's hidden size,
    # unit norm) and no tokens; a generation in the same run is unaffected; mean pooling too.
    lines = [json.dumps({"id": "e", "prompt": "The for statement", "task": "embed"}),
             json.dumps({"id": "g", "prompt": "The for statement", "max_tokens": 4, "ignore_eos": True}),
             json.dumps({"id": "bad", "prompt": "x", "task": "classify"})]
    for pooling in ("last", "mean"):
        code, out, err = pipe(model, lines, "--pooling", pooling)
        assert code == 1, err  # one line failed (the unknown task)
        by_id = {o["id"]: o for o in out}
        e = by_id["e"]
        assert e["token_ids"] == [] and e["error"] is None and len(e["embedding"]) == 64
        assert abs(sum(x * x for x in e["embedding"]) - 1.0) < 1e-4
        assert len(by_id["g"]["token_ids"]) == 4 and by_id["g"].get("embedding") is None
        assert "task" in by_id["bad"]["error"]["message"]
