"""End to end: async scheduling (the engine stage's default in the mixed role) answers exactly
what the synchronous engine answers, on the real model and the real stage processes.

`pipeline run` (async: step N+1 scheduled while the worker runs step N) against the in-process
``pipeline.LLM`` (synchronous: Scheduler and ModelRunner in one thread), same checkpoint and
engine flags, with a KV pool so small that requests are preempted while they have steps in
flight. Greedy requests with and without EOS, max_tokens, stop strings and a stop token (taken
from the reference's own output, so they hit: the stop token ends the request in the engine,
as EOS does, while a step run ahead of it is out), seeded sampling and n > 1; every request
streams, and the
deltas must add up to the final answer exactly: no token computed ahead of a request's end is
ever streamed.
"""
from __future__ import annotations

import json

import pytest
from e2e_helpers import ENGINE_FLAGS, make_tiny_model, shm_entries
from test_e2e_pipe import pipe as run_pipe

NUM_BLOCKS = 20  # of 16 tokens: 20 requests of up to ~70 tokens need ~100


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.getbasetemp() / "e2e-tiny")  # one per session


def requests(stops: dict[str, str], stop_token: int | None = None) -> list[dict]:
    reqs: list[dict] = []
    for i in range(16):
        reqs.append({"id": f"g{i}", "prompt": f"Item {i}: the for statement " + "x " * (i % 5),
                     "max_tokens": 40 + (i * 7) % 25, "temperature": 0, "ignore_eos": i % 3 != 0})
    for rid, stop in stops.items():
        base = next(r for r in reqs if r["id"] == rid)
        reqs.append({**base, "id": f"{rid}-stop", "stop": [stop]})
    if stop_token is not None:
        reqs.append({**reqs[2], "id": "g2-stoptok", "stop_token_ids": [stop_token]})
    reqs.append({"id": "seeded", "prompt": "while loops", "max_tokens": 50, "temperature": 0.8,
                 "seed": 3, "ignore_eos": True})
    reqs.append({"id": "n2", "prompt": "the with statement", "max_tokens": 30, "n": 2,
                 "temperature": 1.0, "seed": 11, "ignore_eos": True})
    return reqs


def reference(model, reqs: list[dict]) -> dict[str, list[tuple[list[int], str, str | None]]]:
    from pipeline.llm import LLM

    flags = dict(zip(ENGINE_FLAGS[::2], ENGINE_FLAGS[1::2]))
    with LLM(str(model), device="cpu", dtype="float32", max_num_seqs=int(flags["--max-num-seqs"]),
             max_model_len=int(flags["--max-model-len"]), num_blocks=NUM_BLOCKS) as llm:
        outs = llm.generate([{k: v for k, v in r.items() if k != "id"} for r in reqs])
        assert llm.stats()["num_preemptions"] > 0
    assert shm_entries(llm.config.instance_id) == []
    return {r["id"]: [(list(c.token_ids), c.text, c.finish_reason) for c in o.outputs]
            for r, o in zip(reqs, outs)}


def test_async_pipeline_equals_the_sync_engine_token_for_token(model, tmp_path):
    first = reference(model, requests({}))
    # Stop strings from the middle of two greedy texts: they end those copies early.
    stops = {}
    for rid in ("g1", "g4"):
        toks, text, _ = first[rid][0]
        stops[rid] = text[len(text) // 2:len(text) // 2 + 4]
        assert stops[rid].strip(), text
    toks = first["g2"][0][0]
    reqs = requests(stops, toks[len(toks) // 2])
    want = {**first, **{k: v for k, v in reference(model, reqs).items() if "-stop" in k}}
    assert want["g2-stoptok"][0][2] == "stop" and len(want["g2-stoptok"][0][0]) <= len(toks) // 2 + 1
    stats_path = tmp_path / "stats.json"
    rc, answers, err = run_pipe(model, [json.dumps({**r, "stream": True}) for r in reqs],
                                "--num-blocks", str(NUM_BLOCKS), "--stats-json", str(stats_path))
    assert rc == 0, err
    finals = {a["id"]: a for a in answers if "finish_reason" in a}
    assert sorted(finals) == sorted(r["id"] for r in reqs)
    for r in reqs:
        rid, final = r["id"], finals[r["id"]]
        choices = final["outputs"] or [final]  # n > 1: one entry per completion
        got = [(c["token_ids"], c["text"], c["finish_reason"]) for c in choices]
        assert got == want[rid], rid
        for k, c in enumerate(choices):
            assert len(c["token_ids"]) <= r["max_tokens"], rid
            # Streamed deltas add up to the answer: no token past the end was ever sent.
            deltas = [d for d in answers if d["id"] == rid and "finish_reason" not in d
                      and d.get("index", 0) == k]
            assert [t for d in deltas for t in d["token_ids"]] == c["token_ids"], rid
        if rid.endswith("-stop"):
            assert final["finish_reason"] == "stop" and final["text"].find(stops[rid[:-5]]) == -1
    stats = json.loads(stats_path.read_text())
    assert stats["num_preemptions"] > 0 and stats["engine_steps"] > 0
