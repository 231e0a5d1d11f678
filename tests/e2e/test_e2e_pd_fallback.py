"""End to end, `pipeline serve --role prefill --pd-fallback none|local` on real processes: a
decode instance D, prefill instances with and without the fallback, and one mixed daemon as
the oracle. The test plays the router with a raw DEALER (the router's own side is in
tests/router/test_router_pd.py): it reserves on D, then sends the prefill instance the prefill leg
with the client's sampling params and a KV destination that cannot take the KV:
- a tcp port nothing listens on (the prefill side cannot reach its decode peer at all);
- D's real endpoint, with remote block ids beyond D's pool (the writes are refused).
With --pd-fallback local the prefill instance decodes the request itself: its answer equals
the mixed instance's; D learns it (error code "kv_fallback") when the prefill side can still
reach it, and frees the reservation. Without the fallback the prefill request fails
(kv_transfer_failed).
"""
from __future__ import annotations

import asyncio
import random

import pytest
import zmq
from e2e_helpers import Daemon, free_port, make_tiny_model, shm_entries, wait_for

from pipeline.client import Client
from pipeline.client.async_client import AsyncClient
from pipeline.frontend import protocol as P
from pipeline.messages import RequestResult
from pipeline.messages.kv import KVReservation, KVTransferParams

# Long prompts run in several steps. One worker thread each: four instances share the
# machine's cores, and the failure test needs the prefill messager's report to arrive while the
# prompt's later chunks still run (an adaptive team of every core per instance starves the
# messagers on two cores; a failure reported after the first token cannot fail the request).
CHUNKED = ["--max-num-batched-tokens", "32", "--worker-threads", "1"]
GREEDY = {"max_tokens": 8, "temperature": 0.0, "ignore_eos": True}
D_TIMEOUT_S = 5.0  # D's reservations (and the quarantine of an aborted one: at most this)
WAIT_S = 60


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.getbasetemp() / "e2e-tiny")


@pytest.fixture(scope="module")
def cluster(model):
    """(mixed oracle, D, P with --pd-fallback local, P without), started side by side."""
    daemons = {
        "mixed": Daemon(model, *CHUNKED),
        "dec": Daemon(model, "--role", "decode", "--kv-listen", f"tcp://127.0.0.1:{free_port()}",
                      "--worker-threads", "1",
                      "--kv-transfer-timeout", str(D_TIMEOUT_S)),
        # --kv-transfer-timeout bounds the prefill messager's handshake with a dead peer.
        "local": Daemon(model, "--role", "prefill", "--kv-transfer", "tcp", "--pd-fallback", "local",
                        "--kv-transfer-timeout", "2", *CHUNKED),
        "none": Daemon(model, "--role", "prefill", "--kv-transfer", "tcp",
                       "--kv-transfer-timeout", "2", *CHUNKED),
    }
    try:
        for d in daemons.values():
            d.wait_ready()
        yield daemons
    finally:
        codes = {name: d.stop() for name, d in daemons.items()}
        assert codes == dict.fromkeys(daemons, 0), codes
        for d in daemons.values():
            assert shm_entries(d.instance_id) == []


@pytest.fixture(scope="module")
def vocab(model) -> int:
    import json
    return json.loads((model / "config.json").read_text())["vocab_size"]


def stats(d: Daemon) -> dict:
    with Client(d.address, timeout=10) as c:
        return c.stats()


def oracle(mixed: Daemon, ids: list[list[int]]) -> list[list[int]]:
    async def run() -> list[RequestResult]:
        async with AsyncClient(mixed.address, timeout=120) as c:
            return await asyncio.gather(*(c.generate(prompt_token_ids=p, **GREEDY) for p in ids))
    out = asyncio.run(run())
    assert [r.error for r in out] == [None] * len(ids)
    return [r.token_ids for r in out]


class Leg:
    """One instance, spoken to as the router does: streamed generates, their answers."""

    def __init__(self, ctx: zmq.Context, address: str) -> None:
        self.sock = ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(address)

    def send(self, msg) -> None:
        self.sock.send(P.encode(msg))

    def recv(self):
        """The next answer, skipping the instance's liveness pings."""
        while True:
            assert self.sock.poll(WAIT_S * 1000), "no answer from the instance"
            msg = P.decode_reply(self.sock.recv())
            if not isinstance(msg, P.Ping):
                return msg

    def reserve(self, rid: str, prompt: list[int]) -> KVReservation:
        self.send(P.Generate(id=rid, prompt_token_ids=prompt, stream=True, **GREEDY,
                             kv_transfer=KVTransferParams(role="decode")))
        msg = self.recv()
        assert isinstance(msg, P.Delta) and msg.delta.kv is not None, msg
        return msg.delta.kv

    def until_final(self) -> tuple[list[int], RequestResult]:
        """The streamed token ids and the final of the one request in flight."""
        toks: list[int] = []
        while not isinstance(msg := self.recv(), P.Final):
            assert isinstance(msg, P.Delta), msg
            toks += msg.delta.token_ids
        return toks, msg.result


def prefill_leg(rid: str, prompt: list[int], kv: KVReservation, peer: str,
                block_offset: int = 0) -> P.Generate:
    """What the router sends a prefill instance: the client's params, where the KV goes."""
    return P.Generate(id=rid, prompt_token_ids=prompt, stream=True, **GREEDY,
                      kv_transfer=KVTransferParams(
                          role="prefill", peer=peer, remote_req_id=kv.engine_req_id,
                          remote_block_ids=[b + block_offset for b in kv.block_ids],
                          remote_num_cached_tokens=kv.num_cached_tokens, deadline_s=kv.timeout_s))


