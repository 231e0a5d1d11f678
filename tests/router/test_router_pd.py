"""`pipeline router --prefill ... --decode ...`: the router's per-request state machine for
disaggregated pools, tested exactly against scripted instances.

The router is the real one (``pipeline.router.server.Router``, its loop in a thread). Each
instance is a ``FakeInstance``: a ZMQ ROUTER socket in the test that speaks the daemon's wire
protocol, answers the router's health and stats probes by itself (as an instance of its role)
and hands every generate and abort to the test, which scripts the answers: the decode
instance's reservation delta, deltas and final; the prefill instance's first-token delta and
final. The client is a raw DEALER, so every frame the router sends it is seen. End-to-end
runs with real instances are in other tests.
"""
from __future__ import annotations

import subprocess
import time
from collections.abc import Iterator
from contextlib import ExitStack
from typing import Any

import msgspec
import pytest
from e2e_helpers import PIPELINE, ROOT, env, free_port
from router_fakes import (
    PROMPT,
    RESERVATION,
    WAIT_S,
    Cli,
    FakeInstance,
    delta,
    parse_router_args,
    result,
    run_router,
    wait_for,
)

from pipeline.frontend import protocol as P
from pipeline.messages import ErrorInfo, RequestDelta, RequestResult, error_result
from pipeline.messages.kv import KVTransferParams
from pipeline.router import server
from pipeline.router.args import check_args
from pipeline.router.pd import PDState
from pipeline.router.policy import PoolPolicy
from pipeline.router.server import Router


class Setup:
    def __init__(self, router: Router, prefill: list[FakeInstance], decode: list[FakeInstance]) -> None:
        self.router, self.prefill, self.decode = router, prefill, decode
        self.cli = Cli(router.args.listen)
        self.p, self.d = prefill[0], decode[0]

    def start_split(self, rid: str = "a", **kw: Any) -> tuple[P.Generate, P.Generate]:
        """A client generate up to the prefill instance running it: (D's request, P's)."""
        self.cli.send(P.Generate(id=rid, prompt=PROMPT, max_tokens=5, temperature=0.0, **kw))
        dg = self.d.expect(P.Generate)
        self.d.send(delta(dg.id, [], "", kv=RESERVATION))
        return dg, self.p.expect(P.Generate)

    def sync(self) -> None:
        """Everything the decode instance sent so far was handled: a request run whole on it
        (max_tokens=1) is answered after them, on the same connection, in order."""
        self.cli.send(P.Generate(id="sync", prompt="x", max_tokens=1))
        g = self.d.expect(P.Generate)
        assert g.kv_transfer is None
        self.d.send(P.Final(result=result(g.id, [1], "x")))
        msg = self.cli.recv()
        assert isinstance(msg, P.Final) and msg.result.id == "sync", msg

    def instance(self, address: str) -> dict[str, Any]:
        return self.cli.health().detail["instances"][address]


def pd_router(prefill: list[str], decode: list[str]):
    return run_router("--prefill", *prefill, "--decode", *decode)


@pytest.fixture
def pd() -> Iterator[Setup]:
    with ExitStack() as stack:
        p, d = FakeInstance("prefill"), FakeInstance("decode")
        stack.callback(d.close)
        stack.callback(p.close)
        router = stack.enter_context(pd_router([p.address], [d.address]))
        s = Setup(router, [p], [d])
        stack.callback(lambda: s.cli.close())
        wait_for(lambda: s.cli.health().status == "ok", "both pools up")
        yield s


# ---- the split request ----

