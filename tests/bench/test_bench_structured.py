"""`pipeline bench structured` on the embedded default model with tiny sizes: both step times
and their ratio in the JSON, the ratio target computed from them, the constrained answers
checked whole against their grammar (and the free ones failing the same check, so the check
can fail), compile p50 and cache-hit times. No timing asserts beyond "positive" and "a hit is
cheaper than a compile": figures come only from the bench's own output."""
from __future__ import annotations

import json
import subprocess

import pytest
from e2e_helpers import PIPELINE, ROOT, env

BATCH, ROUNDS = 4, 2


def bench(*flags: str) -> subprocess.CompletedProcess:
    return subprocess.run([*PIPELINE, "bench", "structured", *flags], capture_output=True, text=True,
                          timeout=300, cwd=ROOT, env=env())


def test_structured_bench_small_run():
    p = bench("--batch", str(BATCH), "--decode-steps", "4", "--windows", "2", "--rounds", str(ROUNDS),
              "--compile-schemas", "4", "--json")
    assert p.returncode == 0, p.stderr
    out = json.loads(p.stdout)
    rows = {r["case"]: r for r in out["results"]}
    free, constrained = rows[f"decode batch {BATCH} free"], rows[f"decode batch {BATCH} json schema"]
    assert free["step_ms"] > 0 and constrained["step_ms"] > 0
    ratio = constrained["step_ms"] / free["step_ms"]
    assert constrained["vs_free"] == pytest.approx(ratio)
    live, windows = map(int, constrained["live_windows"].split("/"))
    assert 1 <= live <= windows == 2 * ROUNDS
    # the masks were filled and applied in the timed steps
    parts = {r["case"].split(": ", 1)[1]: r for r in out["results"] if r["case"].startswith("  json step")}
    assert parts["apply_masks (wait + kernel)"]["step_ms"] > 0
    assert parts["bitmask fill in the pool (overlaps the forward)"]["step_ms"] > 0
    # every constrained answer matched the schema token by token and parsed whole; no free one
    outputs = rows["outputs matching the json schema"]
    assert outputs["of"] == BATCH * ROUNDS
    assert outputs["json"] == outputs["json_complete"] == BATCH * ROUNDS
    assert outputs["free"] == 0
    miss = rows["compile json schema (p50 of 4 misses)"]["ms"]
    hit = rows["compile json schema (cache hit p50)"]["ms"]
    assert 0 < hit < miss
    assert rows["xgrammar import (once per process)"]["ms"] > 0
    assert rows["tokenizer info (once per model)"]["ms"] > 0
    targets = {t["name"]: t for t in out["targets"]}
    t = targets[f"batch-{BATCH} json-schema decode step vs free"]
    assert t["measured"] == round(constrained["vs_free"], 3) and t["met"] == (constrained["vs_free"] <= 1.15)
    assert targets["constrained outputs matching their grammar"]["met"]


def test_structured_bench_bad_flags():
    p = bench("--batch", "0")
    assert p.returncode != 0 and "--batch must be >= 1, got 0" in p.stderr
    p = bench("--model", str(ROOT / "docs"))
    assert p.returncode != 0 and "has no tokenizer.json" in p.stderr
