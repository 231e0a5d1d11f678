"""`pipeline router`: the front end. One loop owns every socket: the front ROUTER (clients,
the daemon's protocol) and each instance's DEALER (``upstream``).

State: the request table (router id -> the client identity, the client's id, its legs: the
instances running it, under their upstream ids, none yet while it waits; in disaggregated
mode its ``pd.PDState``) with its per-client index, the requests waiting for an instance to
come up, the stats ops fanned out to the instances, the drain. Router ids are the router's
own counter ("r12"), so two clients' ids never clash on an instance; a split request runs as
"r12.d" on its decode instance and "r12.p" on its prefill instance (``pd``).

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

import argparse
import math
import signal
import sys
import time
import traceback
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import msgspec
import zmq

from pipeline.frontend import protocol as P
from pipeline.frontend.args import cannot_start, is_loopback
from pipeline.gateway.systemd import Notifier
from pipeline.messages import ErrorInfo, RequestDelta, RequestResult, error_result
from pipeline.messages.kv import KVReservation
from pipeline.router.args import add_args, check_args
from pipeline.router.pd import DECODE, PREFILL, PDState, decode_request, prefill_request, runs_plain
from pipeline.router.policy import MixedPolicy, PoolPolicy, Target, prefix_key
from pipeline.router.stats import merge
from pipeline.router.upstream import PROBE_INTERVAL_S, Upstream

NO_INSTANCE_WAIT_S = 5.0  # a request waits this long for an instance to come up
STATS_TIMEOUT_S = 2.0  # a stats op answers with the instances that replied by then
ABORT_GRACE_S = 2.0  # after the drain's aborts, for the instances' abort answers
PING = P.encode(P.Ping())


__all__ = ["Router", "add_args", "check_args", "main"]


@dataclass(slots=True)
class Route:
    identity: bytes
    client_id: str
    msg: P.Generate  # the client's, under the router id
    key: bytes | None  # the prefix key (policy)
    deadline: float  # while no instance runs it: when to give up
    legs: dict[str, Upstream] = field(default_factory=dict)  # upstream id -> the instance running it
    pd: PDState | None = None  # split over a decode and a prefill instance


@dataclass(slots=True)
class StatsOp:
    identity: bytes
    client_id: str
    deadline: float
    waiting: set[str]  # instance addresses
    replies: list[dict[str, Any]] = field(default_factory=list)


class Router:
    def __init__(self, args: argparse.Namespace, notify: Notifier) -> None:
        self.args = args
        self.notify = notify
        self.ctx: zmq.Context = zmq.Context()
        self.policy = MixedPolicy()
        self.pools = PoolPolicy()
        self.split = bool(args.decode)  # disaggregated pools, else mixed replicas
        self.prefill = [Upstream(self.ctx, a, "prefill") for a in args.prefill]
        self.decode = [Upstream(self.ctx, a, "decode") for a in args.decode]
        self.upstreams = [Upstream(self.ctx, a) for a in args.instance] + self.prefill + self.decode
        self.routes: dict[str, Route] = {}
        self.clients: dict[bytes, dict[str, str]] = {}  # identity -> {client id: router id}
        self.pending: deque[str] = deque()  # router ids waiting for an instance, oldest first
        self.ops: dict[str, StatsOp] = {}
        self.seq = 0
        self.stopping = False
        self.drain_deadline: float | None = None
        self.abort_deadline: float | None = None
        self.last_loop = time.monotonic()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.mon: zmq.Socket | None = None

    # ---- start-up ----
    def open(self) -> None:
        s = self.sock
        s.setsockopt(zmq.ROUTER_MANDATORY, 1)
        s.setsockopt(zmq.LINGER, 1000)
        s.setsockopt(zmq.SNDHWM, 0)
        s.setsockopt(zmq.RCVHWM, 0)
        s.setsockopt(zmq.MAXMSGSIZE, self.args.max_frame_bytes + P.FRAME_SLACK_BYTES)
        s.setsockopt(zmq.TCP_KEEPALIVE, 1)
        s.setsockopt(zmq.TCP_KEEPALIVE_IDLE, P.KEEPALIVE_IDLE_S)
        s.setsockopt(zmq.TCP_KEEPALIVE_INTVL, P.KEEPALIVE_INTERVAL_S)
        s.setsockopt(zmq.TCP_KEEPALIVE_CNT, P.KEEPALIVE_PROBES)
        self.mon = s.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        try:
            s.bind(self.args.listen)
        except zmq.ZMQError as exc:
            raise ValueError(f"--listen {self.args.listen}: {exc.strerror} "
                             "(expected a free tcp://HOST:PORT or ipc://PATH)") from None

    # ---- to clients ----
    def _send(self, identity: bytes, frame: bytes) -> bool:
        try:
            self.sock.send_multipart([identity, frame], flags=zmq.NOBLOCK)
            return True
        except zmq.ZMQError as exc:
            if exc.errno in (zmq.EHOSTUNREACH, zmq.EAGAIN):
                self._drop_client(identity)
                return False
            raise

    def _reply(self, identity: bytes, msg: P.ReplyMsg) -> None:
        self._send(identity, P.encode(msg))

    def _finish(self, rid: str, res: RequestResult | None = None) -> None:
        """Forget a request; send its final (``res``, under the client's id) if given."""
        route = self.routes.pop(rid)
        own = self.clients[route.identity]
        del own[route.client_id]
        if not own:
            del self.clients[route.identity]
        for uid, u in route.legs.items():
            u.inflight.discard(uid)
        if res is not None:
            self._reply(route.identity, P.Final(result=msgspec.structs.replace(res, id=route.client_id)))

    def _fail(self, rid: str, code: str, message: str, finish_reason: str = "error") -> None:
        self._finish(rid, error_result(rid, code, message, finish_reason=finish_reason))

    def _abort(self, route: Route, but: str | None = None) -> None:
        """Abort a request on every instance running it (but the leg ``but``)."""
        if route.pd is not None:
            route.pd.aborting = True
        for uid, u in route.legs.items():
            if uid != but:
                u.send(P.Abort(id=uid))

    def _drop_client(self, identity: bytes) -> None:
        """Bye, or its connection is gone: abort its requests on their instances."""
        for rid in list(self.clients.get(identity, {}).values()):
            self._abort(self.routes[rid])
            self._finish(rid)
        for op_id in [k for k, op in self.ops.items() if op.identity == identity]:
            del self.ops[op_id]

    # ---- from clients ----
    def _receive(self) -> None:
        for _ in range(256):  # bounded, so the instances' answers are not starved by a flood
            try:
                identity, *rest = self.sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            try:
                if len(rest) != 1:
                    self._reply(identity, P.Error(id=None, error=P.invalid(
                        f"a message must be exactly 1 frame, got {len(rest)}")))
                else:
                    self._handle_frame(identity, rest[0])
            except Exception as exc:  # noqa: BLE001 -- one frame must not take the router down
                self._log_internal("handling a client frame")
                self._reply(identity, P.Error(id=None, error=ErrorInfo(
                    "internal_error", f"the router failed on a frame: {type(exc).__name__}: {exc}")))

    def _handle_frame(self, identity: bytes, frame: bytes) -> None:
        try:
            msg = P.decode_client(frame, self.args.max_frame_bytes)
        except P.ProtocolError as exc:
            self._refuse(identity, exc)
            return
        if isinstance(msg, P.Generate):
            self._generate(identity, msg)
        elif isinstance(msg, P.Abort):
            rid = self.clients.get(identity, {}).get(msg.id)
            if rid is not None:
                route = self.routes[rid]
                if not route.legs:
                    self._fail(rid, "aborted", "aborted by the client", "abort")
                else:
                    self._abort(route)  # its final comes from the (decode) instance
        elif isinstance(msg, P.Bye):
            self._drop_client(identity)
        elif isinstance(msg, P.Health):
            self._reply(identity, P.HealthReply(id=msg.id, status=self.status(), detail=self.detail()))
        elif isinstance(msg, P.Stats):
            self._stats(identity, msg.id)
        elif isinstance(msg, P.Metrics):
            self._reply(identity, P.Error(id=msg.id, error=ErrorInfo(
                "unsupported", "metrics: the router has none of its own; ask each instance")))
        # Ping: nothing to do.

    def _refuse(self, identity: bytes, exc: P.ProtocolError) -> None:
        """As the daemon does: a final only for a generate whose id is free, an error with
        the id only for health/stats, else an error with id null naming what was refused."""
        rid = exc.req_id
        if exc.op == "generate" and rid is not None and rid not in self.clients.get(identity, {}):
            self._reply(identity, P.Final(result=error_result(rid, exc.error.code, exc.error.message)))
        elif exc.op in ("health", "stats", "metrics") and rid is not None:
            self._reply(identity, P.Error(id=rid, error=exc.error))
        else:
            about = f"{exc.op or 'frame'} {rid!r}: " if rid is not None else ""
            self._reply(identity, P.Error(id=None, error=ErrorInfo(exc.error.code, about + exc.error.message)))

    def _generate(self, identity: bytes, msg: P.Generate) -> None:
        if msg.id is None:
            self._reply(identity, P.Error(id=None, error=P.invalid(
                "field `id`: required for a generate over ZMQ")))
            return
        client_id = str(msg.id)
        own = self.clients.setdefault(identity, {})
        if client_id in own:
            self._reply(identity, P.Error(id=None, error=ErrorInfo("duplicate_id", (
                f"field `id`: request {client_id!r} is already in flight from this client; this "
                "generate was not run (the running request's answer still comes)"))))
            return
        refusal: tuple[str, str] | None = None
        if self.stopping:
            refusal = ("draining", "the router is draining: it accepts no new requests")
        elif msg.kv_transfer is not None:  # it would bypass the split (or be refused there)
            refusal = ("invalid_request", "field `kv_transfer`: set by the router on its "
                       "instances, never by a client")
        if refusal is not None:
            if not own:
                del self.clients[identity]
            self._reply(identity, P.Final(result=error_result(client_id, *refusal)))
            return
        self.seq += 1
        rid = f"r{self.seq}"
        own[client_id] = rid
        route = Route(identity, client_id, msgspec.structs.replace(msg, id=rid), prefix_key(msg),
                      time.monotonic() + NO_INSTANCE_WAIT_S)
        if self.split and not runs_plain(msg):
            route.pd = PDState.of(msg)
        self.routes[rid] = route
        if not self._dispatch(rid):
            self.pending.append(rid)

    def _dispatch(self, rid: str) -> bool:
        """Send a request to the instance the policy picks (a split one: to a decode
        instance, while a prefill instance is up too); False if none is up."""
        route = self.routes[rid]
        if not self.split:
            return self._launch(route, rid, route.msg, self.upstreams,
                                lambda ups: self.policy.choose(ups, route.key))
        if route.pd is None:  # runs whole on a decode instance
            return self._launch(route, rid, route.msg, self.decode, self.pools.choose_decode)
        if not any(u.up for u in self.prefill):
            return False
        return self._launch(route, rid + DECODE, decode_request(route.msg, rid + DECODE),
                            self.decode, self.pools.choose_decode)

    def _launch(self, route: Route, uid: str, msg: P.Generate, pool: list[Upstream],
                choose: Callable[[list[Upstream]], Target]) -> bool:
        """Send ``msg`` (upstream id ``uid``) to one of ``pool``; False if none is up (True
        as well when the request went meanwhile: a lost instance's failures dropped its client)."""
        rid = uid.partition(".")[0]
        while ups := [u for u in pool if u.up]:
            target = choose(ups)
            assert isinstance(target, Upstream)
            if target.send(msg):
                route.legs[uid] = target
                target.inflight.add(uid)
                target.routed += 1
                return True
            self._down(target, "its connection is gone")
            if self.routes.get(rid) is not route:
                return True
        return False

    def _stats(self, identity: bytes, op_id: str) -> None:
        self.seq += 1
        key = f"q{self.seq}"
        op = StatsOp(identity, op_id, time.monotonic() + STATS_TIMEOUT_S, set())
        for u in self.upstreams:
            if u.up and u.send(P.Stats(id=key)):
                op.waiting.add(u.address)
        self.ops[key] = op
        self._maybe_answer(key)

    def _maybe_answer(self, key: str, expired: bool = False) -> None:
        """Answer a stats op once every instance asked replied (or it expired)."""
        op = self.ops[key]
        if op.waiting and not expired:
            return
        del self.ops[key]
        stats = merge(op.replies) | {"instances": {u.address: u.describe() for u in self.upstreams}}
        self._reply(op.identity, P.StatsReply(id=op.client_id, stats=stats))

    # ---- from instances ----
    def _from_upstream(self, u: Upstream) -> None:
        sock = u.sock
        for _ in range(1024):
            try:
                frame = sock.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            try:
                self._handle_reply(u, P.decode_reply(frame))
            except Exception:  # noqa: BLE001 -- one answer must not stop the others
                self._log_internal(f"handling an answer of {u.address}")
            if u.sock is not sock:
                return  # the instance went down meanwhile

    def _handle_reply(self, u: Upstream, msg: P.ReplyMsg) -> None:
        if isinstance(msg, P.Delta | P.Final):
            out = msg.delta if isinstance(msg, P.Delta) else msg.result
            rid = out.id.partition(".")[0]
            route = self.routes.get(rid)
            if route is None or route.legs.get(out.id) is not u:
                return  # its client is gone (or it failed); the instance was told to abort it
            if route.pd is not None:
                self._split_answer(route, rid, out.id, msg)
            elif isinstance(msg, P.Final):
                self._finish(rid, msg.result)
            else:
                self._forward(route, msg.delta)
        elif isinstance(msg, P.HealthReply):
            was = u.why_down
            up = u.on_health(msg.id, msg.status, msg.detail)
            if up and not u.up:
                u.up = True
                self._log(f"{u.name()} is up")
                self._dispatch_pending()
            elif up is False and u.up:
                self._down(u, u.why_down if msg.status == "ok" else f"its health check says {msg.status!r}")
            elif up is False and u.why_down != was:
                self._log(f"{u.name()} is not used: {u.why_down}")
        elif isinstance(msg, P.StatsReply):
            if msg.id.startswith("probe."):
                u.stats = msg.stats
            elif (op := self.ops.get(msg.id)) is not None and u.address in op.waiting:
                op.waiting.discard(u.address)
                op.replies.append(msg.stats)
                self._maybe_answer(msg.id)
        elif isinstance(msg, P.Error):
            if msg.id is not None and (op := self.ops.get(msg.id)) is not None:
                op.waiting.discard(u.address)
                self._maybe_answer(msg.id)
            elif msg.id is None:
                self._log(f"{u.name()} refused a frame: {msg.error.code}: {msg.error.message}")
        # Ping: the instance checking the router's connection; nothing to answer.

    def _forward(self, route: Route, delta: RequestDelta) -> None:
        self._reply(route.identity, P.Delta(delta=msgspec.structs.replace(delta, id=route.client_id)))

    def _split_answer(self, route: Route, rid: str, uid: str, msg: P.Delta | P.Final) -> None:
        """An answer of one leg of a split request (``pd.PDState`` decides what the client gets)."""
        pd = route.pd
        assert pd is not None
        if uid.endswith(DECODE):
            if isinstance(msg, P.Final):
                if pd.on_decode_final(msg.result):  # THE final; a prefill still running is not needed
                    self._abort(route, but=uid)
                    self._finish(rid, msg.result)
                    return
                # P decodes it (fell back): D is done; P's final, if in, is THE final.
                self._drop_leg(route, uid)
                if pd.prefill_final is not None:
                    self._finish(rid, pd.prefill_final)
                return
            kv, out = pd.on_decode_delta(msg.delta)
            if kv is not None:
                self._start_prefill(route, rid, kv)
            elif msg.delta.token_ids and not pd.decoding:
                pd.decoding = True
                if pd.prefill_done:
                    self._release_prefill(route, rid)
        elif isinstance(msg, P.Final):
            # Done on P, but its cache messager tells D the KV is in only after the last
            # layer: P's loss still fails the request until D has produced a token.
            failed = pd.on_prefill_final(msg.result)
            if failed is not None:  # P failed, or fell back: its final is THE final
                self._abort(route, but=uid)
                self._finish(rid, failed)
            elif msg.result.error is not None or pd.decoding:  # P has no more to say
                self._release_prefill(route, rid)
            return
        else:
            fell_back = pd.fell_back
            out = pd.on_prefill_delta(msg.delta)
            if pd.fell_back and not fell_back:
                # P decodes it: D's reservation (waiting for KV that never comes) can go.
                self._drop_leg(route, rid + DECODE, abort=True)
        if out is not None:
            self._forward(route, out)

    def _drop_leg(self, route: Route, uid: str, abort: bool = False) -> None:
        """Forget leg ``uid`` (its answers are dropped from now on), aborting it there."""
        leg = route.legs.pop(uid, None)
        if leg is not None:
            leg.inflight.discard(uid)
            if abort:
                leg.send(P.Abort(id=uid))

    def _release_prefill(self, route: Route, rid: str) -> None:
        """D decodes: the KV arrived, P's loss no longer matters to this request."""
        leg = route.legs.pop(rid + PREFILL, None)
        if leg is not None:
            leg.inflight.discard(rid + PREFILL)

    def _start_prefill(self, route: Route, rid: str, kv: KVReservation) -> None:
        """The decode instance reserved the prompt's KV: a prefill instance computes it."""
        uid = rid + PREFILL
        if not self._launch(route, uid, prefill_request(route.msg, uid, kv), self.prefill,
                            lambda ups: self.pools.choose_prefill(ups, route.key)):
            self._abort(route)
            self._fail(rid, "unavailable", "no prefill instance available: none of "
                       f"{' '.join(u.address for u in self.prefill)} is up")

    def _down(self, u: Upstream, why: str) -> None:
        lost = u.reset(why)
        self._log(f"{u.name()} is down ({why}); failing its {len(lost)} request(s)")
        for uid in lost:
            rid = uid.partition(".")[0]
            route = self.routes.get(rid)
            if route is None or route.legs.get(uid) is not u:
                continue
            del route.legs[uid]  # that connection is gone: nothing to abort there
            self._abort(route)
            self._fail(rid, "instance_failed", f"{u.name()} failed with the request in flight: {why}")
        for key in list(self.ops):
            if u.address in self.ops[key].waiting:
                self.ops[key].waiting.discard(u.address)
                self._maybe_answer(key)

    def _dispatch_pending(self) -> None:
        # Each in turn (oldest first): in disaggregated mode a request that runs whole needs
        # only a decode instance, so it does not wait behind a split one.
        waiting = list(self.pending)
        self.pending = deque(rid for rid in waiting if rid in self.routes and not self._dispatch(rid))

    # ---- the loop ----
    def _tick(self, now: float) -> None:
        """Timers: instance probes, waiting requests and stats ops past their time."""
        for u in self.upstreams:
            why = u.probe(now)
            if why is not None:
                self._down(u, why)
        self.pending = deque(rid for rid in self.pending if rid in self.routes)
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
        for identity in list(self.clients):
            self._send(identity, PING)

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
        assert self.mon is not None
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
                while True:
                    try:
                        self.mon.recv_multipart(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                next_tick = min(next_tick, now + 0.01)  # ping the clients: who left?
            if now >= next_tick:
                next_tick = now + min(PROBE_INTERVAL_S, P.HEARTBEAT_INTERVAL_S)
                self._tick(now)
            if self.stopping:
                if self.drain_deadline is None:
                    self.drain_deadline = now + self.args.drain_timeout
                    self.notify.stopping(f"draining {len(self.routes)} request(s)")
                if self._drain_step(now):
                    return 0

    def status(self) -> str:
        if self.stopping:
            return "draining"
        if self.split:  # a split request needs both pools
            return "ok" if any(u.up for u in self.prefill) and any(u.up for u in self.decode) else "starting"
        return "ok" if any(u.up for u in self.upstreams) else "starting"

    def detail(self) -> dict[str, Any]:
        return {"inflight": len(self.routes), "waiting_for_instance": len(self.pending),
                "instances": {u.address: u.describe() for u in self.upstreams}}

    def _on_signal(self, signum: int, frame: object) -> None:
        self.stopping = True

    def _log(self, text: str) -> None:
        print(f"[router] {text}", file=sys.stderr, flush=True)

    def _log_internal(self, what: str) -> None:
        self._log(f"internal error {what}, still serving:\n{traceback.format_exc()}")

    def run(self) -> int:
        old = {s: signal.signal(s, self._on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
        try:
            try:
                self.open()
            except ValueError as exc:
                return cannot_start("router", self.notify, exc)
            if not is_loopback(self.args.listen):
                self._log(f"WARNING: {self.args.listen} is not loopback: anyone who can reach "
                          "it can use the instances")
            return self.serve()
        finally:
            for s, h in old.items():
                signal.signal(s, h)
            self.close()

    def close(self) -> None:
        for u in self.upstreams:
            u.close()
        if self.mon is not None:
            self.sock.disable_monitor()
            self.mon.close(linger=0)
        self.sock.close(linger=1000)
        self.ctx.term()
        self.notify.close()


def main(args: argparse.Namespace) -> int:
    notify = Notifier.from_env()
    try:
        check_args(args)
    except ValueError as exc:
        code = cannot_start("router", notify, exc)
        notify.close()
        return code
    return Router(args, notify).run()