def test_streaming_client_gets_p_first_token_then_d_rest_without_duplication(pd):
    dg, pg = pd.start_split(stream=True)
    assert dg.id.endswith(".d") and dg.kv_transfer == KVTransferParams(role="decode")
    assert dg.stream and dg.max_tokens == 5 and dg.prompt == PROMPT and dg.temperature == 0.0
    assert pg.id.endswith(".p") and pg.id[:-2] == dg.id[:-2]
    # The client's own params: P's engine ends it after one token (unless it falls back).
    assert pg.max_tokens == 5 and pg.stream and pg.prompt == PROMPT and pg.temperature == 0.0
    assert pg.kv_transfer == KVTransferParams(
        role="prefill", peer=RESERVATION.endpoint, remote_req_id=RESERVATION.engine_req_id,
        remote_block_ids=RESERVATION.block_ids, remote_num_cached_tokens=RESERVATION.num_cached_tokens,
        deadline_s=RESERVATION.timeout_s)
    pd.p.send(delta(pg.id, [11], " Hi"))
    first = pd.cli.recv()  # at once: D has sent nothing since its reservation (never forwarded)
    assert isinstance(first, P.Delta) and first.delta == RequestDelta("a", " Hi", [11])
    pd.p.send(P.Final(result=result(pg.id, [11], " Hi")))
    final = result(dg.id, [11, 12, 13, 14], " Hi there!")
    for msg in (delta(dg.id, [11], ""),  # D holds the text back: nothing new for the client
                delta(dg.id, [12, 13], " Hi there"), delta(dg.id, [14], "!"), P.Final(result=final)):
        pd.d.send(msg)
    got = [first.delta]
    while not isinstance(msg := pd.cli.recv(), P.Final):
        assert isinstance(msg, P.Delta)
        got.append(msg.delta)
    assert [(x.token_ids, x.text) for x in got] == [([11], " Hi"), ([12, 13], " there"), ([14], "!")]
    assert msg.result == msgspec.structs.replace(final, id="a")
    assert "".join(x.text for x in got) == final.text
    assert [t for x in got for t in x.token_ids] == final.token_ids


def test_non_streaming_client_gets_only_the_decode_final(pd):
    dg, pg = pd.start_split(stream=False)
    assert dg.stream and pg.stream and pg.max_tokens == 5  # the legs stream regardless
    pd.p.send(delta(pg.id, [11], " Hi"))
    pd.p.send(P.Final(result=result(pg.id, [11], " Hi")))
    final = result(dg.id, [11, 12], " Hi there")
    for msg in (delta(dg.id, [11], " Hi"), delta(dg.id, [12], " there"), P.Final(result=final)):
        pd.d.send(msg)
    msg = pd.cli.recv()
    assert isinstance(msg, P.Final) and msg.result == msgspec.structs.replace(final, id="a")


@pytest.mark.parametrize("kw", [{"n": 2}, {"prompt_logprobs": 1}, {"max_tokens": 1}, {"logprobs": 2}])
def test_n_logprobs_and_one_token_run_whole_on_a_decode_instance(pd, kw):
    pd.cli.send(P.Generate(id="w", prompt=PROMPT, stream=True, **({"max_tokens": 4} | kw)))
    g = pd.d.expect(P.Generate)
    assert g.kv_transfer is None and "." not in g.id and g.stream
    assert all(getattr(g, k) == v for k, v in kw.items())
    pd.d.send(delta(g.id, [7], "x"))  # plain: forwarded as is
    pd.d.send(P.Final(result=result(g.id, [7], "x")))
    assert pd.cli.recv() == delta("w", [7], "x")
    assert pd.cli.recv() == P.Final(result=result("w", [7], "x"))
    assert pd.p.got.empty()


def test_prefill_error_is_the_final_and_aborts_decode(pd):
    dg, pg = pd.start_split(stream=True)
    err = error_result(pg.id, "kv_transfer_failed", "cannot reach tcp://127.0.0.1:7300")
    pd.p.send(P.Final(result=err))
    msg = pd.cli.recv()
    assert isinstance(msg, P.Final) and msg.result.id == "a"
    assert msg.result.error == ErrorInfo("kv_transfer_failed", "cannot reach tcp://127.0.0.1:7300")
    assert pd.d.expect(P.Abort).id == dg.id
    pd.d.send(P.Final(result=error_result(dg.id, "aborted", "aborted", finish_reason="abort")))
    pd.sync()  # D's own final after the abort is not a second final


def test_decode_error_before_prefill_ran_is_forwarded(pd):
    pd.cli.send(P.Generate(id="a", prompt=PROMPT, max_tokens=5, stream=True))
    dg = pd.d.expect(P.Generate)
    pd.d.send(P.Final(result=error_result(dg.id, "kv_transfer_timeout", "no KV in 30 s")))
    msg = pd.cli.recv()
    assert isinstance(msg, P.Final) and msg.result.error == ErrorInfo("kv_transfer_timeout", "no KV in 30 s")
    # and with the prefill running: that is aborted
    dg, pg = pd.start_split(rid="b", stream=True)
    pd.d.send(P.Final(result=error_result(dg.id, "kv_transfer_failed", "bad KV")))
    msg = pd.cli.recv()
    assert isinstance(msg, P.Final) and msg.result.id == "b" and msg.result.error.code == "kv_transfer_failed"
    assert pd.p.expect(P.Abort).id == pg.id
    assert pd.p.got.empty()


