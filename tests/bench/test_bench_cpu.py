"""`pipeline bench cpu` at its tiny shape, on real processes: the checkpoint it makes (every
id decodes to a word), the offline child per format, the HTTP rounds against a real
`pipeline serve --http`, the report's rows and targets, and flags named when bad. No vLLM
here (its virtualenv is a manual install) and no timing asserts.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import subprocess

import pytest
from e2e_helpers import PIPELINE, ROOT, env
from safetensors import safe_open
from tokenizers import Tokenizer

from pipeline.bench import cpu, cpu_http, cpu_limits
from pipeline.bench.cpu_limits import step_params
from pipeline.bench.serve import Sample


def test_tiny_run_offline_and_http(tmp_path):
    p = subprocess.run([*PIPELINE, "bench", "cpu", "--json", "--models-dir", str(tmp_path), "--shapes", "tiny",
                        "--formats", "bf16,int8", "--batches", "1,4", "--prompt-len", "16", "--output-len", "6",
                        "--http-requests", "6", "--http-concurrency", "3", "--rounds", "1", "--repeats", "1"],
                       capture_output=True, text=True, timeout=600, cwd=ROOT, env=env())
    assert p.returncode == 0, p.stderr
    out = json.loads(p.stdout)
    rows = {r["case"]: r for r in out["results"]}
    assert rows["limits"]["read_bytes_per_s"] > 0
    assert rows["limits"]["isa"] in ("avx512", "avx2", "portable")
    if rows["limits"]["isa"] == "avx2":  # bf16's instruction there, measured in the run
        assert rows["limits"]["peak_fp32_fma_flops"] > 0
    for fmt in ("bf16", "int8"):
        for b in (1, 4):
            r = rows[f"tiny offline {fmt} batch {b}"]
            assert r["output_tok_per_s"] == pytest.approx(b * 6 / r["total_s"], rel=1e-3)
            d = r["decode_tok_per_s"]  # NaN where the full generate took no longer (noise)
            assert d > 0 if r["total_s"] > r["prefill_s"] else math.isnan(d)
            assert r["rss_mib"] > 0
            flop = cpu_limits.prefill_flops(str(tmp_path / "tiny"), b, 16)
            assert r["prefill_gflop_s"] == pytest.approx(flop / r["prefill_s"] / 1e9, abs=0.051)
            peak = cpu_limits.peak_for(fmt, rows["limits"])
            assert (peak is None) == ("prefill_peak_fraction" not in r)
            if peak:
                assert r["prefill_peak_fraction"] == pytest.approx(flop / r["prefill_s"] / peak, abs=5e-4)
    http = rows["tiny http pipeline"]
    assert http["requests"] == http["completed"] == 6, http
    assert http["first_errors"] == []
    # (a tiny model's tokens may come several to one read of the stream: gaps of 0)
    assert 0 < http["ttft_p50_ms"] <= http["ttft_p99_ms"] and 0 <= http["itl_p50_ms"] <= http["itl_p99_ms"]
    assert 0 <= http["itl_held_pct"] <= 100
    # Where the CPU went in the timed round: every stage by its process name, and the client.
    cpu_s = http["cpu_s"]
    stages = {"pl-worker0", "pl-engine", "pl-tokenizer", "pl-output", "pl-gateway", "pl-http"}
    assert stages | {"client"} <= set(cpu_s), cpu_s
    assert all(v >= 0 for v in cpu_s.values())
    # duration_s is rounded to 1 ms, a tenth of a percent of a tiny round's fraction of a second
    of_cores = sum(cpu_s.values()) / (http["duration_s"] * os.cpu_count())
    assert http["cpu_of_cores"] == pytest.approx(of_cores, abs=of_cores * 6e-4 / http["duration_s"] + 1e-3)
    # The work served: each request's prefill (its first token) and a step per later token.
    head = cpu.SHAPES["tiny"]["vocab_size"] * cpu.SHAPES["tiny"]["hidden_size"]
    layers = step_params(str(tmp_path / "tiny")) - head
    assert cpu_limits.served_flops(str(tmp_path / "tiny"), 16, 6) == 2 * (layers * 16 + head) + 2 * 5 * (layers + head)
    assert http["served_gflop_s"] > 0
    peak = cpu_limits.peak_for("bf16", rows["limits"])
    assert (peak is None) == ("served_peak_fraction" not in http)
    if peak:
        # served_gflop_s is rounded to 0.1: on a slow or busy machine that is a few % of the peak
        assert http["served_peak_fraction"] == pytest.approx(http["served_gflop_s"] * 1e9 / peak,
                                                             abs=0.05e9 / peak + 1e-3)
    targets = {t["name"]: t for t in out["targets"]}
    assert targets["tiny http pipeline: all requests completed"]["met"]
    assert "tiny int8 batch-4 vs bf16 batch-4" in targets
    assert not any("vLLM" in name for name in targets)  # no --vllm-env: no peer targets

    model = tmp_path / "tiny"
    tok = Tokenizer.from_file(str(model / "tokenizer.json"))
    vocab = cpu.SHAPES["tiny"]["vocab_size"]
    assert tok.get_vocab_size() == vocab
    assert tok.decode([5, 6, vocab - 1]) == f"w5 w6 w{vocab - 1}"
    # step_params: every weight but the looked-up embedding (tied here: it is the LM head).
    with safe_open(str(model / "model.safetensors"), "pt") as f:
        total = sum(f.get_slice(k).get_shape()[0] * (f.get_slice(k).get_shape() + [1])[1]
                    for k in f.keys() if "norm" not in k)
    assert step_params(str(model)) == total


@pytest.mark.parametrize("argv, says", [
    (["--batches", "1,x"], "--batches: comma-separated integers"),
    (["--batches", "0"], "--batches must be >= 1"),
    (["--threads", "0"], "--threads must be >= 1"),
    (["--output-len", "1"], "--output-len must be >= 2"),
    (["--shapes", "7b"], "--shapes: unknown '7b'"),
    (["--formats", "fp8"], "--formats: unknown 'fp8'"),
    (["--vllm-formats", "int8"], "--vllm-formats: unknown 'int8'"),
    (["--vllm-env", "/nonexistent"], "--vllm-env /nonexistent: no bin/python"),
])
def test_bad_flags_name_the_flag_and_limit(argv, says, capsys):
    p = argparse.ArgumentParser()
    cpu.add_args(p)
    p.add_argument("--json", action="store_true")
    assert cpu.main(p.parse_args(argv)) == 2
    assert says in capsys.readouterr().err


def test_peak_flops_names_its_kinds():
    from pipeline._ext import cpu_ops
    with pytest.raises(ValueError, match="kind must be one of fp32_fma, amx_bf16, amx_int8"):
        cpu_ops.peak_flops("sse9", 1)
    if not cpu_ops.amx_ok():
        with pytest.raises(ValueError, match="this CPU has no amx_bf16"):
            cpu_ops.peak_flops("amx_bf16", 1, tries=1)


def test_http_figures_count_the_gaps_held_by_prefills():
    """Two streams of 101 tokens 0.1 s apart, but for gaps of 2 s in one (held by a prefill):
    p99 lands on a hold once holds pass 1 % of the gaps, and itl_held_pct counts them."""
    def stream(held: int) -> Sample:
        times, t = [], 1.0
        for i in range(101):
            times.append(t)
            t += 2.0 if i < held else 0.1
        return Sample(prompt_tokens=8, sent=0.5, token_times=times, tokens=101, done=t, ok=True)

    few = cpu_http.figures([stream(1), stream(0)], 10.0)  # 1 of 200 gaps held
    assert few["itl_held_pct"] == 0.5
    assert few["itl_p50_ms"] == pytest.approx(100) and few["itl_p99_ms"] == pytest.approx(100)
    many = cpu_http.figures([stream(3), stream(0)], 10.0)  # 3 of 200
    assert many["itl_held_pct"] == 1.5 and many["itl_p99_ms"] == pytest.approx(2000)
    assert many["ttft_p50_ms"] == pytest.approx(500) and many["output_tok_per_s"] == 20.2
    # a round whose first tokens come in two groups: the p50 is one of them, the mean between
    late = [Sample(prompt_tokens=8, sent=0.0, token_times=[t], tokens=1, done=t, ok=True)
            for t in (1.0, 1.0, 3.0, 3.0, 3.0)]
    split = cpu_http.figures(late, 3.0)
    assert split["ttft_p50_ms"] == pytest.approx(3000) and split["ttft_mean_ms"] == pytest.approx(2200)
    lost = cpu_http.figures([Sample(prompt_tokens=8)], 1.0)  # no stream completed: no gaps
    assert lost["completed"] == 0 and math.isnan(lost["itl_held_pct"])
