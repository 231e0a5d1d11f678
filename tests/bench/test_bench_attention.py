"""`pipeline bench attention`: every case reported, its figures consistent with one another."""
from __future__ import annotations

import json
import subprocess

import pytest
from e2e_helpers import PIPELINE, ROOT, env

pytest.importorskip("pipeline._ext.cpu_ops", reason="CPU ops extension not built")


def test_tiny_shape_reports_decode_and_prefill_against_the_limits():
    p = subprocess.run([*PIPELINE, "bench", "attention", "--json", "--shape", "tiny", "--batch", "3",
                        "--contexts", "20,70", "--prefill-seqs", "2", "--prefill-len", "9",
                        "--threads", "2", "--repeats", "1"],
                       capture_output=True, text=True, timeout=300, cwd=ROOT, env=env())
    assert p.returncode == 0, p.stderr
    out = json.loads(p.stdout)
    m = out["machine"]
    assert (m["heads"], m["kv_heads"], m["head_dim"]) == (4, 2, 16) and m["read_gb_s"] > 0
    rows = {r["case"]: r for r in out["results"]}
    assert set(rows) == {"decode batch 3 context 20", "decode batch 3 context 70", "prefill 2 x 9"}
    for name, seqs, ctx, q_len in (("decode batch 3 context 20", 3, 20, 1),
                                   ("decode batch 3 context 70", 3, 70, 1), ("prefill 2 x 9", 2, 9, 9)):
        r = rows[name]
        visible = q_len * ctx - q_len * (q_len - 1) // 2
        flop = 4 * 4 * 16 * seqs * visible
        # ms is rounded to 10 ns: 0.1 % of a 10-us call
        assert r["gflop_s"] == pytest.approx(flop / (r["ms"] / 1e3) / 1e9, rel=5e-3, abs=0.01)
        if m["peak_fp32_fma_gflop_s"]:
            # both figures rounded (the peak to 0.1 GFLOP/s: a few % on a slow or busy machine)
            assert r["peak_fraction"] == pytest.approx(r["gflop_s"] / m["peak_fp32_fma_gflop_s"], rel=0.02, abs=2e-3)
        if q_len == 1:  # keys and values of every sequence, bf16, read once
            read = 2 * seqs * ctx * 2 * 16 * 2
            assert r["read_gb_s"] == pytest.approx(read / (r["ms"] / 1e3) / 1e9, rel=5e-3, abs=0.01)
            assert r["bandwidth_fraction"] == pytest.approx(r["read_gb_s"] / m["read_gb_s"], rel=0.02, abs=2e-3)
        else:
            assert "read_gb_s" not in r


@pytest.mark.parametrize("argv, says", [
    (["--contexts", "1,x"], "--contexts must be comma-separated integers >= 1, got '1,x'"),
    (["--contexts", "0"], "--contexts must be comma-separated integers >= 1"),
    (["--batch", "0"], "--batch must be >= 1"),
    (["--prefill-len", "0"], "--prefill-len must be >= 1"),
])
def test_bad_flags_name_the_flag_and_limit(argv, says):
    p = subprocess.run([*PIPELINE, "bench", "attention", "--shape", "tiny", *argv],
                       capture_output=True, text=True, timeout=120, cwd=ROOT, env=env())
    assert p.returncode == 2 and says in p.stdout, (p.stdout, p.stderr)