def test_client_abort_reaches_both_and_the_final_is_decodes(pd):
    dg, pg = pd.start_split(stream=True)
    pd.cli.send(P.Abort(id="a"))
    assert pd.d.expect(P.Abort).id == dg.id
    assert pd.p.expect(P.Abort).id == pg.id
    pd.p.send(P.Final(result=error_result(pg.id, "aborted", "by P", finish_reason="abort")))
    wait_for(lambda: pd.instance(pd.p.address)["inflight"] == 0, "P's final to be taken")
    final = error_result(dg.id, "aborted", "by D", finish_reason="abort")
    pd.d.send(P.Final(result=final))
    msg = pd.cli.recv()
    assert isinstance(msg, P.Final) and msg.result == msgspec.structs.replace(final, id="a")


def test_client_gone_aborts_both(pd):
    dg, pg = pd.start_split(stream=True)
    pd.cli.sock.close(linger=0)
    assert pd.d.expect(P.Abort).id == dg.id
    assert pd.p.expect(P.Abort).id == pg.id
    pd.cli = Cli(pd.router.args.listen)


def test_decode_instance_lost_fails_at_once_and_aborts_prefill(pd, monkeypatch):
    _, pg = pd.start_split(stream=True)
    t0 = time.monotonic()
    pd.d.close()
    msg = pd.cli.recv()
    assert time.monotonic() - t0 < 1.0
    assert isinstance(msg, P.Final) and msg.result.id == "a" and msg.result.error is not None
    assert msg.result.error.code == "instance_failed"
    assert f"decode instance {pd.d.address}" in msg.result.error.message
    assert pd.p.expect(P.Abort).id == pg.id
    assert pd.cli.health().status == "starting"  # no decode instance up
    # a new split request waits for a decode instance: then it is unavailable
    monkeypatch.setattr(server, "NO_INSTANCE_WAIT_S", 1.0)
    pd.cli.send(P.Generate(id="b", prompt=PROMPT, max_tokens=5))
    msg = pd.cli.recv(timeout=10)
    assert msg.result.error.code == "unavailable" and "no decode instance" in msg.result.error.message


def test_prefill_lost_before_its_final_fails_and_aborts_decode(pd):
    dg, _ = pd.start_split(stream=True)
    pd.p.close()
    msg = pd.cli.recv()
    assert isinstance(msg, P.Final) and msg.result.error.code == "instance_failed"
    assert f"prefill instance {pd.p.address}" in msg.result.error.message
    assert pd.d.expect(P.Abort).id == dg.id


def test_prefill_lost_once_decode_produced_a_token_does_not_fail_the_request(pd):
    dg, pg = pd.start_split(stream=False)
    pd.p.send(delta(pg.id, [11], " Hi"))
    pd.p.send(P.Final(result=result(pg.id, [11], " Hi")))
    # P's final alone is not enough: its messager tells D the KV is in after that.
    assert pd.instance(pd.p.address)["inflight"] == 1
    pd.d.send(delta(dg.id, [11], " Hi"))  # D decodes: the KV arrived
    wait_for(lambda: pd.instance(pd.p.address)["inflight"] == 0, "P's leg to be released")
    pd.p.close()
    wait_for(lambda: not pd.instance(pd.p.address)["up"], "the router to see P down")
    final = result(dg.id, [11, 12], " Hi there")
    pd.d.send(delta(dg.id, [12], " there"))
    pd.d.send(P.Final(result=final))
    msg = pd.cli.recv()
    assert isinstance(msg, P.Final) and msg.result == msgspec.structs.replace(final, id="a")
    assert pd.d.got.empty()  # no abort