def some_prompts(vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    # one step, two steps, six steps of 32 tokens
    return [[rng.randrange(3, vocab) for _ in range(n)] for n in (11, 45, 170)]


def all_free(d: Daemon, prefill: bool) -> bool:
    s = stats(d)
    held = s["kv_transfer_leased_blocks"] if prefill else s["kv_reserved_blocks"]
    return s["kv_blocks_used"] == 0 and held == 0


def test_local_fallback_decodes_when_the_decode_peer_is_unreachable(cluster, vocab):
    dead = f"tcp://127.0.0.1:{free_port()}"  # nothing listens there
    ids = some_prompts(vocab, seed=1)
    want = oracle(cluster["mixed"], ids)
    ctx = zmq.Context()
    dec, pre = Leg(ctx, cluster["dec"].address), Leg(ctx, cluster["local"].address)
    try:
        for i, prompt in enumerate(ids):
            kv = dec.reserve(f"d{i}", prompt)
            pre.send(prefill_leg(f"p{i}", prompt, kv, dead))
            toks, final = pre.until_final()
            assert final.error is None, final.error
            assert toks == final.token_ids == want[i]
            assert final.finish_reason == "length" and final.usage.completion_tokens == GREEDY["max_tokens"]
            # The router, seeing P decode, aborts D's half (its KV can never come).
            dec.send(P.Abort(id=f"d{i}"))
            _, dfinal = dec.until_final()
            assert dfinal.finish_reason == "abort", dfinal
    finally:
        dec.sock.close()
        pre.sock.close()
        ctx.term()
    assert stats(cluster["local"])["kv_transfers_failed"] >= len(ids)
    wait_for(lambda: all_free(cluster["local"], prefill=True), "the prefill side to free its blocks", WAIT_S)
    # D's aborted reservations stay quarantined until their deadline (their writer is gone).
    wait_for(lambda: all_free(cluster["dec"], prefill=False), "the decode side to free its blocks", WAIT_S)


def test_local_fallback_tells_a_reachable_decode_peer_kv_fallback(cluster, vocab):
    """D's endpoint is live but refuses the writes (block ids beyond its pool): P decodes,
    and its done message makes D fail its half with kv_fallback and free the reservation."""
    ids = some_prompts(vocab, seed=2)
    want = oracle(cluster["mixed"], ids)
    num_blocks = stats(cluster["dec"])["kv_blocks_total"]
    ctx = zmq.Context()
    dec, pre = Leg(ctx, cluster["dec"].address), Leg(ctx, cluster["local"].address)
    try:
        for i, prompt in enumerate(ids):
            kv = dec.reserve(f"e{i}", prompt)
            pre.send(prefill_leg(f"q{i}", prompt, kv, kv.endpoint, block_offset=num_blocks))
            toks, final = pre.until_final()
            assert final.error is None, final.error
            assert toks == final.token_ids == want[i]
            dtoks, dfinal = dec.until_final()
            assert dtoks == [] and dfinal.error is not None, dfinal
            assert dfinal.error.code == "kv_fallback", dfinal.error
            assert "--pd-fallback local" in dfinal.error.message
    finally:
        dec.sock.close()
        pre.sock.close()
        ctx.term()
    # No quarantine: the done message came, so nothing more can be written.
    wait_for(lambda: all_free(cluster["dec"], prefill=False), "the decode side to free its blocks", 10)
    wait_for(lambda: all_free(cluster["local"], prefill=True), "the prefill side to free its blocks", 10)


def test_without_fallback_the_prefill_request_fails(cluster, vocab):
    """A long prompt (six steps) whose KV cannot be written. Which comes first on P, the
    messager's report of the failed write or the last chunk's first token, is up to the two
    processes' speed, and both orders are specified (each is tested deterministically in
    tests/engine/test_engine_disagg.py): the failure first fails P's request
    (kv_transfer_failed; after its first token if that was sampled while P waited for the
    report, which it does toward a peer no transfer reached yet); the first token first, to a
    proven peer, ends it normally (one token, "length"), and the later failure only reaches D.
    Either way D fails its half with kv_transfer_failed, which through the router is the
    client's final (after P's first token, if it went out), and both instances free every
    block."""
    prompt = some_prompts(vocab, seed=3)[2]
    num_blocks = stats(cluster["dec"])["kv_blocks_total"]
    ctx = zmq.Context()
    dec, pre = Leg(ctx, cluster["dec"].address), Leg(ctx, cluster["none"].address)
    try:
        kv = dec.reserve("f0", prompt)
        pre.send(prefill_leg("r0", prompt, kv, kv.endpoint, block_offset=num_blocks))
        toks, final = pre.until_final()
        if final.error is not None:  # the failed report came first
            assert len(toks) <= 1 and final.error.code == "kv_transfer_failed", final
        else:  # the first token came first: P's request ended with it, as a sent one does
            assert len(toks) == 1 and final.finish_reason == "length", final
        _, dfinal = dec.until_final()
        assert dfinal.error is not None and dfinal.error.code == "kv_transfer_failed", dfinal
    finally:
        dec.sock.close()
        pre.sock.close()
        ctx.term()
    wait_for(lambda: all_free(cluster["dec"], prefill=False), "the decode side to free its blocks", 10)
    wait_for(lambda: all_free(cluster["none"], prefill=True), "the prefill side to free its blocks", 10)


def test_pd_fallback_is_refused_off_a_prefill_instance(model):
    import subprocess

    from e2e_helpers import PIPELINE, ROOT, env
    p = subprocess.run([*PIPELINE, "serve", "--model", str(model), "--role", "decode",
                        "--pd-fallback", "local"], capture_output=True, text=True, cwd=ROOT,
                       env=env(), timeout=60)
    assert p.returncode != 0
    assert "--pd-fallback is for --role prefill" in p.stderr + p.stdout
