"""Prefill/decode disaggregation with tensor parallelism: a prefill instance and a decode
instance of two CPU ranks each, behind `pipeline router`. The ranks of an instance share one
KV segment (worker/kv_cache.py) and publish every rank's layers on the one layer signal, so
the cache messager ships each rank's shard (over ipc and over tcp) into the decode instance's
ranks. Greedy outputs equal one mixed single-rank instance's; a decode instance of another
TP size is refused by the layout handshake, naming the fields, and the request fails with it.
"""
from __future__ import annotations

import asyncio
import random

import pytest
from e2e_helpers import Daemon, RouterProc, free_port, make_tiny_model, shm_entries, wait_for

from pipeline.client import Client
from pipeline.client.async_client import AsyncClient

CHUNKED = ["--max-num-batched-tokens", "32"]
TP2 = ["--tensor-parallel-size", "2", "--worker-threads", "1"]
GREEDY = {"max_tokens": 8, "temperature": 0.0, "ignore_eos": True}


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.getbasetemp() / "e2e-tiny")


def prompts(n: int = 16) -> list[list[int]]:
    rng = random.Random(5)
    shared = [rng.randrange(3, 2000) for _ in range(80)]
    return [(shared if i % 3 == 0 else []) + [rng.randrange(3, 2000) for _ in range(rng.randrange(5, 90))]
            for i in range(n)]


async def _generate(address: str, ids: list[list[int]], **kw):
    async with AsyncClient(address, timeout=180) as c:
        return await asyncio.gather(*(c.generate(prompt_token_ids=p, **kw) for p in ids))


def generate(address: str, ids: list[list[int]], **kw):
    return asyncio.run(_generate(address, ids, **kw))


def router_for(pre: Daemon, dec: Daemon) -> RouterProc:
    router = RouterProc("--prefill", pre.address, "--decode", dec.address)

    def up() -> bool:
        try:
            with Client(router.address, timeout=5) as c:
                return sum(i["up"] for i in c.health().detail["instances"].values()) == 2
        except (TimeoutError, ConnectionError):
            return False
    wait_for(lambda: "serving on" in router.output() and up(), "both instances up", 60)
    return router


@pytest.mark.parametrize("transfer", ["ipc", "tcp"])
def test_two_rank_prefill_and_decode_equal_one_mixed_rank(model, transfer):
    ids = prompts()
    mixed = Daemon(model, *CHUNKED)
    try:
        mixed.wait_ready()
        want = [list(r.token_ids) for r in generate(mixed.address, ids, **GREEDY)]
    finally:
        assert mixed.stop() == 0
    listen = ["--kv-listen", f"tcp://127.0.0.1:{free_port()}"] if transfer == "tcp" else []
    dec = Daemon(model, "--role", "decode", *TP2, *listen)
    pre = Daemon(model, "--role", "prefill", "--kv-transfer", transfer, *TP2, *CHUNKED)
    router = None
    try:
        dec.wait_ready()
        pre.wait_ready()
        router = router_for(pre, dec)
        got = generate(router.address, ids, **GREEDY)
        assert [r.error for r in got] == [None] * len(ids)
        assert [list(r.token_ids) for r in got] == want
        with Client(dec.address, timeout=10) as c:  # the decode side decoded them
            assert c.stats()["generation_tokens"] > 0
    finally:
        if router is not None:
            assert router.stop() == 0
        for d in (pre, dec):
            assert d.stop() == 0, d.output()
            assert shm_entries(d.instance_id) == []


def test_a_decode_instance_of_another_tp_size_is_refused_by_the_layout(model):
    dec = Daemon(model, "--role", "decode")  # one rank: half the KV pool's "layers"
    pre = Daemon(model, "--role", "prefill", "--kv-transfer", "ipc", *TP2, *CHUNKED)
    router = None
    try:
        dec.wait_ready()
        pre.wait_ready()
        router = router_for(pre, dec)
        res = generate(router.address, prompts(2), **GREEDY)
        for r in res:
            assert r.error is not None and "num_layers" in r.error.message, r.error
    finally:
        if router is not None:
            router.stop()
        for d in (pre, dec):
            d.stop()
            assert shm_entries(d.instance_id) == []