def test_prefill_lost_after_its_final_before_decode_has_the_kv_fails_the_request(pd):
    dg, pg = pd.start_split(stream=False)
    pd.p.send(delta(pg.id, [11], " Hi"))
    pd.p.send(P.Final(result=result(pg.id, [11], " Hi")))
    pd.p.close()  # before its messager said "KV in" to D: D would wait for its time-out
    msg = pd.cli.recv()
    assert isinstance(msg, P.Final) and msg.result.error.code == "instance_failed"
    assert pd.d.expect(P.Abort).id == dg.id


# ---- a split request lost before its client got anything runs again (MAX_TRIES) ----

@pytest.fixture
def pools2() -> Iterator[Setup]:
    """Two prefill and two decode instances."""
    with ExitStack() as stack:
        ps, ds = [FakeInstance("prefill") for _ in range(2)], [FakeInstance("decode") for _ in range(2)]
        for inst in (*ps, *ds):
            stack.callback(inst.close)
        router = stack.enter_context(pd_router([p.address for p in ps], [d.address for d in ds]))
        s = Setup(router, ps, ds)
        stack.callback(lambda: s.cli.close())
        wait_for(lambda: all(v["up"] for v in s.cli.health().detail["instances"].values()), "all up")
        yield s


def first_generate(pool: list[FakeInstance]) -> tuple[FakeInstance, P.Generate]:
    """The instance of ``pool`` the router sent a generate to, and that generate."""
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        for inst in pool:
            if not inst.got.empty():
                return inst, inst.expect(P.Generate)
        time.sleep(0.01)
    raise AssertionError("no instance of the pool got the request")


def finish_split(s: Setup, d: FakeInstance, dg: P.Generate, p: FakeInstance, pg: P.Generate) -> P.Final:
    """P's first token and final, D's decode and final: the client's final."""
    p.send(delta(pg.id, [11], " Hi"))
    p.send(P.Final(result=result(pg.id, [11], " Hi")))
    d.send(delta(dg.id, [11, 12], " Hi there"))
    d.send(P.Final(result=result(dg.id, [11, 12], " Hi there")))
    while not isinstance(msg := s.cli.recv(), P.Final):
        assert not isinstance(msg, P.Error), msg
    return msg


@pytest.mark.parametrize("stream", [True, False])
def test_decode_instance_lost_before_the_first_token_runs_the_request_again(pools2, stream):
    s = pools2
    s.cli.send(P.Generate(id="a", prompt=PROMPT, max_tokens=5, temperature=0.0, stream=stream))
    d1, dg1 = first_generate(s.decode)
    d1.send(delta(dg1.id, [], "", kv=RESERVATION))
    p1, pg1 = first_generate(s.prefill)
    assert (dg1.id, pg1.id) == ("r1.d", "r1.p")
    d1.close()  # lost with the reservation, before P's first token
    assert p1.expect(P.Abort).id == pg1.id  # P stops writing into blocks that are gone
    d2 = next(d for d in s.decode if d is not d1)
    dg2 = d2.expect(P.Generate)
    assert dg2.id == "r1.2.d" and dg2.kv_transfer == KVTransferParams(role="decode")
    d2.send(delta(dg2.id, [], "", kv=RESERVATION))
    p2, pg2 = first_generate(s.prefill)
    assert pg2.id == "r1.2.p"  # a new id: the aborted "r1.p" may still run on that instance
    final = finish_split(s, d2, dg2, p2, pg2)
    assert final.result.id == "a" and final.result.error is None and final.result.token_ids == [11, 12]


def test_prefill_instance_lost_before_the_first_token_runs_it_again_then_gives_up(pools2):
    s = pools2
    s.cli.send(P.Generate(id="a", prompt=PROMPT, max_tokens=5, temperature=0.0, stream=True))
    d1, dg1 = first_generate(s.decode)
    d1.send(delta(dg1.id, [], "", kv=RESERVATION))
    p1, _ = first_generate(s.prefill)
    p1.close()
    assert d1.expect(P.Abort).id == dg1.id  # its reservation is freed
    d2, dg2 = first_generate(s.decode)  # either decode instance: both are up
    assert dg2.id == "r1.2.d"
    d2.send(delta(dg2.id, [], "", kv=RESERVATION))
    p2 = next(p for p in s.prefill if p is not p1)
    assert p2.expect(P.Generate).id == "r1.2.p"
    p2.close()  # the second try lost too: MAX_TRIES (2) reached, the client gets the failure
    while not isinstance(msg := s.cli.recv(), P.Final):
        pass
    assert msg.result.error is not None and msg.result.error.code == "instance_failed"
    assert f"prefill instance {p2.address}" in msg.result.error.message
    assert d2.expect(P.Abort).id == dg2.id


