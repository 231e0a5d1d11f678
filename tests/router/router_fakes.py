"""The router's tests against scripted instances: ``FakeInstance`` (a ZMQ ROUTER in the test
that speaks the daemon's wire protocol, answers health and stats probes itself and hands
every generate and abort to the test), ``Cli`` (a raw DEALER client: every frame the router
sends is seen), the real ``Router`` run in a thread (``run_router``), and the answers' builders.
Every wait here is bounded (WAIT_S unless given): a missing answer fails a test, never hangs it.
"""
from __future__ import annotations

import argparse
import queue
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import zmq
from e2e_helpers import free_port

from pipeline.frontend import protocol as P
from pipeline.gateway.systemd import Notifier
from pipeline.messages import RequestDelta, RequestResult
from pipeline.messages.answers import Timings, Usage
from pipeline.messages.kv import KVReservation
from pipeline.router.args import add_args, check_args
from pipeline.router.server import Router

WAIT_S = 5.0
RESERVATION = KVReservation(engine_req_id="d-engine-7", block_ids=[5, 9, 2], num_cached_tokens=16,
                            endpoint="tcp://127.0.0.1:7300", timeout_s=30.0)
PROMPT = "the for statement is used to iterate over the elements of a sequence"


class FakeInstance:
    """A scripted `pipeline serve --role ROLE`: answers health (``status``, "ok" unless the
    test sets another, and its role) and stats; generates and aborts go to ``expect``;
    ``send`` answers the router (in order)."""

    def __init__(self, role: str) -> None:
        self.role = role
        self.status = "ok"  # what its health answers say
        self.tier_group = ""  # its stats' kv_tier_group
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        port = self.sock.bind_to_random_port("tcp://127.0.0.1")
        self.address = f"tcp://127.0.0.1:{port}"
        self.got: queue.Queue[P.ClientMsg] = queue.Queue()
        self.out: queue.Queue[P.ReplyMsg] = queue.Queue()
        self.peer: bytes | None = None  # the router's DEALER
        self.received = 0
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._loop, daemon=True)
        self.thread.start()

    def _loop(self) -> None:
        try:
            while not self.stop.is_set():
                if self.sock.poll(5):
                    self.peer, frame = self.sock.recv_multipart()
                    self._on(P.decode_client(frame))
                while not self.out.empty() and self.peer is not None:
                    self.sock.send_multipart([self.peer, P.encode(self.out.get())])
        finally:
            self.sock.close(linger=0)  # the router's monitor sees the connection drop
            self.ctx.term()

    def _on(self, msg: P.ClientMsg) -> None:
        assert self.peer is not None
        if isinstance(msg, P.Health):
            reply: P.ReplyMsg = P.HealthReply(id=msg.id, status=self.status, detail={"role": self.role})
        elif isinstance(msg, P.Stats):
            reply = P.StatsReply(id=msg.id, stats={
                "running": 0, "waiting": 0, "kv_blocks_total": 100, "kv_blocks_free": 80, "kv_blocks_used": 20,
                "requests_received": self.received, "kv_usage": 0.2, "kv_tier_group": self.tier_group})
        else:
            self.received += isinstance(msg, P.Generate)
            self.got.put(msg)
            return
        self.sock.send_multipart([self.peer, P.encode(reply)])

    def expect(self, kind: type, timeout: float = WAIT_S) -> Any:
        msg = self.got.get(timeout=timeout)
        assert isinstance(msg, kind), msg
        return msg

    def send(self, msg: P.ReplyMsg) -> None:
        self.out.put(msg)

    def close(self) -> None:
        self.stop.set()
        self.thread.join(10)


class Cli:
    """A client: one DEALER; ``recv`` skips the router's liveness pings."""

    def __init__(self, address: str) -> None:
        self.sock = zmq.Context.instance().socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.SNDTIMEO, int(WAIT_S * 1000))  # every wait bounded
        self.sock.connect(address)

    def send(self, msg: P.ClientMsg) -> None:
        self.sock.send(P.encode(msg))

    def recv(self, timeout: float = WAIT_S) -> P.ReplyMsg:
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            assert left > 0 and self.sock.poll(int(left * 1000)), "no answer from the router"
            msg = P.decode_reply(self.sock.recv())
            if not isinstance(msg, P.Ping):
                return msg

    def close(self) -> None:
        self.sock.close(linger=0)

    def health(self) -> P.HealthReply:
        self.send(P.Health(id="h"))
        while not isinstance(msg := self.recv(), P.HealthReply):
            pass
        return msg


def wait_for(cond, what: str, timeout: float = WAIT_S) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def result(rid: str, token_ids: list[int], text: str, finish: str = "length") -> RequestResult:
    return RequestResult(id=rid, text=text, token_ids=token_ids, finish_reason=finish,
                         usage=Usage(prompt_tokens=12, completion_tokens=len(token_ids)),
                         timings=Timings(arrival_time=1.0))


def delta(rid: str, token_ids: list[int], text: str, kv: KVReservation | None = None) -> P.Delta:
    return P.Delta(delta=RequestDelta(rid, text, token_ids, kv=kv))



def parse_router_args(argv: list[str]) -> argparse.Namespace:
    """The router's flags as its command line parses them (every default included)."""
    p = argparse.ArgumentParser()
    add_args(p)
    return p.parse_args(argv)


@contextmanager
def run_router(*flags: str) -> Iterator[Router]:
    """The real router on a free loopback port, its loop in a thread; drained on exit (as on
    SIGTERM), then checked: exit 0, no request, session or leg left."""
    args = parse_router_args(["--listen", f"tcp://127.0.0.1:{free_port()}", "--drain-timeout", "5",
                              *flags])
    router = Router(check_args(args), Notifier(None))
    router.open()
    code: list[int] = []
    thread = threading.Thread(target=lambda: code.append(router.serve()), daemon=True)
    thread.start()
    try:
        yield router
    finally:
        router.stopping = True  # the drain, as on SIGTERM
        thread.join(20)
        router.close()
    assert code == [0] and not router.routes and not router.sessions
    assert all(not u.inflight for u in router.upstreams)
