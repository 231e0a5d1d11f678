"""`pipeline bench pd` target (4) at a tiny size, on real processes: a mixed `pipeline serve`,
then `--role prefill` + `--role decode` behind `pipeline router`, both driven by the same
workload. Checks the figures' shape, that every request succeeded with all its tokens, and
that every process exited 0 leaving nothing in /dev/shm. No timing asserts: timing claims
come only from the bench's own output.
"""
from __future__ import annotations

import argparse
import math

import pytest

from pipeline.bench import pd_load

TINY = ["--load-decoders", "2", "--load-decode-len", "16", "--load-long-prompts", "2",
        "--load-long-interval", "0.3", "--load-batched-tokens", "32", "--load-rounds", "1",
        "--load-engine-args", "--dtype float32 --max-num-seqs 16 --num-blocks 256"]
FIGURES = ("itl_p50_ms", "itl_p99_ms", "itl_max_ms", "ttft_long_p50_ms", "ttft_long_p99_ms",
           "ttft_decoder_p50_ms", "ttft_decoder_p99_ms", "duration_s")


def parse(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    pd_load.add_args(p)
    return p.parse_args(list(argv))


def test_tiny_run_both_setups():
    res = pd_load.itl_under_long_prompts(parse(*TINY))
    assert set(res["mixed"]["exit_codes"]) == {"mixed"}
    assert set(res["pd"]["exit_codes"]) == {"router", "prefill", "decode"}
    for setup in ("mixed", "pd"):
        r = res[setup]
        assert all(code == 0 for code in r["exit_codes"].values()), r["exit_codes"]
        assert r["leftovers"] == []
        assert r["failed"] == 0 and r["short_answers"] == 0, r
        assert r["long_requests"] == 2 and r["decoder_requests"] >= 2
        assert r["itl_gaps"] > 0 and len(r["itl_p99_ms_rounds"]) == 1
        for key in FIGURES:
            assert isinstance(r[key], float) and r[key] > 0, (setup, key, r[key])
    for key in ("itl_p99_ratio", "itl_p50_ratio", "ttft_long_p50_ratio", "ttft_decoder_p50_ratio"):
        assert math.isfinite(res[key]) and res[key] > 0
    assert res["itl_p99_ratio"] == round(res["pd"]["itl_p99_ms"] / res["mixed"]["itl_p99_ms"], 3)
    assert "prefill 1 + decode 1" in res["cpu_budget"]
    assert res["workload"]["long_prompt_tokens"] == 128


@pytest.mark.parametrize("argv, names", [
    (["--load-long-max-tokens", "1"], "--load-long-max-tokens must be in [2, 4], got 1"),
    (["--load-worker-threads", "1"], "--load-worker-threads must be >= 2, got 1"),
    (["--load-decoders", "0"], "--load-decoders must be >= 1, got 0"),
    (["--load-rounds", "0"], "--load-rounds must be >= 1, got 0"),
    (["--load-long-interval", "0"], "--load-long-interval must be > 0 s"),
    (["--load-batched-tokens", "1024"], "--load-batched-tokens must be <= 511"),
])
def test_bad_flags_name_the_flag_and_limit(argv, names):
    with pytest.raises(ValueError, match=names.replace("[", r"\[").replace("]", r"\]")):
        pd_load.itl_under_long_prompts(parse(*argv))