def test_a_split_request_whose_client_has_its_first_token_is_not_run_again(pools2):
    s = pools2
    s.cli.send(P.Generate(id="a", prompt=PROMPT, max_tokens=5, temperature=0.0, stream=True))
    d1, dg1 = first_generate(s.decode)
    d1.send(delta(dg1.id, [], "", kv=RESERVATION))
    p1, pg1 = first_generate(s.prefill)
    p1.send(delta(pg1.id, [11], " Hi"))
    assert s.cli.recv() == delta("a", [11], " Hi")  # the client has it: too late to rerun
    d1.close()
    msg = s.cli.recv()
    assert isinstance(msg, P.Final) and msg.result.error.code == "instance_failed"
    assert all(d.got.empty() for d in s.decode if d is not d1)


# ---- fallback: the prefill instance decodes the request itself (--pd-fallback local) ----

def fallback_final(dg: P.Generate) -> P.Final:
    return P.Final(result=error_result(dg.id, "kv_fallback", "the prefill instance decodes it"))


def client_stream(cli: Cli) -> tuple[list[RequestDelta], RequestResult]:
    got = []
    while not isinstance(msg := cli.recv(), P.Final):
        assert isinstance(msg, P.Delta)
        got.append(msg.delta)
    return got, msg.result


def test_fallback_seen_in_prefill_tokens_streams_p_and_its_final_is_the_final(pd):
    dg, pg = pd.start_split(stream=True)
    pd.p.send(delta(pg.id, [11], " Hi"))
    assert pd.cli.recv() == delta("a", [11], " Hi")
    pd.p.send(delta(pg.id, [12], " there"))  # a second token: P decodes it
    assert pd.cli.recv() == delta("a", [12], " there")
    assert pd.d.expect(P.Abort).id == dg.id  # D's reservation waits for nothing
    assert pd.instance(pd.d.address)["inflight"] == 0
    pd.d.send(P.Final(result=error_result(dg.id, "aborted", "aborted", finish_reason="abort")))
    pd.sync()  # D's final is not forwarded
    final = result(pg.id, [11, 12, 13], " Hi there!")
    pd.p.send(delta(pg.id, [13], "!"))
    pd.p.send(P.Final(result=final))
    got, res = client_stream(pd.cli)
    assert [(x.token_ids, x.text) for x in got] == [([13], "!")]
    assert res == msgspec.structs.replace(final, id="a")


def test_fallback_seen_in_decode_final_before_more_prefill_tokens(pd):
    dg, pg = pd.start_split(stream=True)
    pd.p.send(delta(pg.id, [11], " Hi"))
    assert pd.cli.recv() == delta("a", [11], " Hi")
    pd.d.send(fallback_final(dg))
    pd.sync()  # handled, and not forwarded
    assert pd.instance(pd.d.address)["inflight"] == 0 and pd.instance(pd.p.address)["inflight"] == 1
    final = result(pg.id, [11, 12], " Hi there")
    pd.p.send(delta(pg.id, [12], " there"))
    pd.p.send(P.Final(result=final))
    got, res = client_stream(pd.cli)
    assert [(x.token_ids, x.text) for x in got] == [([12], " there")]
    assert res == msgspec.structs.replace(final, id="a")
    assert pd.d.got.empty()  # D was done: no abort


def test_fallback_from_the_first_prefill_delta_on(pd):
    """D's kv_fallback before P's first token; then P's first delta carrying two tokens."""
    dg, pg = pd.start_split(stream=True, stop=["."])
    pd.d.send(fallback_final(dg))
    pd.sync()
    pd.p.send(delta(pg.id, [11, 12], " Hi there"))  # P's stream is the answer: text too
    assert pd.cli.recv() == delta("a", [11, 12], " Hi there")
    final = result(pg.id, [11, 12], " Hi there", finish="stop")
    pd.p.send(P.Final(result=final))
    assert pd.cli.recv() == P.Final(result=msgspec.structs.replace(final, id="a"))


