"""`pipeline router`: the front end, on ``frontend.zmq_server`` (the client side: frames,
sessions, clients gone) over the request table (``table``) and the instances' answers
(``answers``). One loop owns every socket: the front ROUTER (clients, the daemon's protocol)
and each instance's DEALER (``upstream``). State here: the drain (stopping, its deadlines).

Every accepted generate gets exactly one final: the instance's (a split request's: the
decode instance's, or the prefill instance's when that failed or decoded the request itself,
``--pd-fallback local``), or the router's own when an
instance is lost with it in flight (``instance_failed``, naming the instance; the other leg
is aborted), no instance came up within NO_INSTANCE_WAIT_S (``unavailable``), or the drain
ran out.
Clients are held to the daemon's rules (``frontend.protocol``): bad frames get its error
answers, a duplicate id in flight gets ``duplicate_id``, and a client gone (bye, or its
connection dropped: ROUTER_MANDATORY pings, as the daemon does) has its requests aborted on
their instances. systemd Type=notify: READY=1 once listening, WATCHDOG=1 while the loop
turns, STOPPING=1 on drain. Exit status: 0 after a drain, 2 when start-up failed (one line).
"""
from __future__ import annotations

import math
import signal
import time
from collections import deque
from typing import TYPE_CHECKING, Any

import msgspec
import zmq

from pipeline.bind import is_loopback
from pipeline.frontend import protocol as P
from pipeline.frontend.args import cannot_start
from pipeline.frontend.zmq_server import DISCONNECT_SETTLE_S
from pipeline.gateway.systemd import Notifier
from pipeline.ipc.prctl import name_process
from pipeline.messages import ErrorInfo, error_result
from pipeline.router.answers import InstanceAnswers
from pipeline.router.args import add_args, check_args
from pipeline.router.pd import PDState, runs_plain
from pipeline.router.policy import prefix_key
from pipeline.router.table import NO_INSTANCE_WAIT_S, Route
from pipeline.router.upstream import PROBE_INTERVAL_S

ABORT_GRACE_S = 2.0  # after the drain's aborts, for the instances' abort answers

if TYPE_CHECKING:
    import argparse


__all__ = ["Router", "add_args", "main"]


