"""`pipeline bench gemm` on the tiny shape, in process: a row per format and row count, the
route `cpu_ops.linear_route` names, figures consistent with each other, bad flags refused.
No timing asserts."""
from __future__ import annotations

import json

import pytest

from pipeline import cli
from pipeline.layers import ops

pytestmark = pytest.mark.skipif(ops.backend(__import__("torch").device("cpu")) is None,
                                reason="C CPU ops not built")


def test_tiny_rows_per_format(capsys):
    argv = ["bench", "gemm", "--shape", "tiny", "--rows", "1,9,40", "--repeats", "1", "--json"]
    assert cli.main(argv) == 0
    out = json.loads(capsys.readouterr().out)
    rows = {r["case"]: r for r in out["results"]}
    machine = out["machine"]
    assert set(rows) == {f"{f} rows {m}" for f in ("bf16", "int8") for m in (1, 9, 40)}
    from pipeline._ext import cpu_ops
    for fmt in ("bf16", "int8"):
        for m in (1, 9, 40):
            r = rows[f"{fmt} rows {m}"]
            assert r["route"] == cpu_ops.linear_route(fmt, m, 64)
            # the figures are rounded (ms to 3 decimals): the ratio within what that allows
            ms, blas = r["ms"], r["blas_f32_ms"]
            lo, hi = (blas - 5e-4) / (ms + 5e-4), (blas + 5e-4) / max(ms - 5e-4, 1e-9)
            assert lo - 1e-3 <= r["blas_over_ours"] <= hi + 1e-3
            # a peak where the instruction's is measured: AMX tiles; bf16's FMAs on AVX2 alone
            measured = r["route"] == "amx" or (fmt == "bf16" and cpu_ops.lp_isa(fmt, 64) == "avx2")
            assert ("peak_fraction" in r) == measured
            if measured:
                key = f"peak_amx_{fmt}_gflop_s" if r["route"] == "amx" else "peak_fp32_fma_gflop_s"
                # gflop_s and the peak rounded to 0.1, the fraction to 3 decimals
                assert r["peak_fraction"] == pytest.approx(r["gflop_s"] / machine[key], rel=1e-2,
                                                           abs=0.06 / machine[key] + 1e-3)
    assert out["machine"]["shape"] == "tiny" and out["machine"]["threads"] >= 1


def test_int4_rows_take_the_route_named(capsys):
    argv = ["bench", "gemm", "--shape", "tiny", "--formats", "int4", "--rows", "1,40", "--repeats", "1",
            "--json"]
    assert cli.main(argv) == 0
    rows = {r["case"]: r for r in json.loads(capsys.readouterr().out)["results"]}
    from pipeline._ext import cpu_ops
    assert set(rows) == {"int4 rows 1", "int4 rows 40"}
    for m in (1, 40):
        r = rows[f"int4 rows {m}"]
        assert r["route"] == cpu_ops.linear_route("int4", m, 64) and "peak_fraction" not in r
        assert r["ms"] > 0 and r["blas_f32_ms"] > 0


@pytest.mark.parametrize("argv, says", [
    (["--rows", "0"], "--rows must be integers >= 1"),
    (["--formats", "int2"], "--formats: bf16, int8 and int4 only"),
])
def test_bad_flags_name_the_flag(argv, says, capsys):
    assert cli.main(["bench", "gemm", *argv]) == 2
    assert says in capsys.readouterr().out