def test_fallback_with_stop_strings_sends_the_text_held_back(pd):
    dg, pg = pd.start_split(stream=True, stop=["."])
    pd.p.send(delta(pg.id, [11], " Hi"))
    assert pd.cli.recv() == delta("a", [11], "")  # D might answer: only the ids go ahead
    pd.p.send(delta(pg.id, [12], " there"))
    assert pd.cli.recv() == delta("a", [12], " Hi there")
    assert pd.d.expect(P.Abort).id == dg.id
    final = result(pg.id, [11, 12], " Hi there")
    pd.p.send(P.Final(result=final))
    assert pd.cli.recv() == P.Final(result=msgspec.structs.replace(final, id="a"))


@pytest.mark.parametrize("p_final_first", [True, False])
def test_non_streaming_fallback_final_is_prefills(pd, p_final_first):
    """P ended at its first token by its own rules (a stop token): only D's kv_fallback says
    P's final is the answer, whichever comes first."""
    dg, pg = pd.start_split(stream=False)
    final = result(pg.id, [11], " Hi", finish="stop")
    pd.p.send(delta(pg.id, [11], " Hi"))
    if p_final_first:
        pd.p.send(P.Final(result=final))
        route = next(r for r in pd.router.routes.values() if r.client_id == "a")
        wait_for(lambda: route.pd is not None and route.pd.prefill_done, "P's final to be taken")
        pd.d.send(fallback_final(dg))
    else:
        pd.d.send(fallback_final(dg))
        pd.sync()
        pd.p.send(P.Final(result=final))
    msg = pd.cli.recv()
    assert msg == P.Final(result=msgspec.structs.replace(final, id="a"))


def test_non_streaming_fallback_seen_in_prefill_tokens(pd):
    dg, pg = pd.start_split(stream=False)
    pd.p.send(delta(pg.id, [11], " Hi"))
    pd.p.send(delta(pg.id, [12], " there"))
    assert pd.d.expect(P.Abort).id == dg.id
    pd.d.send(fallback_final(dg))  # crossed the abort: dropped
    final = result(pg.id, [11, 12], " Hi there")
    pd.p.send(P.Final(result=final))
    assert pd.cli.recv() == P.Final(result=msgspec.structs.replace(final, id="a"))


def test_fallback_then_prefill_lost_fails_and_client_abort_reaches_only_prefill(pd):
    dg, pg = pd.start_split(rid="a", stream=True)
    pd.p.send(delta(pg.id, [11], " Hi"))
    pd.p.send(delta(pg.id, [12], " there"))
    assert pd.d.expect(P.Abort).id == dg.id
    pd.cli.recv(), pd.cli.recv()
    pd.cli.send(P.Abort(id="a"))
    assert pd.p.expect(P.Abort).id == pg.id
    final = error_result(pg.id, "aborted", "by P", finish_reason="abort")
    pd.p.send(P.Final(result=final))  # the final is P's (D is out)
    assert pd.cli.recv() == P.Final(result=msgspec.structs.replace(final, id="a"))
    assert pd.d.got.empty()
    dg, pg = pd.start_split(rid="b", stream=True)
    pd.p.send(delta(pg.id, [11, 12], " Hi there"))
    assert pd.d.expect(P.Abort).id == dg.id
    pd.p.close()
    msg = pd.cli.recv()
    assert isinstance(msg, P.Delta)
    msg = pd.cli.recv()
    assert isinstance(msg, P.Final) and msg.result.error.code == "instance_failed"


def test_health_and_stats_cover_both_pools_with_roles(pd):
    detail = pd.cli.health().detail["instances"]
    assert {a: (i["role"], i["up"]) for a, i in detail.items()} == {
        pd.p.address: ("prefill", True), pd.d.address: ("decode", True)}
    pd.cli.send(P.Stats(id="s"))
    while not isinstance(msg := pd.cli.recv(), P.StatsReply):
        pass
    assert msg.stats["kv_blocks_total"] == 200 and msg.stats["kv_blocks_free"] == 160
    assert msg.stats["kv_usage"] == 0.2
    assert {a: i["role"] for a, i in msg.stats["instances"].items()} == {
        pd.p.address: "prefill", pd.d.address: "decode"}


def test_a_client_kv_transfer_is_refused(pd):
    pd.cli.send(P.Generate(id="k", prompt=PROMPT, kv_transfer=KVTransferParams(role="decode")))
    msg = pd.cli.recv()
    assert isinstance(msg, P.Final) and msg.result.error.code == "invalid_request"
    assert "kv_transfer" in msg.result.error.message and pd.d.got.empty()


