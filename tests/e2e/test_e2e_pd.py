"""End to end, prefill/decode disaggregation on real processes: `pipeline serve --role prefill`
and `--role decode` daemons on the tiny model, `pipeline router --prefill/--decode` in front,
and one mixed daemon as the oracle. Nothing is mocked: the KV travels from the prefill
instance's worker through its cache messager into the decode instance's pool, over ipc
(same host, straight into the shared segment) and over tcp.

The SIGKILL tests run last, on clusters of their own.
"""
from __future__ import annotations

import asyncio
import os
import random
import signal
import time

import pytest
import zmq
from e2e_helpers import Daemon, RouterProc, free_port, make_tiny_model, shm_entries, wait_for
from e2e_helpers import pd_prompts as prompts

from pipeline.client import Client
from pipeline.client.async_client import AsyncClient
from pipeline.frontend import protocol as P
from pipeline.ipc.sweep import sweep_stale
from pipeline.messages import RequestResult
from pipeline.messages.kv import KVTransferParams

# The prefill side runs long prompts in many chunks (its budget is 32 tokens a step); the
# oracle runs with the same budget, so both compute the prompt's KV the same way.
CHUNKED = ["--max-num-batched-tokens", "32"]
GREEDY = {"max_tokens": 8, "temperature": 0.0, "ignore_eos": True}


class Router(RouterProc):
    """`pipeline router --prefill ... --decode ...` in a subprocess, with its log."""

    def __init__(self, prefill: list[str], decode: list[str]) -> None:
        super().__init__("--prefill", *prefill, "--decode", *decode)

    def wait_up(self, n: int, timeout: float = 60.0) -> None:
        wait_for(lambda: "serving on" in self.output() and sum(up(self).values()) == n,
                 f"{n} instances up behind the router", timeout)


def up(router: Router) -> dict[str, bool]:
    try:
        with Client(router.address, timeout=5) as c:
            return {a: i["up"] for a, i in c.health().detail["instances"].items()}
    except (TimeoutError, ConnectionError):
        return {}


def stats(d: Daemon) -> dict:
    with Client(d.address, timeout=10) as c:
        return c.stats()


async def _generate(address: str, ids: list[list[int]], **kw) -> list[RequestResult]:
    async with AsyncClient(address, timeout=180) as c:
        return await asyncio.gather(*(c.generate(prompt_token_ids=p, **kw) for p in ids))


def generate(address: str, ids: list[list[int]], **kw) -> list[RequestResult]:
    return asyncio.run(_generate(address, ids, **kw))


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.getbasetemp() / "e2e-tiny")


@pytest.fixture(scope="module")
def vocab(model) -> int:
    import json
    return json.loads((model / "config.json").read_text())["vocab_size"]


@pytest.fixture(scope="module")
def mixed(model):
    d = Daemon(model, *CHUNKED)
    try:
        d.wait_ready()
        yield d
    finally:
        assert d.stop() == 0
        assert shm_entries(d.instance_id) == []


def start_pair(model, transfer: str, *decode_flags: str) -> tuple[Daemon, Daemon, Router]:
    listen = ["--kv-listen", f"tcp://127.0.0.1:{free_port()}"] if transfer == "tcp" else []
    dec = Daemon(model, "--role", "decode", *listen, *decode_flags)
    pre = Daemon(model, "--role", "prefill", "--kv-transfer", transfer, *CHUNKED)
    dec.wait_ready()
    pre.wait_ready()
    router = Router([pre.address], [dec.address])
    router.wait_up(2)
    return pre, dec, router


def stop_pair(pre: Daemon, dec: Daemon, router: Router) -> None:
    assert router.stop() == 0, router.output()
    for d in (pre, dec):
        if d.proc.poll() is None:
            assert d.stop() == 0, d.output()
        assert shm_entries(d.instance_id) == []


