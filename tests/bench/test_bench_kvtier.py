"""`pipeline bench kvtier --quick` on the default model, a real process: every part runs, the
JSON has its rows and targets, and the figures are sane (the tier was used where it should
be, and not where it should not). No timing asserts: the quick workloads are far too small
to say anything about speed.
"""
from __future__ import annotations

import argparse
import json
import subprocess
from pathlib import Path

import pytest
from e2e_helpers import PIPELINE, ROOT, env

from pipeline.bench import kvtier
from pipeline.config import DEFAULT_MODEL

pytestmark = pytest.mark.skipif(not (Path(DEFAULT_MODEL) / "model.safetensors").is_file(),
                                reason="default model not built")


def test_quick_run_reports_every_part(tmp_path):
    p = subprocess.run([*PIPELINE, "bench", "kvtier", "--json", "--quick", "--shape", "default", "--rounds", "1",
                        "--models-dir", str(tmp_path / "models"), "--dir", str(tmp_path)],
                       capture_output=True, text=True, timeout=300, cwd=ROOT, env=env())
    assert p.returncode == 0, p.stderr[-3000:]
    out = json.loads(p.stdout)
    assert out["bench"] == "kvtier" and out["machine"]["cpus"] >= 1
    rows = {r["case"]: r for r in out["results"]}
    assert set(rows) == {"setup", "1. TTFT, page cache warm", "1. TTFT, page cache cold",
                         "5. load bandwidth, warm", "5. load bandwidth, cold", "2. chat", "3. no reuse",
                         "4. shared prefix, fresh", "4. shared prefix, in tier"}
    for case, r in rows.items():
        if case != "setup":
            assert r["off"] > 0 and r["on"] > 0 and r["gain"] > 0, r
    for mode in ("warm", "cold"):
        r = rows[f"1. TTFT, page cache {mode}"]
        assert r["unit"] == "ms" and r["gain"] == pytest.approx(r["off"] / r["on"], rel=0.02)
        assert 0 < r["load_wait_ms"] < r["on"]
        assert rows[f"5. load bandwidth, {mode}"]["unit"] == "GB/s"
    quick = kvtier.QUICK
    chat = rows["2. chat"]
    assert chat["working_set_over_pool"] > 3  # the histories do not fit: the tier serves them
    assert chat["on_tier_loaded_tokens"] > 0 and chat["on_computed_tokens"] < chat["off_computed_tokens"]
    nr = rows["3. no reuse"]
    assert nr["on_tier_loaded_tokens"] == 0 and nr["on_computed_tokens"] == nr["off_computed_tokens"]
    assert nr["on_tier_saved_blocks"] > 0 and len(nr["pair_ratios"]) == 4  # 4 pairs a round
    fresh, stored = rows["4. shared prefix, fresh"], rows["4. shared prefix, in tier"]
    assert fresh["on_tier_loaded_tokens"] == 0
    # The stored prefix is read once per run, not once per request.
    assert stored["on_tier_loaded_tokens"] == quick.shared_prefix
    assert stored["on_computed_tokens"] < stored["off_computed_tokens"]
    for r in (chat, nr, fresh, stored):
        # (a block waiting for its save may be evicted first in these few-block pools when
        # the mover thread is slow, e.g. beside other work: counted, not an error)
        assert r["on_cpu_s"] > 0 and r["off_cpu_s"] > 0 and r["on_tier_save_skipped"] >= 0
    targets = {t["name"]: t for t in out["targets"]}
    assert len(targets) == 8 and all(isinstance(t["met"], bool) for t in targets.values())
    assert {n.split(" ")[0] for n in targets} == {"1.", "2.", "3.", "4.", "5."}
    assert list(tmp_path.glob("kvtier-bench-*")) == []  # its tier directories removed
    # The long-context copy of the model: the weights linked, the config rewritten.
    cfg = json.loads((tmp_path / "models" / "default-ctx8192" / "config.json").read_text())
    assert cfg["max_position_embeddings"] == kvtier.LONG_POSITIONS
    assert (tmp_path / "models" / "default-ctx8192" / "model.safetensors").is_symlink()


@pytest.mark.parametrize("argv, says", [
    (["--parts", "ttft,warp"], "--parts ['warp'] unknown"),
    (["--rounds", "0"], "--rounds must be >= 1"),
    (["--quick", "--shape", "0.5b"], "--quick is for --shape default"),
])
def test_bad_flags_are_named(argv, says, capsys):
    p = argparse.ArgumentParser()
    kvtier.add_args(p)
    p.add_argument("--json", action="store_true")
    assert kvtier.main(p.parse_args(argv)) == 2
    assert says in capsys.readouterr().err
