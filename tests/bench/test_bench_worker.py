"""`pipeline bench worker --formats` and `pipeline bench threads` on a tiny checkpoint, once
each: the JSON rows and the issue-12 ratio targets are the ones the figures give. No timing
asserts: timing claims come only from the benches' own output."""
from __future__ import annotations

import json
import subprocess

import pytest
from e2e_helpers import PIPELINE, ROOT, env, make_tiny_model

SMALL = ["--batch-sizes", "1,2", "--decode-steps", "2", "--repeats", "1", "--prefill-tokens", "32",
         "--json"]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return str(make_tiny_model(tmp_path_factory.mktemp("bench-worker")))


def bench(*flags: str) -> dict:
    p = subprocess.run([*PIPELINE, "bench", *flags], capture_output=True, text=True, timeout=600,
                       cwd=ROOT, env=env())
    assert p.returncode == 0, p.stderr
    return json.loads(p.stdout)


def test_worker_formats_and_their_ratios(model):
    out = bench("worker", "--model", model, "--skip-hf", *SMALL)
    rows = {r["case"]: r for r in out["results"]}
    for tag in ("", " bf16", " int8", " int4"):
        assert rows[f"decode batch 1{tag}"]["pipeline_tok_s"] > 0
        limit = rows[f"decode batch 1 vs bandwidth limit{tag}"]
        assert limit["fraction"] == pytest.approx(limit["pipeline_tok_s"] / limit["limit_tok_s"])
    m = out["machine"]
    # bf16 packs the projections in 2 bytes, int8 in 1 (+ a scale and a row sum per channel)
    assert m["weight_mib_bf16"] < 0.6 * m["weight_mib"] and m["weight_mib_int8"] < 0.6 * m["weight_mib_bf16"]
    # int4 in 4 bits (+ an fp16 scale per 128)
    assert m["weight_mib_int4"] < 0.6 * m["weight_mib_int8"]
    targets = {t["name"]: t for t in out["targets"]}
    t = targets["int4 batch-1 decode vs int8"]
    r = rows["decode batch 1 int4"]["pipeline_tok_s"] / rows["decode batch 1 int8"]["pipeline_tok_s"]
    assert t["measured"] == round(r, 2) and t["met"] == (r >= 1.7)
    t = targets["int8 batch-1 decode vs float32"]
    r = rows["decode batch 1 int8"]["pipeline_tok_s"] / rows["decode batch 1"]["pipeline_tok_s"]
    assert t["measured"] == round(r, 2) and t["met"] == (r >= 2.5)
    assert "bf16 prefill tokens/s vs float32" in targets


def test_worker_peak_rows_are_the_step_flops_over_the_measured_peak(model):
    from pipeline._ext import cpu_ops
    from pipeline.bench.peak import projection_params
    out = bench("worker", "--model", model, "--skip-hf", "--formats", "bf16,int8", "--peak", *SMALL)
    rows = {r["case"]: r for r in out["results"]}
    m = out["machine"]
    # The formats with an instruction peak here: both on AMX tiles; bf16 alone (float32 FMAs)
    # on a core with AVX2 alone; none on AVX-512 without AMX.
    isa = cpu_ops.lp_isa("bf16", 896)
    with_peak = ["bf16", "int8"] if cpu_ops.amx_ok() else ["bf16"] if isa == "avx2" else []
    assert all(f"peak_gflop_s_{fmt}" in m for fmt in with_peak)
    # ("decode batch 2 bf16 vs peak", "prefill 32 tokens bf16 vs peak")
    assert {c.split()[3] for c in rows if c.endswith("vs peak")} == set(with_peak)
    if not with_peak:
        pytest.skip("no instruction peak measured on this CPU")
    layer_p, head_p, _ = projection_params(model)
    for fmt in with_peak:
        peak = m[f"peak_gflop_s_{fmt}"]
        assert peak > 0
        row = rows[f"decode batch 2 {fmt} vs peak"]
        tok_s = rows[f"decode batch 2 {fmt}"]["pipeline_tok_s"]
        assert row["gflop_s"] == pytest.approx(tok_s * 2 * (layer_p + head_p) / 1e9)
        # (the machine's peak is rounded to 0.1 GFLOP/s)
        assert row["peak_fraction"] == pytest.approx(row["gflop_s"] / peak, rel=0.06 / peak)
        assert row["bound_fraction"] == pytest.approx(tok_s / row["bound_tok_s"])
        assert f"prefill 32 tokens {fmt} vs peak" in rows


def test_threads_default_against_explicit_counts(model):
    out = bench("threads", "--model", model, "--format", "int8", "--rounds", "1", "--phases",
                "quiet,busy", *SMALL)
    assert out["machine"]["model"] == f"{model} int8"
    cores = out["machine"]["cores"]
    cases = [r["case"] for r in out["results"]]
    names = ["default (adaptive)", *(f"{n} thread(s)" for n in range(1, cores + 1))]
    assert cases == [f"{p}: {n}" for p in ("quiet", "busy") for n in names]
    rows = {r["case"]: r for r in out["results"]}
    for t in out["targets"]:
        phase, key = t["name"].split(":")[0].split(" ", 1)
        best = max(rows[f"{phase}: {n}"][key] for n in names[1:])
        assert t["measured"] == pytest.approx(rows[f"{phase}: default (adaptive)"][key] / best, abs=2e-3)