@pytest.fixture(scope="module", params=["ipc", "tcp"])
def pair(request, model):
    parts = start_pair(model, request.param)
    try:
        yield parts
    finally:
        stop_pair(*parts)


def test_greedy_through_a_pair_equals_one_mixed_instance(pair, mixed, vocab):
    pre, dec, router = pair
    ids = prompts(vocab)
    want = generate(mixed.address, ids, **GREEDY)
    assert [r.error for r in want] == [None] * len(ids)
    # Two waves: the second finds the first's prefixes cached on both sides.
    got = generate(router.address, ids[:32], **GREEDY) + generate(router.address, ids[32:], **GREEDY)
    assert [r.error for r in got] == [None] * len(ids), [r.error for r in got if r.error][:3]
    assert [r.token_ids for r in got] == [r.token_ids for r in want]
    assert [r.text for r in got] == [r.text for r in want]
    sp, sd = stats(pre), stats(dec)
    assert sp["prefix_cache_hit_tokens"] > 0 and sd["prefix_cache_hit_tokens"] > 0, (sp, sd)
    # Every block went back: nothing reserved, nothing leased, nothing running.
    wait_for(lambda: stats(dec)["kv_reserved_blocks"] == 0 and stats(dec)["kv_blocks_used"] == 0,
             "the decode instance to free every block")
    wait_for(lambda: stats(pre)["kv_transfer_leased_blocks"] == 0 and stats(pre)["kv_blocks_used"] == 0,
             "the prefill instance to release every lease")


def test_streaming_through_a_pair_sends_each_token_once(pair, mixed, vocab):
    _, _, router = pair
    ids = prompts(vocab, n=4, seed=1)
    want = generate(mixed.address, ids, **GREEDY)

    async def stream_one(c: AsyncClient, p: list[int]) -> tuple[list[int], str, RequestResult]:
        toks: list[int] = []
        text = ""
        final = None
        async for out in c.stream(prompt_token_ids=p, **GREEDY):
            if isinstance(out, RequestResult):
                final = out
            else:
                toks += out.token_ids
                text += out.text
        assert final is not None
        return toks, text, final

    async def run():
        async with AsyncClient(router.address, timeout=120) as c:
            return await asyncio.gather(*(stream_one(c, p) for p in ids))

    for (toks, text, final), w in zip(asyncio.run(run()), want, strict=True):
        assert final.error is None
        assert toks == final.token_ids == w.token_ids
        assert text == final.text == w.text


def test_abort_frees_both_sides(pair, vocab):
    pre, dec, router = pair
    ids = prompts(vocab, n=6, seed=2)
    # The decode engine is held (SIGSTOP) from the moment the client sees a request decode
    # until the aborts are out: a client the machine starves could otherwise see every
    # stream end (200 tokens) before its cancel runs.
    engine = dec.stage_pids()["engine"]
    held: list[bool] = []

    def hold() -> None:
        if not held:
            os.kill(engine, signal.SIGSTOP)
            held.append(True)

    async def run():
        async with AsyncClient(router.address, timeout=120) as c:
            decoding = asyncio.Event()
            tasks = [asyncio.create_task(_stream(c, p, decoding, hold)) for p in ids]
            await decoding.wait()  # one is decoding; the others are anywhere in the flow
            for t in tasks:
                t.cancel()  # the client aborts each on its way out
            try:
                return await asyncio.gather(*tasks, return_exceptions=True)
            finally:
                os.kill(engine, signal.SIGCONT)

    outcomes = asyncio.run(run())
    assert any(isinstance(o, asyncio.CancelledError) for o in outcomes)
    wait_for(lambda: stats(dec)["kv_blocks_used"] == 0 and stats(dec)["kv_reserved_blocks"] == 0,
             "the decode instance to free the aborted requests' blocks")
    wait_for(lambda: stats(pre)["kv_blocks_used"] == 0 and stats(pre)["kv_transfer_leased_blocks"] == 0,
             "the prefill instance to free the aborted requests' blocks")


