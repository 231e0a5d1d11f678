"""End to end, prefill/decode disaggregation with a KV disk tier on both sides: `pipeline
serve --role prefill|decode --kv-offload-dir DIR` daemons (one directory, as on one host)
behind `pipeline router`, next to a PD pair without a tier and a mixed daemon as oracles.

Greedy answers over prompts sharing long prefixes equal both oracles'. Then the tier pair
restarts on the same directory (empty pools, the prefixes on disk): the prefill instance
loads prompt blocks instead of computing them and the decode instance's reservations load
theirs, so the prefill side ships fewer (the tier load counters move on both sides), with the
same answers. Every daemon leaves /dev/shm clean.
"""
from __future__ import annotations

import random

import pytest
from e2e_helpers import Daemon, make_tiny_model, shm_entries, wait_for
from test_e2e_pd import CHUNKED, GREEDY, Router, generate, stats


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.getbasetemp() / "e2e-tiny")


@pytest.fixture(scope="module")
def vocab(model) -> int:
    import json
    return json.loads((model / "config.json").read_text())["vocab_size"]


def prompts(vocab: int, round_: int) -> list[list[int]]:
    """3 prefixes of 80 tokens (5 blocks), 4 prompts each with a suffix of its own."""
    rng = random.Random(7)
    prefixes = [[rng.randrange(3, vocab) for _ in range(80)] for _ in range(3)]
    rng = random.Random(100 + round_)
    return [p + [rng.randrange(3, vocab) for _ in range(rng.randrange(3, 30))]
            for _ in range(4) for p in prefixes]


def start_pair(model, *flags: str) -> tuple[Daemon, Daemon]:
    dec = Daemon(model, "--role", "decode", *flags)
    pre = Daemon(model, "--role", "prefill", *CHUNKED, *flags)
    return pre, dec


def stop(*daemons: Daemon | Router) -> None:
    for d in daemons:
        assert d.stop() == 0, d.output()
        if isinstance(d, Daemon):
            assert shm_entries(d.instance_id) == []


def saved(d: Daemon) -> bool:
    s = stats(d)
    return s["kv_tier_saving_blocks"] == 0 and s["kv_tier_deferred_blocks"] == 0


def test_pd_with_a_tier_equals_pd_without_and_mixed_and_loads_after_a_restart(model, vocab, tmp_path):
    tier = ("--kv-offload-dir", str(tmp_path / "tier"), "--kv-offload-size", "64MiB")
    mixed = Daemon(model, *CHUNKED)
    plain = start_pair(model)
    tiered = start_pair(model, *tier)
    routers: list[Router] = []
    try:
        for d in (mixed, *plain, *tiered):
            d.wait_ready()
        routers = [Router([p.address], [d.address]) for p, d in (plain, tiered)]
        for r in routers:
            r.wait_up(2)
        first, second = prompts(vocab, 0), prompts(vocab, 1)
        want = [r.token_ids for r in generate(mixed.address, first + second, **GREEDY)]
        got_plain = generate(routers[0].address, first, **GREEDY)
        got = generate(routers[1].address, first, **GREEDY)
        assert [r.error for r in got] == [None] * len(first), [r.error for r in got if r.error][:3]
        assert [r.token_ids for r in got] == [r.token_ids for r in got_plain] == want[:len(first)]
        pre, dec = tiered
        assert stats(pre)["kv_tier_saved_blocks"] > 0 and stats(dec)["kv_tier_saved_blocks"] > 0
        # Every save written before the restart (the messager drops queued ones at exit).
        for d in tiered:
            wait_for(lambda d=d: saved(d), f"{d.address}'s KV tier saves")
        stop(routers.pop(), *tiered)

        # A restart of the tiered pair on the same directory: its pools are empty.
        tiered = start_pair(model, *tier)
        for d in tiered:
            d.wait_ready()
        routers.append(Router([tiered[0].address], [tiered[1].address]))
        routers[-1].wait_up(2)
        got = generate(routers[-1].address, second, **GREEDY)
        assert [r.error for r in got] == [None] * len(second), [r.error for r in got if r.error][:3]
        assert [r.token_ids for r in got] == want[len(first):]
        sp, sd = stats(tiered[0]), stats(tiered[1])
        # Both sides loaded each prefix's blocks from disk (the first of each group at least).
        assert sp["kv_tier_loaded_tokens"] >= 3 * 64 and sp["kv_tier_failed_blocks"] == 0, sp
        assert sd["kv_tier_loaded_tokens"] >= 3 * 64 and sd["kv_tier_failed_blocks"] == 0, sd
        # The prefill side computed far less than the prompts (it loaded or hit the rest).
        assert sp["computed_tokens"] < sum(len(p) for p in second) // 2, sp
        wait_for(lambda: stats(tiered[1])["kv_reserved_blocks"] == 0
                 and stats(tiered[1])["kv_blocks_used"] == 0, "the decode instance to free every block")
        wait_for(lambda: stats(tiered[0])["kv_transfer_leased_blocks"] == 0
                 and stats(tiered[0])["kv_blocks_used"] == 0, "the prefill instance to free every block")
    finally:
        for r in routers:
            r.stop()
        for d in (mixed, *plain, *tiered):
            if d.proc.poll() is None:
                d.stop()
    for d in (mixed, *plain, *tiered):
        assert shm_entries(d.instance_id) == []
