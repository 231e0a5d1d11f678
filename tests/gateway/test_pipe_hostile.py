"""Pipe mode against hostile input, on the real processes: every non-blank line gets exactly
one answer line (an error line for a bad one), the run always ends, and its exit status says
whether any line failed. Bad flag values fail before the model loads."""
from __future__ import annotations

import json
import subprocess

import pytest
from e2e_helpers import ENGINE_FLAGS, PIPELINE, ROOT, env, make_tiny_model, shm_entries

from pipeline.gateway.pipe_input import MAX_LINE_BYTES
from pipeline.messages.requests import MAX_PROMPT_BYTES


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.getbasetemp() / "e2e-tiny")  # one per session


def run(model, lines: list[bytes], *flags: str, locale: str = "C.UTF-8"):
    p = subprocess.Popen([*PIPELINE, "run", "--model", str(model), *ENGINE_FLAGS, *flags],
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         cwd=ROOT, env=env() | {"LC_ALL": locale, "LANG": locale})
    try:
        out, err = p.communicate(b"\n".join(lines) + b"\n", timeout=300)
    finally:
        if p.poll() is None:  # a hung run: leave nothing behind
            p.kill()
            p.wait()
    assert shm_entries(f"{p.pid:x}") == [], "shared memory outlived the run"
    return p.returncode, [json.loads(x) for x in out.splitlines()], err.decode(errors="replace")


def js(**obj) -> bytes:
    return json.dumps(obj).encode()


def test_every_bad_line_gets_one_error_line_and_the_rest_run(model):
    emoji = "\U0001F600" * (MAX_PROMPT_BYTES // 4 + 1)  # fewer chars than the old char limit
    lines = [
        b"The for statement",                                           # 0: runs, id "0"
        b"\xff\xfe not UTF-8",                                          # 1
        b"\xef\xbb\xbf" + js(id="bom", prompt="hi", max_tokens=2),      # 2: BOM, runs
        b"[1, 2, 3]",                                                   # 3: JSON, not an object
        b'"quoted"',                                                    # 4
        js(id="bom", prompt="again"),                                   # 5: duplicate id
        js(id="7", prompt="x", max_tokens=2),                           # 6: runs
        b"plain line whose default id is 7",                            # 7: duplicate of 6
        js(id="emoji", prompt=emoji),                                   # 8: over the byte limit
        b"x" * (MAX_LINE_BYTES + 10),                                   # 9: over the line limit
        js(id="chat", messages=[{"role": "user", "content": "y" * (1 << 20)}] * 5),  # 10
        b"   ",                                                         # blank: no answer
        js(id="last", prompt="The for statement", max_tokens=3),        # 12: runs
    ]
    rc, answers, err = run(model, lines, "--ordered", "--max-tokens", "4")
    assert rc == 1, err  # some lines failed
    ids = [a["id"] for a in answers]
    assert ids == ["0", "1", "bom", "3", "4", "bom", "7", "7", "emoji", "9", "chat", "last"], err
    ok = [a for a in answers if a["error"] is None]
    assert [a["id"] for a in ok] == ["0", "bom", "7", "last"]
    assert all(a["finish_reason"] in ("length", "stop") and a["token_ids"] for a in ok)
    bad = {i: answers[i]["error"] for i in range(len(answers)) if answers[i]["error"] is not None}
    assert all(answers[i]["finish_reason"] == "error" and answers[i]["token_ids"] == [] for i in bad)
    assert "not valid UTF-8 (byte 0xff at offset 0)" in bad[1]["message"]
    assert "must be an object, got a JSON array" in bad[3]["message"]
    assert "got a JSON string" in bad[4]["message"]
    # A reused id: its answer says so and cannot pass for the first line's answer.
    for i, first in ((5, 2), (7, 6)):
        assert bad[i]["code"] == "duplicate_id", bad[i]
        assert f"line at index {first}" in bad[i]["message"] and f"(index {i})" in bad[i]["message"]
    assert bad[8] == {"code": "invalid_request", "message":
                      f"field `prompt`: {len(emoji.encode())} bytes (UTF-8), the limit is "
                      f"{MAX_PROMPT_BYTES} bytes"}
    assert bad[9]["message"] == (f"line: {MAX_LINE_BYTES + 10} bytes, the limit is "
                                 f"{MAX_LINE_BYTES} bytes")
    assert bad[10]["message"].startswith("field `messages`: 5 messages of ")
    assert f"the limit is {MAX_PROMPT_BYTES} bytes" in bad[10]["message"]


def test_invalid_utf8_under_an_ascii_locale(model):
    rc, answers, err = run(model, [b"hello", b"caf\xe9", js(prompt="end", max_tokens=1)],
                           locale="C")
    assert rc == 1, err
    assert [a["id"] for a in sorted(answers, key=lambda a: a["id"])] == ["0", "1", "2"], err
    by_id = {a["id"]: a for a in answers}
    assert by_id["1"]["error"]["message"] == "line: not valid UTF-8 (byte 0xe9 at offset 3)"
    assert by_id["0"]["error"] is None and by_id["2"]["error"] is None


@pytest.mark.parametrize("flag, value, needle", [
    ("--max-tokens", "0", "--max-tokens: must be >= 1, got 0"),
    ("--max-inflight", "-1", "--max-inflight: must be >= 0"),
    ("--temperature", "500", "--temperature: must be in [0, 100]"),
    ("--drain-timeout", "-1", "--drain-timeout: must be a number of seconds >= 0"),
])
def test_bad_flag_values_fail_before_the_model_loads(tmp_path, flag, value, needle):
    missing = tmp_path / "no-model"  # would fail too, but only once the flags were checked
    p = subprocess.run([*PIPELINE, "run", "--model", str(missing), *ENGINE_FLAGS, flag, value],
                       input="hello\n", capture_output=True, text=True, timeout=120, cwd=ROOT,
                       env=env())
    assert p.returncode == 2
    lines = p.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"pipeline run: {needle}"), p.stderr
    assert p.stdout == ""