def test_the_decode_side_speculates(model, mixed, vocab):
    """A decode instance with --speculative-config verifies drafts on the KV the prefill side
    sent: the answers are the mixed instance's, token for token."""
    spec = ('{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3, '
            '"cost_aware": false}')
    parts = start_pair(model, "ipc", "--speculative-config", spec)
    try:
        pre, dec, router = parts
        ids = prompts(vocab, n=8, seed=2)
        kw = {**GREEDY, "max_tokens": 32}
        want = generate(mixed.address, ids, **kw)
        got = generate(router.address, ids, **kw)
        assert [r.error for r in got] == [None] * len(ids)
        assert [r.token_ids for r in got] == [r.token_ids for r in want]
        sd = stats(dec)
        assert sd["spec_num_drafts"] > 0 and sd["spec_num_accepted_tokens"] > 0, sd
    finally:
        stop_pair(*parts)


def test_a_reservation_without_kv_times_out_and_frees_its_blocks(model):
    dec = Daemon(model, "--role", "decode", "--kv-transfer-timeout", "1")
    try:
        dec.wait_ready()
        ctx = zmq.Context()
        s = ctx.socket(zmq.DEALER)
        s.connect(dec.address)
        try:
            s.send(P.encode(P.Generate(id="r1", prompt_token_ids=list(range(3, 60)), stream=True,
                                       max_tokens=4, kv_transfer=KVTransferParams(role="decode"))))
            t0 = time.monotonic()
            reservation = final = None
            while final is None:
                assert s.poll(10_000), "no answer from the decode instance"
                msg = P.decode_reply(s.recv())
                if isinstance(msg, P.Delta) and msg.delta.kv is not None:
                    reservation = msg.delta.kv
                elif isinstance(msg, P.Final):
                    final = msg.result
            took = time.monotonic() - t0
        finally:
            s.close(linger=0)
            ctx.term()
        assert reservation is not None and len(reservation.block_ids) == -(-57 // 16)
        assert reservation.endpoint.startswith("ipc://")
        assert final.error is not None and final.error.code == "kv_transfer_timeout", final
        assert "--kv-transfer-timeout" in final.error.message
        assert 0.9 < took < 5.0, took
        assert stats(dec)["kv_reservation_timeouts"] == 1
        # Its blocks stay quarantined a while (a prefill might still be writing them), then go.
        wait_for(lambda: stats(dec)["kv_reserved_blocks"] == 0 and stats(dec)["kv_blocks_used"] == 0,
                 "the quarantine to end", 10)
    finally:
        assert dec.stop() == 0
    assert shm_entries(dec.instance_id) == []


def test_a_mixed_instance_refuses_kv_transfer(mixed):
    zctx = zmq.Context()
    s = zctx.socket(zmq.DEALER)
    s.connect(mixed.address)
    try:
        s.send(P.encode(P.Generate(id="x", prompt="hello", stream=True,
                                   kv_transfer=KVTransferParams(role="decode"))))
        while True:
            assert s.poll(10_000)
            msg = P.decode_reply(s.recv())
            if isinstance(msg, P.Final):
                break
    finally:
        s.close(linger=0)
        zctx.term()
    assert msg.result.error.code == "invalid_request"
    assert "kv_transfer" in msg.result.error.message and "mixed" in msg.result.error.message


# ---- failures on real processes (last: they kill instances) ----

async def _stream(c: AsyncClient, p: list[int], decoding: asyncio.Event | None = None, on_decoding=None):
    """A long request; sets `decoding` (after calling ``on_decoding``) once two tokens
    arrived (the second is the decode instance's: its KV is there); returns (final, when)."""
    n = 0
    async for out in c.stream(prompt_token_ids=p, max_tokens=200, ignore_eos=True, temperature=0.0):
        if isinstance(out, RequestResult):
            return out, time.monotonic()
        n += len(out.token_ids)
        if decoding is not None and n >= 2:
            if on_decoding is not None:
                on_decoding()
            decoding.set()
    raise AssertionError("stream ended without a final")


def _inflight(router: Router, address: str) -> int:
    with Client(router.address, timeout=5) as c:
        return c.health().detail["instances"][address]["inflight"]


def _kill_under_load(router: Router, pre: Daemon, kill, ids: list[list[int]]):
    """Kill (``kill``) with every stage of the flow busy, whichever process the machine
    favours: ``ids[0]`` decoding on D, the rest routed to P and held there mid-flow by
    stopping P's engine (SIGSTOP) until the kill has landed. Returns ([(final, when)], killed)."""
    engine = pre.stage_pids()["engine"]

    async def run():
        async with AsyncClient(router.address, timeout=120) as c:
            decoding = asyncio.Event()
            first = asyncio.create_task(_stream(c, ids[0], decoding))
            await decoding.wait()
            os.kill(engine, signal.SIGSTOP)
            try:
                rest = [asyncio.create_task(_stream(c, p)) for p in ids[1:]]
                await asyncio.to_thread(wait_for, lambda: _inflight(router, pre.address) == len(rest),
                                        "the held requests routed to the prefill instance")
                kill()
                killed = time.monotonic()
            finally:
                try:
                    os.kill(engine, signal.SIGCONT)
                except ProcessLookupError:
                    pass  # killed with its instance
            return await asyncio.wait_for(asyncio.gather(first, *rest), 60), killed
    return asyncio.run(run())


@pytest.mark.parametrize("victim", ["decode", "prefill", "messager"])
def test_sigkill_under_load_answers_everything_and_frees_the_survivor(model, vocab, victim):
    pre, dec, router = start_pair(model, "ipc")
    try:
        rng = random.Random(3)
        ids = [[rng.randrange(3, vocab) for _ in range(rng.randrange(180, 220))] for _ in range(10)]
        if victim == "messager":  # the prefill instance's cache messager process alone
            dead, survivor = pre, dec
            pid = pre.stage_pids()["messager"]
            results, killed = _kill_under_load(router, pre, lambda: os.kill(pid, signal.SIGKILL), ids)
        else:
            dead, survivor = (dec, pre) if victim == "decode" else (pre, dec)
            results, killed = _kill_under_load(
                router, pre, lambda: os.killpg(dead.proc.pid, signal.SIGKILL), ids)
        # The held ones fail in every case (D lost, P lost, or P's messager lost before P
        # could ship their KV); the decoding one may have finished first. None waits on a
        # time-out.
        assert [r.error is not None for r, _ in results[1:]] == [True] * (len(ids) - 1), \
            [r.error for r, _ in results]
        failed = [(r, t) for r, t in results if r.error is not None]
        for r, t in failed:
            assert r.error.code in ("instance_failed", "stage_died", "kv_transfer_failed"), r.error
            assert t - killed < 5.0, (r.error, t - killed)
        # The survivor holds nothing for the dead peer.
        wait_for(lambda: stats(survivor)["kv_blocks_used"] == 0
                 and stats(survivor)["kv_reserved_blocks"] == 0
                 and stats(survivor)["kv_transfer_leased_blocks"] == 0,
                 "the surviving instance to free every block it held for the dead peer", 20)
        assert router.proc.poll() is None
        wait_for(lambda: up(router).get(dead.address) is False, "the router to mark it down")
    finally:
        assert router.stop() == 0, router.output()
        for d in (pre, dec):
            if d.proc.poll() is None:
                code = d.stop()
                assert d is dead or code == 0, d.output()
            else:
                d.log.close()
        sweep_stale()  # the killed instance's debris (a restart would sweep it too)
        assert shm_entries(pre.instance_id) == [] and shm_entries(dec.instance_id) == []
