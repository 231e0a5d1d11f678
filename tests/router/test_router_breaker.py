"""Issue 25, item 9: the router's circuit breaker. An instance that went down BREAKER_FAILURES
times within BREAKER_WINDOW_S is sent no request for BREAKER_OUT_S (doubling each trip, up to
BREAKER_MAX_OUT_S, starting over after BREAKER_CALM_S in service); health and stats show it (``out``, ``why_out``: how often, the last
reason); after that time it is used again.

The rule on explicit clocks (``Upstream.failed``/``tripped`` take ``now``), then the real
router over two scripted instances (``router_fakes``), one of which says it is not ok three
times; a request it would have run waits for it while the other is down, and goes once the
time is over.
"""
from __future__ import annotations

from contextlib import ExitStack

import zmq
from router_fakes import PROMPT, Cli, FakeInstance, result, run_router, wait_for

from pipeline.frontend import protocol as P
from pipeline.router.upstream import (
    BREAKER_CALM_S,
    BREAKER_FAILURES,
    BREAKER_MAX_OUT_S,
    BREAKER_OUT_S,
    BREAKER_WINDOW_S,
    Upstream,
)


def test_failures_within_the_window_trip_it_for_a_doubling_while():
    ctx = zmq.Context()
    u = Upstream(ctx, "tcp://127.0.0.1:9")  # nothing listens: only the breaker's arithmetic
    try:
        t = 1000.0
        for i in range(BREAKER_FAILURES - 1):
            assert not u.failed(t + i, "its connection closed")
        # the oldest failure leaves the window before the next: no trip
        assert not u.failed(t + BREAKER_WINDOW_S + 0.5, "its connection closed")
        assert not u.tripped(t + BREAKER_WINDOW_S + 0.5)
        now = t + BREAKER_WINDOW_S + 0.75  # t + 1 and t + WINDOW + 0.5 are within the window
        assert u.failed(now, "no answer to a health check within 3 s")
        assert u.tripped(now) and u.tripped(now + BREAKER_OUT_S - 0.01)
        assert not u.tripped(now + BREAKER_OUT_S)
        assert u.why_out is not None and f"down {BREAKER_FAILURES} times" in u.why_out
        assert "last: no answer to a health check" in u.why_out
        # it trips again: out twice as long, never longer than BREAKER_MAX_OUT_S
        outs = []
        for _ in range(12):
            now += 1000.0
            for i in range(BREAKER_FAILURES):
                tripped = u.failed(now + i, "its connection closed")
            assert tripped
            outs.append(u.out_until - (now + BREAKER_FAILURES - 1))
        assert outs[0] == 2 * BREAKER_OUT_S and outs[1] == 4 * BREAKER_OUT_S
        assert max(outs) == BREAKER_MAX_OUT_S and outs[-1] == BREAKER_MAX_OUT_S
    finally:
        u.close()
        ctx.term()


def test_the_doubling_starts_over_after_a_calm_spell_in_service():
    ctx = zmq.Context()
    u = Upstream(ctx, "tcp://127.0.0.1:9")
    try:
        def trip(now: float) -> float:
            for i in range(BREAKER_FAILURES):
                tripped = u.failed(now + i, "its connection closed")
            assert tripped
            return u.out_until - (now + BREAKER_FAILURES - 1)  # how long it is out

        now = 1000.0
        assert [trip(now := now + 100.0 * k) for k in range(1, 4)] == \
            [BREAKER_OUT_S, 2 * BREAKER_OUT_S, 4 * BREAKER_OUT_S]
        back = u.out_until
        # in service a moment less than the calm spell: still doubling
        assert trip(back + BREAKER_CALM_S - BREAKER_FAILURES) == 8 * BREAKER_OUT_S
        # a full calm spell since it was last back: out for the first length again, then doubling
        back = u.out_until
        assert trip(back + BREAKER_CALM_S) == BREAKER_OUT_S
        assert trip(u.out_until + 10.0) == 2 * BREAKER_OUT_S
    finally:
        u.close()
        ctx.term()


def test_an_instance_that_keeps_failing_is_taken_out_shown_and_back_after_the_time():
    with ExitStack() as stack:
        a, b = FakeInstance("mixed"), FakeInstance("mixed")
        stack.callback(b.close)
        stack.callback(a.close)
        router = stack.enter_context(run_router("--instance", a.address, b.address))
        cli = Cli(router.args.listen)
        stack.callback(cli.close)

        def view(x: FakeInstance) -> dict:
            return cli.health().detail["instances"][x.address]

        wait_for(lambda: view(a)["up"] and view(b)["up"], "both instances up")
        for _ in range(BREAKER_FAILURES):
            a.status = "starting"
            wait_for(lambda: not view(a)["up"], "the router to take a down", 10)
            a.status = "ok"
            wait_for(lambda: view(a)["up"], "a up again", 10)
        # Up, but out: health and stats say why.
        shown = view(a)
        assert shown["up"] and shown["out"], shown
        assert f"down {BREAKER_FAILURES} times" in shown["why_out"]
        assert "its health check says 'starting'" in shown["why_out"]
        cli.send(P.Stats(id="s"))
        while not isinstance(st := cli.recv(), P.StatsReply):
            pass
        assert st.stats["instances"][a.address]["why_out"] == shown["why_out"]
        assert not view(b)["out"]
        # While it is out every request goes to b (a was up and out before, and still is after).
        cli.send(P.Generate(id="g1", prompt=PROMPT, max_tokens=2))
        g1 = b.expect(P.Generate)
        assert view(a)["out"], "the breaker's time ran out before the request was routed"
        assert a.got.empty()
        # b goes down with the request before its first token: it waits for an instance (a is
        # out), and goes to a once the breaker's time is over (no health change says so).
        b.status = "starting"
        wait_for(lambda: not view(b)["up"], "the router to take b down", 10)
        again = a.expect(P.Generate, timeout=BREAKER_OUT_S + 10)
        assert again.id == g1.id and not view(a)["out"] and view(a)["why_out"] is None
        a.send(P.Final(result=result(again.id, [7, 8], " a b")))
        assert cli_final(cli) == "g1"
        b.status = "ok"


def cli_final(cli: Cli) -> str:
    while not isinstance(msg := cli.recv(), P.Final):
        pass
    assert msg.result.error is None, msg.result.error
    return msg.result.id