class Router(InstanceAnswers):
    """The router's ZMQ front: an accepted generate goes to an instance (``_dispatch``)."""

    # ---- start-up ----
    def open(self) -> None:
        self._open_socket(self.ctx)
        if self.http is not None:
            # Bound before CURVE is set up: the front end's private ipc endpoint stays plain
            # (it is this user's only: HttpFront's 0700 directory), as in `pipeline serve`.
            self._bind(self.http.endpoint)
            self.http.bind()
        if self.args.curve_keys:
            self._secure(self.args.curve_keys)
        self._bind(self.args.listen)

    def _client_gone(self, identity: bytes, internals: list[str], why: str) -> None:
        """Bye, or its connection is gone: abort its requests on their instances."""
        for rid in internals:
            self._abort(self.routes[rid])
            self._finish(rid)
        for op_id in [k for k, op in self.ops.items() if op.identity == identity]:
            del self.ops[op_id]

    # ---- from clients ----
    def _abort_request(self, rid: str) -> None:
        route = self.routes[rid]
        if not route.legs:
            self._fail(rid, "aborted", "aborted by the client", "abort")
        else:
            self._abort(route)  # its final comes from the (decode) instance

    def _metrics(self, identity: bytes, op_id: str) -> None:
        self._reply(identity, P.Error(id=op_id, error=ErrorInfo(
            "unsupported", "metrics: the router has none of its own; ask each instance")))

    def _accept(self, identity: bytes, msg: P.Generate, client_id: str, rid: str) -> None:
        refusal: tuple[str, str] | None = None
        if self.stopping:
            refusal = ("draining", "the router is draining: it accepts no new requests")
        elif msg.kv_transfer is not None:  # it would bypass the split (or be refused there)
            refusal = ("invalid_request", "field `kv_transfer`: set by the router on its "
                       "instances, never by a client")
        if refusal is not None:
            self.sessions.finish(rid)
            self._final(identity, error_result(client_id, *refusal))
            return
        route = Route(identity, client_id, msgspec.structs.replace(msg, id=rid), prefix_key(msg),
                      time.monotonic() + NO_INSTANCE_WAIT_S)
        if self.split and not runs_plain(msg):
            route.pd = PDState.of(msg)
        self.routes[rid] = route
        if not self._dispatch(rid):
            self.pending.append(rid)

    # ---- the loop ----
    def _tick(self, now: float) -> None:
        """Timers: instance probes, waiting requests and stats ops past their time."""
        for u in self.upstreams:
            why = u.probe(now)
            if why is not None:
                self._down(u, why)
        self.pending = deque(rid for rid in self.pending if rid in self.routes)
        if self.pending:  # an instance the breaker took out may be back (no health change says so)
            self._dispatch_pending()
        while self.pending and now >= self.routes[self.pending[0]].deadline:
            rid = self.pending.popleft()
            role, pool = "", self.upstreams
            if self.split:  # name the pool that has no instance up
                split = self.routes[rid].pd is not None and any(u.up for u in self.decode)
                role, pool = ("prefill ", self.prefill) if split else ("decode ", self.decode)
            self._fail(rid, "unavailable", (
                f"no {role}instance available: none of {' '.join(u.address for u in pool)} passed "
                f"its health check within {NO_INSTANCE_WAIT_S:g} s"))
        for key in [k for k, op in self.ops.items() if now >= op.deadline]:
            self._maybe_answer(key, expired=True)
        self._probe_clients()

    def _drain_step(self, now: float) -> bool:
        """True when the router may exit."""
        if not self.routes:
            return True
        assert self.drain_deadline is not None
        if self.abort_deadline is None and now >= self.drain_deadline:
            self._log(f"drain timeout: aborting {len(self.routes)} request(s)")
            self.abort_deadline = now + ABORT_GRACE_S
            for rid, route in list(self.routes.items()):
                if rid not in self.routes:  # a failed send to its client dropped it
                    continue
                if not route.legs:
                    self._fail(rid, "aborted", "aborted by the router: it shut down", "abort")
                else:
                    self._abort(route)
        if self.abort_deadline is not None and now >= self.abort_deadline:
            for rid in list(self.routes):
                self._fail(rid, "aborted", "aborted by the router: it shut down before the "
                                           "request finished", "abort")
            return True
        return False

    def serve(self) -> int:
        assert self.sock is not None and self.mon is not None
        self.notify.ready(f"routing {self.args.listen} to {len(self.upstreams)} instance(s)")
        self.notify.start_watchdog(lambda: time.monotonic() - self.last_loop < 5.0)
        self._log(f"serving on {self.args.listen}, " + (
            f"prefill: {' '.join(self.args.prefill)}, decode: {' '.join(self.args.decode)}"
            if self.split else f"instances: {' '.join(self.args.instance)}"))
        next_tick = 0.0
        while True:
            poller = zmq.Poller()  # the instances' sockets change when one goes down
            for s in (self.sock, self.mon, *(x for u in self.upstreams for x in (u.sock, u.mon))):
                poller.register(s, zmq.POLLIN)
            wait = max(0.0, next_tick - time.monotonic())
            events = dict(poller.poll(math.ceil(wait * 1000)))
            now = self.last_loop = time.monotonic()
            for u in self.upstreams:
                if u.sock in events:  # first: answers that came before a disconnect count
                    self._from_upstream(u)
                if u.mon in events and u.disconnected() and u.up:
                    self._down(u, "its connection closed")
            if self.sock in events:
                self._receive()
            if self.mon in events:
                self._read_disconnects()
                next_tick = min(next_tick, now + DISCONNECT_SETTLE_S)  # ping the clients: who left?
            if now >= next_tick:
                next_tick = now + min(PROBE_INTERVAL_S, P.HEARTBEAT_INTERVAL_S)
                self._tick(now)
                self._check_http()
            if self.stopping:
                if self.drain_deadline is None:
                    self.drain_deadline = now + self.args.drain_timeout
                    self.notify.stopping(f"draining {len(self.routes)} request(s)")
                if self._drain_step(now):
                    return 0

    def _check_http(self) -> None:
        """Start the HTTP front end once an instance told the model (it serves that model's
        name, limits and tokenizer: every instance behind a router serves the same model),
        and restart it if it died. Connections wait in the socket's backlog meanwhile."""
        if self.http is None or self.stopping:
            return
        try:
            if self.http.spec is None:
                model = next((u.model for u in self.upstreams if u.up and u.model), None)
                if model is not None:
                    self.http.start(dict(model, api_key=self.args.api_key))
                    self._log(f"OpenAI API on {self.http.url}/v1")
            else:
                self.http.check(self._log)
        except (RuntimeError, OSError, TypeError) as exc:  # tried again at the next tick
            self._log(f"the HTTP front end: {exc}")

    def status(self) -> str:
        if self.stopping:
            return "draining"
        if self.split:  # a split request needs both pools
            return "ok" if any(u.up for u in self.prefill) and any(u.up for u in self.decode) else "starting"
        return "ok" if any(u.up for u in self.upstreams) else "starting"

    def health_detail(self) -> dict[str, Any]:
        return {"inflight": len(self.routes), "waiting_for_instance": len(self.pending),
                "http": None if self.http is None else self.http.detail(),
                "instances": {u.address: u.describe() for u in self.upstreams}}

    def _on_signal(self, signum: int, frame: object) -> None:
        self.stopping = True

    def run(self) -> int:
        old = {s: signal.signal(s, self._on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
        try:
            try:
                self.open()
            except ValueError as exc:
                return cannot_start("router", self.notify, exc)
            if not self.args.curve_keys and not is_loopback(self.args.listen):  # --allow-insecure-network
                self._log(f"WARNING: {self.args.listen} is not loopback and has no --curve-keys: "
                          "anyone who can reach it can use the instances")
            return self.serve()
        finally:
            for s, h in old.items():
                signal.signal(s, h)
            self.close()

    def close(self) -> None:
        if self.http is not None:
            self.http.close()  # after the drain: it answered 503 to new requests meanwhile
        for u in self.upstreams:
            u.close()
        self._close_socket()
        self.ctx.term()
        self.notify.close()


def main(args: argparse.Namespace) -> int:
    notify = Notifier.from_env()
    try:
        router_args = check_args(args)
    except ValueError as exc:
        code = cannot_start("router", notify, exc)
        notify.close()
        return code
    name_process("router")
    return Router(router_args, notify).run()
