"""`pipeline bench serve --http` at a tiny size, on real processes: the CLI starts one daemon
with both --listen and --http, drives the same workload over ZMQ and over HTTP, and prints
one JSON object. Checks its shape: both transports with every request ok and all their
tokens, the two HTTP/ZMQ ratio targets, the daemon's clean exit and nothing left in
/dev/shm. No timing asserts: timing claims come only from the bench's own output.
"""
from __future__ import annotations

import argparse
import json
import math
import subprocess

import pytest
from e2e_helpers import PIPELINE, ROOT, env, make_tiny_model, shm_entries

from pipeline.bench import serve

ENGINE = "--device cpu --dtype float32 --max-num-seqs 32 --max-model-len 256 --num-blocks 256"


def test_tiny_run_both_transports(tmp_path):
    model = make_tiny_model(tmp_path / "tiny")
    p = subprocess.run([*PIPELINE, "bench", "serve", "--http", "--json", "--model", str(model),
                        "--num-prompts", "8", "--output-len", "4", "--max-concurrency", "4",
                        "--min-prompt-len", "8", "--max-prompt-len", "32", "--rounds", "1",
                        "--engine-args", ENGINE],
                       capture_output=True, text=True, timeout=300, cwd=ROOT, env=env())
    assert p.returncode == 0, p.stderr
    out = json.loads(p.stdout)
    rows = {r["case"]: r for r in out["results"]}
    for t in ("zmq", "http"):
        r = rows[t]
        assert r["requests"] == r["completed"] == 8, r
        assert r["first_errors"] == []
        assert r["output_tok_per_s"] == pytest.approx(8 * 4 / r["duration_s"])
        assert 0 < r["ttft_p50_ms"] <= r["ttft_p99_ms"]
        assert len(r["round_output_tok_per_s"]) == 1
        assert {"client", "pl-gateway", "pl-http", "pl-worker0"} <= set(r["cpu_cores"])
    ratio = rows["http/zmq"]
    assert ratio["ttft_p50_ratio"] == round(rows["http"]["ttft_p50_ms"] / rows["zmq"]["ttft_p50_ms"], 4)
    assert ratio["output_tok_per_s_ratio"] == round(
        rows["http"]["output_tok_per_s"] / rows["zmq"]["output_tok_per_s"], 4)
    run = rows["run"]
    assert run["order"] == "zmq http" and run["daemon_exit_code"] == 0
    assert shm_entries(f"{run['daemon_pid']:x}") == []
    targets = {t["name"]: t for t in out["targets"]}
    assert targets["HTTP/ZMQ TTFT p50 at 4 streams"]["goal"] == "<= 1.10"
    assert targets["HTTP/ZMQ output tok/s at 4 streams"]["goal"] == ">= 0.95"
    assert all(math.isfinite(t["measured"]) for t in out["targets"])
    assert targets["zmq: all requests completed"]["met"] and targets["http: all requests completed"]["met"]


@pytest.mark.parametrize("argv, message", [
    (["--http", "--rounds", "0"], "--rounds must be >= 1, got 0"),
    (["--http-url", "http://127.0.0.1:1"], "--address and --http-url go together"),
    (["--address", "tcp://127.0.0.1:1", "--http-url", "127.0.0.1:1"], "--http-url must start with http://"),
    (["--http", "--num-prompts", "0"], "--num-prompts must be >= 1, got 0"),
    (["--http", "--max-concurrency", "-1"], "--max-concurrency must be >= 0, got -1"),
])
def test_bad_flags_name_the_flag_and_limit(argv, message, capsys):
    p = argparse.ArgumentParser()
    serve.add_args(p)
    p.add_argument("--json", action="store_true")
    assert serve.main(p.parse_args(argv)) == 2
    assert message in capsys.readouterr().err


def test_http_mode_defaults():
    p = argparse.ArgumentParser()
    serve.add_args(p)
    args = p.parse_args(["--http"])
    serve.check_args(args, http=True)
    assert (args.num_prompts, args.max_concurrency, args.output_len) == (256, 64, 64)
    args = p.parse_args([])
    serve.check_args(args, http=False)
    assert (args.num_prompts, args.max_concurrency) == (200, 0)