def test_drain_lets_a_split_request_finish(pd):
    dg, pg = pd.start_split(stream=False)
    pd.router.stopping = True
    wait_for(lambda: pd.cli.health().status == "draining", "the drain")
    pd.cli.send(P.Generate(id="late", prompt=PROMPT))
    msg = pd.cli.recv()
    assert msg.result.id == "late" and msg.result.error.code == "draining"
    pd.p.send(P.Final(result=result(pg.id, [11], " Hi")))
    pd.d.send(P.Final(result=result(dg.id, [11, 12], " Hi there")))
    msg = pd.cli.recv()
    assert isinstance(msg, P.Final) and msg.result.error is None and msg.result.token_ids == [11, 12]


# ---- pools: routing, instances of the wrong role, no prefill instance ----

def test_wrong_role_is_not_used_and_plain_requests_do_not_wait_for_prefill(monkeypatch):
    monkeypatch.setattr(server, "NO_INSTANCE_WAIT_S", 1.0)
    dead = f"tcp://127.0.0.1:{free_port()}"
    with ExitStack() as stack:
        d, wrong = FakeInstance("decode"), FakeInstance("mixed")
        stack.callback(d.close)
        stack.callback(wrong.close)
        router = stack.enter_context(pd_router([dead], [d.address, wrong.address]))
        cli = Cli(router.args.listen)
        stack.callback(cli.close)
        wait_for(lambda: "role" in (cli.health().detail["instances"][wrong.address]["why_down"] or ""),
                 "the wrong-role instance to be refused")
        assert cli.health().status == "starting"  # no prefill instance
        cli.send(P.Generate(id="split", prompt=PROMPT, max_tokens=5))
        cli.send(P.Generate(id="whole", prompt=PROMPT, max_tokens=1))
        g = d.expect(P.Generate)  # the whole one runs on D at once
        assert g.kv_transfer is None
        d.send(P.Final(result=result(g.id, [3], "y")))
        msg = cli.recv()
        assert msg.result.id == "whole" and msg.result.error is None
        msg = cli.recv(timeout=10)
        assert msg.result.id == "split" and msg.result.error.code == "unavailable"
        assert "no prefill instance" in msg.result.error.message and dead in msg.result.error.message
        assert d.got.empty() and wrong.got.empty()


def test_requests_spread_over_the_decode_pool():
    with ExitStack() as stack:
        insts = [FakeInstance(r) for r in ("prefill", "decode", "decode")]
        for i in insts:
            stack.callback(i.close)
        p, d1, d2 = insts
        router = stack.enter_context(pd_router([p.address], [d1.address, d2.address]))
        cli = Cli(router.args.listen)
        stack.callback(cli.close)
        wait_for(lambda: cli.health().status == "ok" and all(
            i["up"] for i in cli.health().detail["instances"].values()), "all up")
        for i in range(2):
            cli.send(P.Generate(id=f"g{i}", prompt=PROMPT, max_tokens=5))
        a, b = d1.expect(P.Generate), d2.expect(P.Generate)  # the least loaded each time
        for inst, g in ((d1, a), (d2, b)):
            inst.send(P.Final(result=error_result(g.id, "aborted", "x", finish_reason="abort")))
        assert {cli.recv().result.id for _ in range(2)} == {"g0", "g1"}


# ---- the pure parts ----

