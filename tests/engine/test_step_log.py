"""`--step-log FILE`: the engine stage appends one JSON line per step (engine/step_log.py).
Real processes: `pipeline run` on the embedded model; the lines must account for every
prompt and output token the answers report, in step order, with the timing fields present
and non-negative; a missing directory is refused before anything starts."""
from __future__ import annotations

import json
import subprocess

import pytest
from e2e_helpers import PIPELINE, ROOT, env

from pipeline.config import EngineConfig


def test_one_line_per_step_accounts_for_every_token(tmp_path):
    log = tmp_path / "steps.jsonl"
    prompts = [{"id": str(i), "prompt": "The for statement " * (i + 1), "max_tokens": 5 + i,
                "temperature": 0, "ignore_eos": True} for i in range(6)]
    p = subprocess.run([*PIPELINE, "run", "--ordered", "--step-log", str(log), "--max-num-batched-tokens", "16"],
                       input="".join(json.dumps(x) + "\n" for x in prompts), capture_output=True, text=True,
                       timeout=300, cwd=ROOT, env=env())
    assert p.returncode == 0, p.stderr
    answers = [json.loads(line) for line in p.stdout.splitlines()]
    lines = [json.loads(line) for line in log.read_text().splitlines()]
    assert [x["step"] for x in lines] == sorted(x["step"] for x in lines)
    # Every prompt token not in the prefix cache is prefilled once, every output token but the last one of each
    # request is fed back once: the steps' tokens add up to exactly that.
    prompt_tokens = sum(a["usage"]["prompt_tokens"] - a["usage"]["cached_tokens"] for a in answers)
    fed_back = sum(len(a["token_ids"]) - 1 for a in answers)
    assert sum(x["tokens"] for x in lines) == prompt_tokens + fed_back
    assert sum(x["new_reqs"] for x in lines) == len(prompts)
    assert max(x["prefill_tokens"] for x in lines) <= 16  # the token budget held
    for x in lines:
        assert x["prefill_tokens"] + x["decode_reqs"] <= x["tokens"]
        for k in ("sched_ms", "worker_ms", "worker_wait_ms", "result_wait_ms", "update_ms"):
            assert x[k] >= 0, (k, x)
    assert lines[-1]["running"] == lines[-1]["waiting"] == 0


def test_missing_directory_is_refused(tmp_path):
    with pytest.raises(ValueError, match="--step-log .*: its directory does not exist"):
        EngineConfig.of(step_log=str(tmp_path / "no" / "steps.jsonl")).check()
