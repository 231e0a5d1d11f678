"""Client and AsyncClient against a small in-test ROUTER server that speaks the real protocol
(real ZMQ sockets over loopback TCP, the real ClientSessions): multiplexing from many threads
and tasks, streaming, aborts, time-outs, errors, disconnect detection, CURVE, no daemon at
all, arguments the wire cannot carry, id reuse, a second event loop."""
from __future__ import annotations

import asyncio
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import pytest
import zmq
from hypothesis import given
from hypothesis import strategies as st
from zmq.utils.monitor import recv_monitor_message

from pipeline.client import Client, RequestError
from pipeline.client.async_client import AsyncClient
from pipeline.client.base import Inflight
from pipeline.frontend import protocol as P
from pipeline.ipc.curve import generate_keys, server_socket_setup
from pipeline.frontend.request_parser import sampling_params
from pipeline.frontend.sessions import ClientSessions, DuplicateRequestId
from pipeline.messages import ErrorInfo, RequestDelta, RequestResult, Timings, Usage
from pipeline.tokenizer.validate import InvalidRequest, check_sampling, one_prompt_field

TICK_MS = 2  # the fake engine's step: one token per active request per tick


@dataclass
class Running:
    identity: bytes
    client_id: str
    prompt: str
    max_tokens: int
    stream: bool
    out: str = ""


def result(cid: str, text: str, reason: str, error: ErrorInfo | None = None) -> RequestResult:
    return RequestResult(id=cid, text=text, token_ids=[ord(c) for c in text], finish_reason=reason,
                         usage=Usage(1, len(text)), timings=Timings(arrival_time=time.time()), error=error)


