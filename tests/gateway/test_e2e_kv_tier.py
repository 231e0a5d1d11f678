"""End to end: the KV disk tier (``--kv-offload-dir``) in the stage pipeline, where the cache
messager process moves blocks between the worker's pool and the files and the engine's
connector loads hits beyond the pool's.

`pipeline run` twice on one tier directory, with a KV pool far smaller than the prompts'
working set (so prefixes leave the pool and come back from disk, with preemptions): the
answers equal the in-process engine's without a tier, token for token; the second run (a
restart) takes prompt tokens from the tier, counted in its stats; the directory stays within
its budget; nothing is left in /dev/shm (``pipe`` checks). Bad tier flags are refused before anything starts,
naming the flag.
"""
from __future__ import annotations

import json
import os
import subprocess

import pytest
from e2e_helpers import ENGINE_FLAGS, PIPELINE, ROOT, env, make_tiny_model
from test_e2e_pipe import pipe as run_pipe

NUM_BLOCKS = 24  # of 16 tokens: 8 prefixes of 80 tokens alone take 40
PREFIXES = [f"Chapter {p}: " + " ".join(f"w{p}x{k}" for k in range(30)) for p in range(8)]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.getbasetemp() / "e2e-tiny")


def requests(round_: int) -> list[dict]:
    return [{"id": f"r{round_}-{p}-{s}", "prompt": f"{PREFIXES[p]} question {s + round_}",
             "max_tokens": 12, "temperature": 0, "ignore_eos": True}
            for s in range(3) for p in range(8)]


def reference(model, reqs: list[dict]) -> dict[str, list[int]]:
    from pipeline.llm import LLM

    with LLM(str(model), device="cpu", dtype="float32", max_num_seqs=32, max_model_len=256) as llm:
        outs = llm.generate([{k: v for k, v in r.items() if k != "id"} for r in reqs])
    return {r["id"]: list(o.outputs[0].token_ids) for r, o in zip(reqs, outs)}


def tier_run(model, tier, stats, reqs: list[dict], *flags: str) -> tuple[dict[str, list[int]], dict]:
    rc, answers, err = run_pipe(model, [json.dumps(r) for r in reqs], "--num-blocks", str(NUM_BLOCKS),
                                "--kv-offload-dir", str(tier), "--kv-offload-size", "64MiB",
                                "--stats-json", str(stats), *flags)
    assert rc == 0, err
    got = {a["id"]: a["token_ids"] for a in answers if "finish_reason" in a}
    return got, json.loads(stats.read_text())


def test_tier_answers_equal_the_engine_without_it_across_a_restart(model, tmp_path):
    tier = tmp_path / "tier"
    first, second = requests(0), requests(1)
    want = reference(model, first + second)
    got1, st1 = tier_run(model, tier, tmp_path / "s1.json", first)
    assert got1 == {k: want[k] for k in got1} and len(got1) == len(first)
    eng1 = st1["engine"] if "engine" in st1 else st1
    assert eng1["kv_tier_saved_blocks"] > 0 and eng1["num_preemptions"] + eng1["num_evictions"] > 0
    # A restart: the pool is empty, the prefixes are on disk.
    got2, st2 = tier_run(model, tier, tmp_path / "s2.json", second)
    assert got2 == {k: want[k] for k in got2} and len(got2) == len(second)
    eng2 = st2["engine"] if "engine" in st2 else st2
    assert eng2["kv_tier_loaded_tokens"] >= 8 * 16, eng2  # every prefix's first block at least
    assert eng2["kv_tier_failed_blocks"] == 0
    files = [f for d, _, fs in os.walk(tier) for f in fs if not f.startswith(".")]
    assert files and sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(tier)
                         for f in fs if not f.startswith(".")) <= 64 << 20


def test_two_ranks_share_the_tier_as_one_pool(model, tmp_path):
    """--tensor-parallel-size 2: the ranks share one KV segment, every rank's part of a block
    in one file; a restart loads both ranks' KV (a missing half would change the tokens)."""
    tier, tp = tmp_path / "tier", ("--tensor-parallel-size", "2", "--worker-threads", "1")
    first, second = requests(0)[:8], requests(1)[:8]
    want = reference(model, first + second)
    got1, st1 = tier_run(model, tier, tmp_path / "s1.json", first, *tp)
    assert got1 == {k: want[k] for k in got1} and len(got1) == len(first)
    got2, st2 = tier_run(model, tier, tmp_path / "s2.json", second, *tp)
    assert got2 == {k: want[k] for k in got2} and len(got2) == len(second)
    eng2 = st2["engine"] if "engine" in st2 else st2
    assert eng2["kv_tier_loaded_tokens"] >= 8 * 16 and eng2["kv_tier_failed_blocks"] == 0, eng2


@pytest.mark.parametrize("flags, needle", [
    (["--kv-offload-size", "1GiB"], "--kv-offload-size"),
    (["--kv-offload-dir", "{tier}", "--kv-offload-size", "lots"], "--kv-offload-size"),
    (["--kv-offload-dir", "{tier}", "--no-prefix-caching"], "prefix caching"),
    (["--kv-offload-host", "1GiB"], "--kv-offload-host"),
])
def test_bad_tier_flags_are_refused_naming_the_flag(model, tmp_path, flags, needle):
    flags = [f.replace("{tier}", str(tmp_path / "tier")) for f in flags]
    p = subprocess.run([*PIPELINE, "run", "--model", str(model), *ENGINE_FLAGS, *flags],
                       input="hello\n", capture_output=True, text=True, timeout=120, cwd=ROOT, env=env())
    assert p.returncode != 0 and needle in p.stderr, p.stderr[-2000:]
    assert "Traceback" not in p.stderr


def test_instances_on_one_directory_report_one_tier_group(model, tmp_path):
    """The router's tier siblings (docs/router.md): an instance with a tier reports
    ``kv_tier_group`` in its stats, the same for every instance on the directory (here a
    `pipeline run`'s engine stage and an in-process LLM of the same model) and another for
    another directory; it is not the directory's hash key; no tier, no group."""
    from pipeline.engine.kv_connector.tier_index import HASH_KEY_FILE
    from pipeline.llm import LLM

    one, other = tmp_path / "one", tmp_path / "other"
    _, st = tier_run(model, one, tmp_path / "s.json", requests(0)[:1])
    group = st["kv_tier_group"]
    kw = {"device": "cpu", "dtype": "float32", "max_num_seqs": 4, "max_model_len": 256, "num_blocks": 32}
    with LLM(str(model), kv_offload_dir=str(one), **kw) as llm:
        assert llm.stats()["kv_tier_group"] == group
    with LLM(str(model), kv_offload_dir=str(other), **kw) as llm:
        assert llm.stats()["kv_tier_group"] not in ("", group)
    with LLM(str(model), **kw) as llm:
        assert llm.stats()["kv_tier_group"] == ""
    assert len(group) == 32 and group not in (one / HASH_KEY_FILE).read_bytes().hex()
