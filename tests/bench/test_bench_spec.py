"""`pipeline bench spec --quick` on the default model, a real process: every workload and
method runs, greedy outputs are equal with speculation on and off (the bench checks), the
JSON has its rows, acceptance and targets. No timing asserts: the quick workloads are far
too small to say anything about speed.
"""
from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
from e2e_helpers import PIPELINE, ROOT, env

from pipeline.bench.spec import ceiling
from pipeline.config import DEFAULT_MODEL

pytestmark = pytest.mark.skipif(not (Path(DEFAULT_MODEL) / "model.safetensors").is_file(),
                                reason="default model not built")


def test_quick_run_reports_every_workload():
    p = subprocess.run([*PIPELINE, "bench", "spec", "--json", "--quick", "--rounds", "1", "--batches", "1,2"],
                       capture_output=True, text=True, timeout=300, cwd=ROOT, env=env())
    assert p.returncode == 0, p.stderr[-3000:]
    out = json.loads(p.stdout)
    rows = {r["case"]: r for r in out["results"]}
    assert set(rows) == {f"{w} {m} batch {b}" for w, ms in (("continue", ("ngram", "suffix", "draft_self",
                                                                       "draft_random")),
                                                            ("agent", ("ngram", "suffix")), ("floor", ("ngram",)))
                         for m in ms for b in (1, 2)}
    for r in rows.values():
        assert r["tok_s_on"] > 0 and r["tok_s_off"] > 0 and r["ratio"] > 0 and r["ceiling"] >= 1.0
        assert r["outputs_equal"] in (True, None)
    assert {t["name"] for t in out["targets"]} >= {"n-gram on the model's own continuations, batch 1"}
    # The target drafting for itself: every draft it verified is its own argmax.
    me = rows["continue draft_self batch 1"]
    assert me["accepted_per_position"] == me["drafted_per_position"] and sum(me["drafted_per_position"]) > 0


def test_the_ceiling_is_the_best_k_at_the_measured_price():
    st = {"spec_accepted_per_position": [60, 30, 10], "spec_drafted_per_position": [100, 100, 100],
          "spec_token_price": 0.2}
    # K=1: 1.6 / 1.2; K=2: 1.9 / 1.4 (the best); K=3: 2.0 / 1.6.
    assert ceiling(st) == pytest.approx(1.9 / 1.4, abs=1e-3)
    assert ceiling({}) == 1.0


def test_interleaved_rounds_run_both_engines_side_by_side():
    """--interleave: off and on in one process, each generate call on both; greedy outputs
    still compared (the agent loop builds its prompts from the answers, equal on and off)."""
    p = subprocess.run([*PIPELINE, "bench", "spec", "--json", "--quick", "--rounds", "1", "--batches", "1",
                        "--workloads", "continue,agent", "--methods", "ngram", "--interleave"],
                       capture_output=True, text=True, timeout=300, cwd=ROOT, env=env())
    assert p.returncode == 0, p.stderr[-3000:]
    rows = {r["case"]: r for r in json.loads(p.stdout)["results"]}
    assert set(rows) == {"continue ngram batch 1", "agent ngram batch 1"}
    for r in rows.values():
        assert r["interleaved"] and r["outputs_equal"] is True and r["tok_s_on"] > 0 and r["tok_s_off"] > 0
