"""End to end: speculative decoding (``--speculative-config``) in the stage pipeline, where
the worker process proposes and verifies drafts and the engine process schedules them.

`pipeline run` with and without it: every answer (streamed or not) has the same tokens and
text, the streamed deltas add up to the final answer, the engine's stats count accepted
drafts, nothing is left in /dev/shm (``pipe`` checks). A bad config is refused before
anything starts, naming the field.
"""
from __future__ import annotations

import json
import subprocess

import pytest
from e2e_helpers import ENGINE_FLAGS, PIPELINE, ROOT, env
from test_e2e_pipe import pipe as run_pipe

# cost_aware off: whether drafts pay on this machine is a timing question, not this test's.
SPEC = ('{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 4, '
        '"cost_aware": false}')


def lines() -> list[str]:
    out = []
    for i in range(12):
        words = " ".join(f"w{i}x{k % 5}" for k in range(20))  # a repeating prompt
        out.append(json.dumps({"id": f"r{i}", "prompt": f"{words} then", "max_tokens": 8 + 3 * i,
                               "temperature": 0, "ignore_eos": i % 2 == 0, "stream": i % 3 == 0}))
    return out


def test_answers_equal_with_speculation_streamed_and_not(tmp_path):
    from pipeline.config import DEFAULT_MODEL

    rc, want, err = run_pipe(DEFAULT_MODEL, lines())
    assert rc == 0, err
    rc, got, err = run_pipe(DEFAULT_MODEL, lines(), "--speculative-config", SPEC,
                            "--stats-json", str(tmp_path / "s.json"))
    assert rc == 0, err
    finals = {a["id"]: a for a in got if "finish_reason" in a}
    assert finals.keys() == {a["id"] for a in want if "finish_reason" in a}
    for a in want:
        if "finish_reason" in a:
            assert (finals[a["id"]]["token_ids"], finals[a["id"]]["text"]) == (a["token_ids"], a["text"])
    for rid, final in finals.items():
        deltas = [a for a in got if a["id"] == rid and "finish_reason" not in a]
        if int(rid[1:]) % 3 == 0:
            assert deltas and "".join(d["text"] for d in deltas) == final["text"]
            assert [t for d in deltas for t in d["token_ids"]] == final["token_ids"]
    st = json.loads((tmp_path / "s.json").read_text())
    eng = st["engine"] if "engine" in st else st
    assert eng["spec_num_accepted_tokens"] > 0, eng


@pytest.mark.parametrize("value, needle", [
    ("{", "not JSON"),
    ('{"method": "ngram", "num_speculative_tokens": 99}', "num_speculative_tokens"),
    ('{"method": "draft_model", "num_speculative_tokens": 2}', '"model"'),
    ('{"method": "draft_model", "num_speculative_tokens": 2, "model": "/nonexistent"}', "no config.json"),
])
def test_bad_speculative_config_is_refused_naming_the_field(value, needle):
    from pipeline.config import DEFAULT_MODEL

    p = subprocess.run([*PIPELINE, "run", "--model", DEFAULT_MODEL, *ENGINE_FLAGS,
                        "--speculative-config", value],
                       input="hello\n", capture_output=True, text=True, timeout=120, cwd=ROOT, env=env())
    assert p.returncode != 0 and needle in p.stderr, p.stderr[-2000:]
    assert "Traceback" not in p.stderr
