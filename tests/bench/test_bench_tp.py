"""`pipeline bench tp` on a tiny checkpoint: every case for TP=1 and TP=2 in its JSON, with
the collective share of a step measured inside rank 0 (none at TP=1), and no KV segment left
in /dev/shm; a rank killed mid-run fails the bench with a message naming the rank, and the
segments it held are gone too. No timing asserts beyond "positive": figures come only from
the bench's own output."""
from __future__ import annotations

import json
import os
import signal
import subprocess

import psutil
import pytest
from e2e_helpers import PIPELINE, ROOT, env, make_tiny_model

BATCHES = (1, 2)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return str(make_tiny_model(tmp_path_factory.mktemp("bench-tp")))


def leftovers(pid: int) -> list[str]:
    """/dev/shm names of the instances the bench process ``pid`` made ("<pid>-<hex>")."""
    want = f"pipeline.{pid}-"
    return sorted(n for n in os.listdir("/dev/shm") if n.startswith((want, "sem." + want)))


def start(model: str, *flags: str) -> subprocess.Popen:
    return subprocess.Popen([*PIPELINE, "bench", "tp", "--model", model, *flags], cwd=ROOT, env=env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_tp1_and_tp2_every_case_and_the_collective_share(model):
    p = start(model, "--batch-sizes", ",".join(map(str, BATCHES)), "--decode-steps", "2",
              "--repeats", "1", "--prefill-tokens", "32", "--json")
    out, err = p.communicate(timeout=120)
    assert p.returncode == 0, err[-3000:]
    rep = json.loads(out)
    assert rep["machine"]["threads_per_rank_tp2"] == max(1, len(os.sched_getaffinity(0)) // 2)
    rows = {r["case"]: r for r in rep["results"]}
    assert list(rows) == [*(f"decode batch {b}" for b in BATCHES), "prefill 32 tokens (4 seqs)"]
    layers = rep["machine"]["num_layers"]
    for r in rows.values():
        assert r["step_ms_tp1"] > 0 and r["step_ms_tp2"] > 0, r
        assert r["speedup_tp2"] == pytest.approx(r["step_ms_tp1"] / r["step_ms_tp2"], rel=1e-6)
        assert r["collective_share_tp1"] == 0.0  # one rank: no group, nothing to time
        assert 0.0 < r["collective_share_tp2"] < 1.0, r
        assert 0.0 < r["min_rank_share_tp2"] <= r["collective_share_tp2"]
        assert r["speedup_excl_collectives_tp2"] == pytest.approx(
            r["step_ms_tp1"] / (r["step_ms_tp2"] * (1 - r["collective_share_tp2"])), rel=1e-6)
        # two all-reduces a layer, the embedding's, the logits' all-gather (greedy: no broadcast)
        assert r["collectives_per_step_tp2"] == 2 * layers + 2
    prefill = rows["prefill 32 tokens (4 seqs)"]
    for n in (1, 2):
        assert prefill[f"tok_s_tp{n}"] == pytest.approx(32 / (prefill[f"step_ms_tp{n}"] / 1e3), rel=1e-6)
    assert leftovers(p.pid) == []


def test_a_rank_killed_mid_run_fails_the_bench_naming_it(model):
    # Enough steps that the ranks are still decoding when one of them is killed.
    p = start(model, "--tp-sizes", "2", "--batch-sizes", "1,2,4", "--decode-steps", "100",
              "--repeats", "3", "--prefill-tokens", "32")
    try:
        assert p.stderr is not None
        loaded = 0
        for line in p.stderr:  # each rank prints its KV cache once it has made it
            loaded += line.count("kv cache:")
            if loaded >= 2:
                break
        assert loaded == 2, "the ranks never finished loading"
        assert any(".kv" in n for n in leftovers(p.pid)), leftovers(p.pid)  # the check below can fail
        ranks = [c for c in psutil.Process(p.pid).children()
                 if "spawn_main" in " ".join(c.cmdline()) and "resource_tracker" not in " ".join(c.cmdline())]
        assert len(ranks) == 2, [c.cmdline() for c in ranks]
        os.kill(ranks[-1].pid, signal.SIGKILL)
        try:
            _, err = p.communicate(timeout=60)
        except subprocess.TimeoutExpired:  # seen once in CI (2026-12-04): say what was left running
            try:
                tree: object = [(c.pid, c.status(), " ".join(c.cmdline())[:120])
                                for c in psutil.Process(p.pid).children(recursive=True)]
            except psutil.NoSuchProcess:
                tree = "the bench exited, but something it started still holds its stderr open"
            raise AssertionError(f"bench tp still running 60 s after its rank was killed: {tree}") from None
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    assert p.returncode != 0
    # the survivor's error (its collective lost the peer), naming the rank that died
    assert "bench tp: " in err and "exited with code -9 without a report" in err, err[-3000:]
    assert leftovers(p.pid) == []
