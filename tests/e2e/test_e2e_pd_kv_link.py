"""End to end, the KV link of prefill/decode disaggregation over tcp on real daemons, driven
as the router drives it (reserve on D, prefill on P into the reservation): with
--curve-keys it works, and a peer without the keys cannot write a block (issue 25 item 1: a
later request hitting the prefix cache keeps its greedy output); a decode instance restarted
on the same --kv-listen address serves the very next request (item 10: the prefill side's
cached link to the dead receiver is not used)."""
from __future__ import annotations

import msgspec
import pytest
import zmq
from e2e_helpers import Daemon, free_port, make_tiny_model, shm_entries
from zmq.utils.monitor import recv_monitor_message

from pipeline.cache.tcp import DATA, FLUSH, HELLO, Hello, KVHeader
from pipeline.frontend import protocol as P
from pipeline.ipc.curve import client_socket_setup, generate_keys
from pipeline.messages.kv import KVTransferParams
from pipeline.messages.kv_layout import KVLayout

GREEDY = {"max_tokens": 8, "temperature": 0.0, "ignore_eos": True}
PROMPT = list(range(3, 70))  # 67 tokens: 4 full blocks of 16 D keeps in its prefix cache
WAIT_MS = 120_000


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.getbasetemp() / "e2e-tiny")


def _socket(ctx: zmq.Context, d: Daemon) -> zmq.Socket:
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    if d.client_kw:
        client_socket_setup(s, d.client_kw["curve_keys_dir"])
    s.connect(d.address)
    return s


def _next(s: zmq.Socket, who: str):
    assert s.poll(WAIT_MS), f"no answer from the {who} instance"
    return P.decode_reply(s.recv())


def split(pre: Daemon, dec: Daemon, rid: str):
    """One request split as the router splits it; returns (D's final, the reservation)."""
    ctx = zmq.Context()
    d, p = _socket(ctx, dec), _socket(ctx, pre)
    try:
        d.send(P.encode(P.Generate(id=rid + ".d", prompt_token_ids=PROMPT, stream=True, **GREEDY,
                                   kv_transfer=KVTransferParams(role="decode"))))
        while not (isinstance(m := _next(d, "decode"), P.Delta) and m.delta.kv is not None):
            assert not isinstance(m, P.Final), m.result
        kv = m.delta.kv
        p.send(P.encode(P.Generate(
            id=rid + ".p", prompt_token_ids=PROMPT, stream=True, **GREEDY,
            kv_transfer=KVTransferParams(role="prefill", peer=kv.endpoint, remote_req_id=kv.engine_req_id,
                                         remote_block_ids=list(kv.block_ids),
                                         remote_num_cached_tokens=kv.num_cached_tokens,
                                         deadline_s=kv.timeout_s))))
        while not isinstance(m := _next(p, "prefill"), P.Final):
            pass
        assert m.result.error is None, m.result
        while not isinstance(m := _next(d, "decode"), P.Final):
            pass
        return m.result, kv
    finally:
        d.close()
        p.close()
        ctx.term()


def stop(*daemons: Daemon) -> None:
    for d in daemons:
        if d.proc.poll() is None:
            assert d.stop() == 0, d.output()
        assert shm_entries(d.instance_id) == []


def test_with_keys_pd_works_over_tcp_and_a_peer_without_them_writes_no_block(model, tmp_path):
    keys = generate_keys(tmp_path / "keys")
    kv_listen = f"tcp://127.0.0.1:{free_port()}"
    dec = Daemon(model, "--role", "decode", "--kv-listen", kv_listen, curve_keys=keys)
    pre = Daemon(model, "--role", "prefill", "--kv-transfer", "tcp", curve_keys=keys)
    try:
        dec.wait_ready()
        pre.wait_ready()
        first, kv = split(pre, dec, "r1")
        assert first.error is None and len(first.token_ids) == GREEDY["max_tokens"], first
        assert kv.endpoint == kv_listen
        # The poisoning, by a peer that knows everything but the keys: a handshake,
        # then every block of every layer (its layout is a guess: it is never parsed).
        ctx = zmq.Context()
        s = ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.LINGER, 0)
        mon = s.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_HANDSHAKE_FAILED_AUTH
                                   | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
                                   | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL)
        s.connect(kv.endpoint)
        try:
            guess = KVLayout(num_layers=2, num_blocks=64, block_size=16, num_kv_heads=2,
                             head_dim=16, dtype="float32")
            s.send_multipart([HELLO, msgspec.msgpack.encode(Hello(guess, ""))])
            for layer in range(guess.num_layers):
                s.send_multipart([DATA, msgspec.msgpack.encode(KVHeader(layer, 0, 64)),
                                  b"\x7f" * (64 * guess.block_bytes), b"\x7f" * (64 * guess.block_bytes)])
            s.send_multipart([FLUSH, msgspec.msgpack.encode(1)])
            assert mon.poll(WAIT_MS)
            assert recv_monitor_message(mon)["event"] != zmq.EVENT_HANDSHAKE_SUCCEEDED
            again, _ = split(pre, dec, "r2")  # a prefix-cache hit on D, then decoding
            assert s.poll(0) == 0  # never answered
        finally:
            mon.close()
            s.close()
            ctx.term()
        assert again.token_ids == first.token_ids
        assert "rejected a message" not in dec.output()  # nothing of it was even parsed
    finally:
        stop(pre, dec)


def test_a_decode_instance_restarted_on_the_same_address_serves_the_next_request(model):
    kv_listen = f"tcp://127.0.0.1:{free_port()}"
    dec = Daemon(model, "--role", "decode", "--kv-listen", kv_listen)
    pre = Daemon(model, "--role", "prefill", "--kv-transfer", "tcp")
    dec2 = None
    try:
        dec.wait_ready()
        pre.wait_ready()
        first, _ = split(pre, dec, "r1")
        assert first.error is None
        stop(dec)
        dec2 = Daemon(model, "--role", "decode", "--kv-listen", kv_listen)
        dec2.wait_ready()
        after, kv = split(pre, dec2, "r2")  # the very next request, over P's cached link
        assert kv.endpoint == kv_listen
        assert after.error is None, after.error
        assert after.token_ids == first.token_ids
    finally:
        stop(pre, *([dec2] if dec2 else []), dec)