def test_pd_state_strips_what_the_client_has_from_p():
    s = PDState(stream=True, show_text=True)
    kv, out = s.on_decode_delta(RequestDelta("x", "", [], kv=RESERVATION))
    assert kv == RESERVATION and out is None
    assert s.on_decode_delta(RequestDelta("x", "", [], kv=RESERVATION)) == (None, None)  # once
    assert s.on_prefill_delta(RequestDelta("x", "ab", [1])) == RequestDelta("x", "ab", [1])
    assert s.on_decode_delta(RequestDelta("x", "a", [1])) == (None, None)
    assert s.on_decode_delta(RequestDelta("x", "bcd", [2])) == (None, RequestDelta("x", "cd", [2]))
    # D first (the race): P's delta is dropped, D's comes whole
    s = PDState(stream=True, show_text=True)
    assert s.on_decode_delta(RequestDelta("x", "ab", [1])) == (None, RequestDelta("x", "ab", [1]))
    assert s.on_prefill_delta(RequestDelta("x", "ab", [1])) is None
    # texts that disagree: stripping stops, D's text comes as is
    s = PDState(stream=True, show_text=True)
    s.on_prefill_delta(RequestDelta("x", "\ufffd", [1]))
    assert s.on_decode_delta(RequestDelta("x", "é!", [1, 2])) == (None, RequestDelta("x", "é!", [2]))
    # stop strings: P's text is held back, only its ids go ahead
    s = PDState.of(P.Generate(id="x", prompt="p", stream=True, stop=["."]))
    assert s.on_prefill_delta(RequestDelta("x", "a", [1])) == RequestDelta("x", "", [1])
    assert s.on_decode_delta(RequestDelta("x", "a", [1])) == (None, RequestDelta("x", "a", []))
    # P's final: only a failure is forwarded, and not once the client aborted
    err = error_result("x", "kv_transfer_failed", "m")
    assert PDState(True, True).on_prefill_final(err) is err
    assert PDState(True, True, aborting=True).on_prefill_final(err) is None
    # fallback: a second token from P, or D's kv_fallback final; then P's final is the final
    s = PDState(stream=False, show_text=True)
    assert s.on_prefill_delta(RequestDelta("x", "a", [1])) is None and not s.fell_back
    assert s.on_prefill_delta(RequestDelta("x", "b", [2])) is None and s.fell_back
    ok = result("x", [1, 2], "ab")
    assert s.on_prefill_final(ok) is ok
    s = PDState(stream=True, show_text=True)
    assert s.on_decode_final(error_result("x", "kv_transfer_failed", "m")) and not s.fell_back
    assert s.on_prefill_final(ok) is None and s.prefill_final is ok
    assert not s.on_decode_final(error_result("x", "kv_fallback", "m")) and s.fell_back
    # once D decodes, P's tokens are never a fallback
    s = PDState(stream=True, show_text=True, decoding=True)
    s.on_prefill_delta(RequestDelta("x", "ab", [1, 2]))
    assert not s.fell_back


def test_pool_policy():
    from test_router import FakeTarget  # the policy tests' stand-in for an instance

    pol = PoolPolicy()
    a, b, c = FakeTarget("a", 2, 0.5), FakeTarget("b", 1, 0.2), FakeTarget("c", 1, 0.6)
    assert pol.choose_decode([a, b, c]) is c  # least loaded, then most free KV
    assert pol.choose_decode([a, FakeTarget("full", 0, 0.01)]) is a
    first = pol.choose_prefill([a, b, c], b"k")
    assert all(pol.choose_prefill([a, b, c], b"k") is first for _ in range(3))  # cache-aware


@pytest.mark.parametrize("flags, says", [
    (["--instance", "tcp://127.0.0.1:2", "--prefill", "tcp://127.0.0.1:3"], "--instance"),
    (["--prefill", "tcp://127.0.0.1:3"], "--prefill needs --decode"),
    (["--decode", "tcp://127.0.0.1:3"], "--decode needs --prefill"),
    ([], "--instance ADDR..."),
    (["--prefill", "tcp://127.0.0.1:3", "--decode", "tcp://127.0.0.1:3"], "both pools"),
    (["--prefill", "nowhere", "--decode", "tcp://127.0.0.1:3"], "--prefill 'nowhere'"),
])
def test_bad_pool_flags(flags, says):
    args = parse_router_args(["--listen", "tcp://127.0.0.1:1", "--drain-timeout", "1"])
    for flag, addrs in zip(flags[::2], flags[1::2], strict=True):
        setattr(args, flag[2:], [addrs])
    with pytest.raises(ValueError, match=says):
        check_args(args)


def test_bad_pool_flags_exit_2_with_one_line():
    p = subprocess.run([*PIPELINE, "router", "--listen", "tcp://127.0.0.1:1", "--prefill",
                        "tcp://127.0.0.1:2"], capture_output=True, text=True, cwd=ROOT, env=env(),
                       timeout=60)
    assert p.returncode == 2 and p.stderr.count("\n") == 1 and "--prefill needs --decode" in p.stderr