class EchoServer(threading.Thread):
    """Generates the prompt's characters back, one per tick; prompt "hang" never produces."""

    def __init__(self, curve_dir=None, address: str | None = None) -> None:
        super().__init__(daemon=True)
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.auth = server_socket_setup(self.sock, curve_dir) if curve_dir else None
        if address is None:
            address = f"tcp://127.0.0.1:{self.sock.bind_to_random_port('tcp://127.0.0.1')}"
        else:
            self.sock.bind(address)
        self.address = address
        self.sessions = ClientSessions()
        self.running: dict[str, Running] = {}
        self.gone: list[tuple[str, str]] = []  # (client id, why) aborted without an answer
        self.cond = threading.Condition()
        self.stopping = False

    def wait_gone(self, n: int, timeout: float = 10.0) -> list[tuple[str, str]]:
        with self.cond:
            assert self.cond.wait_for(lambda: len(self.gone) >= n, timeout), self.gone
            return list(self.gone)

    def send(self, identity: bytes, msg) -> None:
        try:
            self.sock.send_multipart([identity, P.encode(msg)])
        except zmq.ZMQError as exc:
            if exc.errno != zmq.EHOSTUNREACH:
                raise
            self.forget(self.sessions.drop_client(identity), "unreachable")

    def forget(self, internal_ids: list[str], why: str) -> None:
        with self.cond:
            for i in internal_ids:
                self.gone.append((self.running.pop(i).client_id, why))
            self.cond.notify_all()

    def finish(self, internal: str, reason: str) -> None:
        r = self.running.pop(internal)
        self.sessions.finish(internal)
        self.send(r.identity, P.Final(result=result(r.client_id, r.out, reason)))

    def handle(self, identity: bytes, frame: bytes) -> None:
        # The daemon probes clients with pings while they have requests in flight: clients
        # must ignore them among their answers. Not after a bye: that client may be gone
        # already, and a failed ping would report it "unreachable" before its bye is read.
        try:
            is_bye = isinstance(P.decode_client(frame), P.Bye)
        except P.ProtocolError:
            is_bye = False
        if not is_bye:
            self.send(identity, P.Ping())
        try:
            msg = P.decode_client(frame)
            if isinstance(msg, P.Generate):
                # Like the daemon's tokenizer stage, with the model's limits out of the way.
                one_prompt_field(prompt=msg.prompt, prompt_token_ids=msg.prompt_token_ids,
                                 messages=msg.messages)
                check_sampling(sampling_params(msg), vocab_size=1 << 20, max_model_len=10**7)
                internal = self.sessions.start(identity, str(msg.id))
                mt = msg.max_tokens if isinstance(msg.max_tokens, int) else 16
                self.running[internal] = Running(identity, str(msg.id), msg.prompt or "", mt, msg.stream)
        except P.ProtocolError as exc:
            if exc.op == "generate" and exc.req_id:
                self.send(identity, P.Final(result=result(exc.req_id, "", "error", exc.error)))
            else:
                self.send(identity, P.Error(id=exc.req_id, error=exc.error))
            return
        except InvalidRequest as exc:
            self.send(identity, P.Final(result=result(str(msg.id), "", "error",
                                                      ErrorInfo("invalid_request", str(exc)))))
            return
        except DuplicateRequestId as exc:  # as the daemon: never keyed by the id in flight
            self.send(identity, P.Error(id=None, error=ErrorInfo("duplicate_id", str(exc))))
            return
        if isinstance(msg, P.Abort):
            internal = self.sessions.internal_id(identity, msg.id)
            if internal is not None:
                self.finish(internal, "abort")
        elif isinstance(msg, P.Health):
            self.send(identity, P.HealthReply(id=msg.id, status="ok"))
        elif isinstance(msg, P.Stats):
            self.send(identity, P.StatsReply(id=msg.id, stats={"running": len(self.running)}))
        elif isinstance(msg, P.Bye):
            self.forget(self.sessions.drop_client(identity), "bye")

    def step(self) -> None:
        for internal, r in list(self.running.items()):
            if r.prompt == "hang" or internal not in self.running:
                continue
            c = r.prompt[len(r.out) % len(r.prompt)] if r.prompt else "x"
            r.out += c
            if r.stream:
                self.send(r.identity, P.Delta(delta=RequestDelta(r.client_id, c, [ord(c)])))
            if internal in self.running and len(r.out) >= r.max_tokens:
                self.finish(internal, "length")

    def run(self) -> None:
        while not self.stopping:
            if self.sock.poll(TICK_MS if self.running else 20):
                while True:
                    try:
                        identity, frame = self.sock.recv_multipart(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    self.handle(identity, frame)
            self.step()

    def close(self) -> None:
        self.stopping = True
        self.join()
        if self.auth:
            self.auth.stop()
        self.sock.close()
        self.ctx.term()


@pytest.fixture
def server():
    s = EchoServer()
    s.start()
    yield s
    s.close()


def test_generate_many_threads_one_socket(server):
    with Client(server.address, timeout=30) as c:
        def one(i: int) -> RequestResult:
            return c.generate(f"req{i}-", id=f"id{i}", max_tokens=12)
        with ThreadPoolExecutor(16) as ex:
            results = list(ex.map(one, range(160)))
    for i, r in enumerate(results):
        assert r.id == f"id{i}" and r.text == (f"req{i}-" * 3)[:12] and r.finish_reason == "length"
    assert len(server.sessions) == 0 and server.sessions.clients() == []  # nothing left in flight


def test_stream_then_final(server):
    with Client(server.address, timeout=30) as c:
        items = list(c.stream("abc", max_tokens=7))
    *deltas, final = items
    assert all(isinstance(d, RequestDelta) for d in deltas) and isinstance(final, RequestResult)
    assert "".join(d.text for d in deltas) == final.text == "abcabca"


def test_leaving_stream_aborts_on_daemon(server):
    with Client(server.address, timeout=30) as c:
        for item in c.stream("xyz", id="s1", max_tokens=10**6):
            assert isinstance(item, RequestDelta)
            break
        # The server answered the abort with a final that nobody waits for any more.
        assert c.health().status == "ok"
        assert c.stats()["running"] == 0
        assert c.generate("ok", max_tokens=2).text == "ok"


def test_abort_from_another_thread_and_timeout(server):
    with Client(server.address, timeout=30) as c:
        t = threading.Timer(0.05, c.abort, args=("h1",))
        t.start()
        r = c.generate("hang", id="h1")
        assert r.finish_reason == "abort"
        with pytest.raises(TimeoutError, match="h2"):
            c.generate("hang", id="h2", timeout=0.1)
        assert c.stats()["running"] == 0  # the time-out aborted it on the daemon


def test_errors_name_the_field(server):
    with Client(server.address, timeout=30) as c:
        r = c.generate("x", temperature=500.0)
        assert r.finish_reason == "error" and r.error.code == "invalid_request"
        assert "field `temperature`" in r.error.message and "[0, 100]" in r.error.message
        r = c.generate(None)
        assert "exactly one of" in r.error.message
        with pytest.raises(TypeError):
            c.generate("x", temprature=1.0)  # a typo never reaches the wire


def test_duplicate_id_in_flight(server):
    with Client(server.address, timeout=30) as c:
        with ThreadPoolExecutor(1) as ex:
            first = ex.submit(c.generate, "hang", id="dup")
            while c.stats()["running"] == 0:  # a round trip per check, no sleep
                pass
            with pytest.raises(ValueError, match="already in flight"):
                c.generate("x", id="dup")
            c.abort("dup")
            assert first.result().finish_reason == "abort"
    # The daemon's own refusal of a duplicate is tested on the real daemon (test_serve_hostile).


def test_id_reused_after_timeout_gets_its_own_answer(server):
    """The timed-out request's abort answer comes back after the id was reused: it must not
    be taken for the new request's (each request has its own id on the wire)."""
    with Client(server.address, timeout=30) as c:
        with pytest.raises(TimeoutError, match="'t'"):
            c.generate("hang", id="t", timeout=0.1)
        r = c.generate("abc", id="t", max_tokens=3)
        assert (r.id, r.text, r.finish_reason) == ("t", "abc", "length")
        assert c.stats()["running"] == 0


def test_client_close_aborts_inflight(server):
    c = Client(server.address, timeout=30)
    with ThreadPoolExecutor(2) as ex:
        generate = ex.submit(c.generate, "hang", id="bye1")
        health = ex.submit(c.health)  # may be answered before the close, or end with it
        while c.stats()["running"] == 0:  # a round trip per check, no sleep
            pass
        c.close()
        r = generate.result()
        try:
            health.result()
        except RequestError as exc:
            assert exc.error.code == "client_closed"
    # The agreed abort shape: the client aborted it (and the daemon did, on its bye).
    assert (r.id, r.finish_reason, r.error.code) == ("bye1", "abort", "aborted"), r
    assert "closed" in r.error.message
    assert [why for _, why in server.wait_gone(1)] == ["bye"]
    with pytest.raises(RequestError, match="client_closed"):
        c.generate("x")


def test_async_client_close_aborts_inflight(server):
    async def main() -> None:
        c = AsyncClient(server.address, timeout=30)
        task = asyncio.create_task(c.generate("hang", id="ab"))
        while (await c.stats())["running"] == 0:
            pass
        await c.close()
        r = await task
        assert (r.id, r.finish_reason, r.error.code) == ("ab", "abort", "aborted"), r

    asyncio.run(main())
    assert [why for _, why in server.wait_gone(1)] == ["bye"]


def test_vanished_client_is_noticed(server):
    # A raw DEALER that disappears without bye: the next send fails (ROUTER_MANDATORY).
    ctx = zmq.Context()
    s = ctx.socket(zmq.DEALER)
    s.connect(server.address)
    s.send(P.encode(P.Generate(id="v1", prompt="abc", max_tokens=10**6, stream=True)))
    while isinstance(reply := P.decode_reply(s.recv()), P.Ping):
        pass
    assert isinstance(reply, P.Delta)
    s.close(linger=0)
    ctx.term()
    assert ("v1", "unreachable") in server.wait_gone(1)


def test_async_client_many_tasks(server):
    async def main() -> None:
        async with AsyncClient(server.address, timeout=30) as c:
            results = await asyncio.gather(*(c.generate(f"t{i}", id=f"a{i}", max_tokens=5) for i in range(64)))
            for i, r in enumerate(results):
                assert r.id == f"a{i}" and r.text == (f"t{i}" * 5)[:5]
            items = [x async for x in c.stream("qr", max_tokens=5)]
            assert "".join(x.text for x in items[:-1]) == items[-1].text == "qrqrq"
            async for item in c.stream("hang2", max_tokens=10**6):
                assert isinstance(item, RequestDelta)
                break
            with pytest.raises(TimeoutError):
                await c.generate("hang", timeout=0.1)
            r = await c.generate("x", top_p=0.0)
            assert "field `top_p`" in r.error.message
            assert (await c.health()).status == "ok"
            assert (await c.stats())["running"] == 0

    asyncio.run(main())


@pytest.mark.parametrize("loop", ["asyncio", "uvloop"])
def test_async_client_many_streams_each_token_once(loop):
    """Hundreds of streams on one client, the first half sent before any daemon listens
    (they wait unsent until it connects), the rest while answers pour in: every stream gets
    each of its tokens exactly once, in order, then one final answer. A wake-up lost on the
    socket's edge-triggered FD shows as a time-out, not a hang."""
    address = free_address()
    srv: EchoServer | None = None

    async def one(c: AsyncClient, i: int) -> None:
        *deltas, final = [x async for x in c.stream(f"<{i}>", id=f"s{i}", max_tokens=30, timeout=20)]
        want = (f"<{i}>" * 30)[:30]
        assert all(isinstance(d, RequestDelta) and d.id == f"s{i}" for d in deltas)
        assert [d.text for d in deltas] == list(want)
        assert isinstance(final, RequestResult) and (final.id, final.text) == (f"s{i}", want)

    async def main() -> None:
        nonlocal srv
        async with AsyncClient(address, timeout=30, connect_timeout=30) as c:
            early = [asyncio.create_task(one(c, i)) for i in range(128)]
            await asyncio.sleep(0)  # one turn: each task submits (nothing listens yet)
            srv = EchoServer(address=address)
            srv.start()
            late = [asyncio.create_task(one(c, i)) for i in range(128, 256)]
            await asyncio.gather(*early, *late)
            assert (await c.stats())["running"] == 0

    factory = pytest.importorskip("uvloop").new_event_loop if loop == "uvloop" else None
    try:
        with asyncio.Runner(loop_factory=factory) as runner:
            runner.run(main())
    finally:
        if srv is not None:
            srv.close()


def test_async_client_send_does_not_lose_the_fd_signal(server):
    """libzmq's FD signals once when answers arrive, and a send may consume that signal
    before the loop polls: the client must still read the answers waiting."""
    async def main() -> None:
        async with AsyncClient(server.address, timeout=5) as c:
            assert (await c.health()).status == "ok"  # connected, every answer read
            first = asyncio.create_task(c.health())
            await asyncio.sleep(0)  # one turn: its request goes out
            time.sleep(0.3)  # a stalled loop (no await): the answer comes and signals the FD
            assert (await c.health()).status == "ok"  # sends before the loop polls again
            assert (await first).status == "ok"

    asyncio.run(main())


def test_curve_only_known_client_keys(tmp_path):
    keys = generate_keys(tmp_path / "keys")
    other = generate_keys(tmp_path / "other")
    srv = EchoServer(curve_dir=keys)
    mon = srv.sock.get_monitor_socket(zmq.EVENT_HANDSHAKE_FAILED_AUTH | zmq.EVENT_HANDSHAKE_SUCCEEDED)
    srv.start()
    try:
        with Client(srv.address, timeout=30, curve_keys_dir=keys) as c:
            assert c.generate("secure", max_tokens=6).text == "secure"
        assert recv_monitor_message(mon)["event"] == zmq.EVENT_HANDSHAKE_SUCCEEDED
        # Right server key, unknown client key: the ZAP handler refuses the handshake, and
        # the client says so instead of waiting for its time-out.
        with Client(srv.address, timeout=30, curve_keys_dir=other, curve_server_key=keys / "server.key") as bad:
            # The refusal comes before the request here; ZMQ may not retry: no hang either way.
            assert mon.poll(10_000) and recv_monitor_message(mon)["event"] == zmq.EVENT_HANDSHAKE_FAILED_AUTH
            r = bad.generate("x")
            assert r.finish_reason == "error" and r.error.code == "handshake_failed"
            with pytest.raises(RequestError, match="handshake_failed"):
                bad.health()

        async def async_bad() -> None:
            async with AsyncClient(srv.address, timeout=30, curve_keys_dir=other,
                                   curve_server_key=keys / "server.key") as c:
                r = await c.generate("x")
                assert r.error.code == "handshake_failed"

        asyncio.run(async_bad())
        assert srv.running == {}
        with pytest.raises(FileExistsError):
            generate_keys(keys)
    finally:
        mon.close()
        srv.close()


def test_daemon_gone_ends_requests_at_once():
    srv = EchoServer()
    srv.start()
    with Client(srv.address, timeout=60) as c:
        with ThreadPoolExecutor(4) as ex:
            waiting = [ex.submit(c.generate, "hang", id=f"g{i}") for i in range(3)]
            while c.stats()["running"] < 3:
                pass
            stats_wait = ex.submit(c.stats)  # may be answered or lost, never hangs
            srv.close()  # the daemon disappears (its TCP connections close)
            for f in waiting:
                r = f.result()
                assert r.finish_reason == "error" and r.error.code == "connection_lost"
            try:
                stats_wait.result()
            except RequestError as exc:
                assert exc.error.code == "connection_lost"


def test_async_daemon_gone_ends_requests_at_once():
    srv = EchoServer()
    srv.start()

    async def main() -> None:
        async with AsyncClient(srv.address, timeout=60) as c:
            tasks = [asyncio.create_task(c.generate("hang", id=f"g{i}")) for i in range(3)]
            while (await c.stats())["running"] < 3:
                pass
            await asyncio.to_thread(srv.close)
            for r in await asyncio.gather(*tasks):
                assert r.finish_reason == "error" and r.error.code == "connection_lost"

    asyncio.run(main())


def free_address() -> str:
    with socket.socket() as sk:
        sk.bind(("127.0.0.1", 0))
        return f"tcp://127.0.0.1:{sk.getsockname()[1]}"  # nobody listens there once closed


def test_no_daemon_fails_fast_with_a_named_error():
    address = free_address()
    with Client(address, timeout=60, connect_timeout=0.3) as c:
        r = c.generate("x")
        assert r.finish_reason == "error" and r.error.code == "unreachable", r
        assert address in r.error.message and "connect_timeout" in r.error.message
        with pytest.raises(RequestError, match="unreachable"):
            c.health()

    async def main() -> None:
        async with AsyncClient(address, timeout=60, connect_timeout=0.3) as c:
            r = await c.generate("x")
            assert r.error.code == "unreachable", r
            with pytest.raises(RequestError, match="unreachable"):
                await c.stats()

    asyncio.run(main())


def test_a_daemon_that_comes_late_is_waited_for():
    """connect_timeout counts only while there is no connection: a request sent before the
    daemon is up is answered once it is."""
    srv = EchoServer()
    address = srv.address
    with Client(address, timeout=60, connect_timeout=60) as c:
        srv.start()
        try:
            assert c.generate("late", max_tokens=4).text == "late"
        finally:
            srv.close()


@pytest.mark.parametrize("call", ["generate", "stream"])
def test_arguments_the_wire_cannot_carry_are_named(server, call):
    with pytest.raises(ValueError, match="127.0.0.1:1.*tcp://HOST:PORT"):
        Client("127.0.0.1:1")  # no scheme
    with pytest.raises(ValueError, match="tcp://nohost"):
        Client("tcp://nohost")  # no port
    with Client(server.address, timeout=30) as c:
        def send(*args, **kw):
            return c.generate(*args, **kw) if call == "generate" else list(c.stream(*args, **kw))

        with pytest.raises(TypeError, match="'temprature'.*did you mean 'temperature'"):
            send("x", temprature=1.0)
        with pytest.raises(TypeError, match="`stream`.*stream\\(\\)"):
            send("x", stream=True)
        with pytest.raises(ValueError, match="field `seed`.*2\\*\\*64"):
            send("x", seed=2**70)
        with pytest.raises(ValueError, match="field `max_tokens`"):
            send("x", max_tokens="many")
        with pytest.raises(TypeError, match="`id`"):
            send("x", id=5)
        assert c.stats()["running"] == 0 and server.sessions.clients() == []  # nothing was sent
        assert send("ok", seed=2**64 - 1, max_tokens=2) is not None  # the largest seed goes


def test_async_client_in_a_second_event_loop(server):
    c = AsyncClient(server.address, timeout=10)

    async def one(text: str) -> str:
        return (await c.generate(text, max_tokens=len(text))).text

    assert asyncio.run(one("first")) == "first"
    assert asyncio.run(one("second")) == "second"  # a new loop takes the client over
    # A loop still running in another thread keeps it: refused, not a hang.
    started, release = threading.Event(), threading.Event()

    async def hold() -> None:
        task = asyncio.create_task(c.generate("hang"))
        await asyncio.sleep(0)  # one turn of the loop: the task submits its request
        started.set()
        await asyncio.to_thread(release.wait)
        task.cancel()

    t = threading.Thread(target=asyncio.run, args=(hold(),))
    t.start()
    try:
        started.wait()
        with pytest.raises(RuntimeError, match="another"):
            asyncio.run(one("third"))
    finally:
        release.set()
        t.join()
    assert asyncio.run(one("fourth")) == "fourth"
    asyncio.run(c.close())


OPS = st.lists(st.tuples(st.sampled_from(["start", "finish", "drop"]), st.sampled_from([b"A", b"B", b"C"]),
                         st.sampled_from(["1", "2", "3"])), max_size=60)


@given(OPS)
def test_sessions_match_a_model(ops):
    """ClientSessions against a dict model: ids unique per client, a refused duplicate changes
    nothing, and a client is known only while it has requests in flight (memory is bounded by
    the requests in flight, whatever clients come and go)."""
    s, model = ClientSessions(), {}  # (identity, client id) -> internal id
    for op, ident, cid in ops:
        if op == "start":
            if (ident, cid) in model:
                with pytest.raises(DuplicateRequestId):
                    s.start(ident, cid)
            else:
                model[(ident, cid)] = s.start(ident, cid)
        elif op == "finish" and (ident, cid) in model:
            assert s.finish(model.pop((ident, cid))) == (ident, cid)
        elif op == "drop":
            dropped = sorted(model.pop(k) for k in [k for k in model if k[0] == ident])
            assert sorted(s.drop_client(ident)) == dropped
        assert len(s) == len(model) and len(set(model.values())) == len(model)
        assert sorted(s.clients()) == sorted({i for i, _ in model})
        for (i, c), internal in model.items():
            assert s.internal_id(i, c) == internal and s.owner(internal) == (i, c)


@given(st.lists(st.tuples(st.booleans(), st.sampled_from(["x", "y", "z"])), max_size=60))
def test_inflight_wire_ids_never_repeat(ops):
    """The client's table: every request gets a wire id never used before on this client,
    so no answer of a finished or abandoned request can reach a later one."""
    t, seen, live = Inflight(), set(), {}  # live: caller's id -> wire id
    for add, user in ops:
        if add:
            wire = t.new_id()
            assert wire not in seen
            seen.add(wire)
            if user in live:
                with pytest.raises(ValueError, match="already in flight"):
                    t.add(wire, user, None, True, 0.0)
            else:
                t.add(wire, user, None, True, 0.0)
                live[user] = wire
        elif user in live:
            assert t.pop(live.pop(user)).user_id == user
        assert {u: t.wire_id(u) for u in "xyz" if t.wire_id(u)} == live
