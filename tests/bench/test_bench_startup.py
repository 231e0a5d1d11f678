"""`pipeline bench startup` on real processes (`import torch` and a one-line `pipeline run` on
the embedded model), once each: the JSON carries both figures, the ratio of their medians and
the breakdown rows in the order the run reaches them. No timing asserts: timing claims come
only from the bench's own output.
"""
from __future__ import annotations

import json
import subprocess

import pytest
from e2e_helpers import PIPELINE, ROOT, env

from pipeline.bench.startup import GOAL_RATIO, MILESTONES


def bench(*flags: str) -> subprocess.CompletedProcess:
    return subprocess.run([*PIPELINE, "bench", "startup", *flags], capture_output=True, text=True,
                          timeout=600, cwd=ROOT, env=env())


def test_one_repeat_json():
    p = bench("--repeats", "1", "--json")
    assert p.returncode == 0, p.stderr
    out = json.loads(p.stdout)
    assert out["bench"] == "startup" and out["machine"]["cpus"] >= 1
    rows = {r["case"]: r for r in out["results"]}
    torch_s = rows['python -c "import torch"']["median_s"]
    first = rows["pipeline run: first token"]
    exit_s = rows["pipeline run: exit"]["median_s"]
    assert torch_s > 0 and first["median_s"] > 0 and first["runs"] == 1
    assert first["median_s"] <= exit_s  # the answer comes before the process ends
    ratio = round(first["median_s"] / torch_s, 2)
    assert first["x_import_torch"] == ratio
    targets = {t["name"]: t for t in out["targets"]}
    target = targets["first token / import torch (medians)"]
    assert target["measured"] == ratio and target["met"] == (first["median_s"] / torch_s <= GOAL_RATIO)
    # Loading against reading the checkpoint, both measured in the run.
    read = rows["checkpoint read (the loader's reader, this process)"]
    loaded = rows["worker: weights loaded (its own figure)"]
    assert read["runs"] == loaded["runs"] == 1 and read["median_s"] > 0 and read["file_mib"] > 1
    load_ratio = targets["weights loaded / checkpoint read (medians)"]
    assert load_ratio["measured"] == loaded["x_read"] == round(loaded["median_s"] / read["median_s"], 2)
    # CPU seconds of both (the worker's over all its threads) and the floor they imply.
    assert read["cpu_s"] > 0 and loaded["cpu_s"] > 0 and loaded["cores"] >= 1
    # (both CPU figures are rounded to 1 ms, which for the embedded model's small read is a
    # few percent of it: the ratio must lie between the ratios of the rounding's ends)
    lo_cpu, hi_cpu = loaded["cpu_s"] - 0.0005, loaded["cpu_s"] + 0.0005
    assert lo_cpu / (read["cpu_s"] + 0.0005) - 0.01 <= loaded["cpu_x_read_cpu"] \
        <= hi_cpu / max(read["cpu_s"] - 0.0005, 1e-9) + 0.01
    assert loaded["floor_x_read"] == pytest.approx(loaded["cpu_s"] / loaded["cores"] / read["median_s"], rel=0.02, abs=0.01)
    peak = rows["worker: peak RSS during load above its start"]
    assert peak["median_mib"] >= 0 and peak["x_file"] == pytest.approx(peak["median_mib"] / read["file_mib"], rel=0.02)
    # Every stage's start-up line was seen, each before the first token; all stages are up
    # only after the worker is.
    at = {name: rows[f"  {name}"] for name, _ in MILESTONES}
    assert all(r["runs"] == 1 and 0 < r["median_s"] <= first["median_s"] for r in at.values()), at
    assert at["worker ready (KV cache allocated)"]["median_s"] <= at["all stages ready"]["median_s"]
    assert 0 < rows["  first token after all stages ready"]["median_s"] < first["median_s"]
    assert rows["  gateway imports (pipeline run --help, own process)"]["median_s"] > 0
    assert 0 < rows["  engine ttft (answer's timings.ttft)"]["median_s"] < first["median_s"]


@pytest.mark.parametrize("flags, says", [
    (["--repeats", "0"], "--repeats must be >= 1, got 0"),
    (["--timeout", "0"], "--timeout must be > 0 seconds, got 0.0"),
])
def test_bad_flags_name_the_flag_and_limit(flags, says):
    p = bench(*flags)
    assert p.returncode == 2 and p.stderr.strip() == f"pipeline bench startup: {says}", p.stderr


def test_failed_run_is_reported_not_timed(tmp_path):
    p = bench("--repeats", "1", "--model", str(tmp_path / "missing"))
    assert p.returncode == 1 and p.stdout == ""
    assert p.stderr.startswith("pipeline bench startup: pipeline run exited 2"), p.stderr
