"""`pipeline router`: the request table and what sends requests to the instances.

State: the request table (router id -> the client identity, the client's id, its legs: the
instances running it, under their upstream ids, none yet while it waits; in disaggregated
mode its ``pd.PDState``), the requests waiting for an instance to come up, the stats ops
fanned out to the instances, the instances (``upstream``), the policies that pick one and
how many requests each rule of the cache-aware one sent (``routed_by``).
Router ids are the sessions' ("r12", ``frontend.sessions``), so two clients' ids never clash
on an instance; a split request runs as "r12.d" on its decode instance and "r12.p" on its
prefill instance (``pd``). The answers from instances are ``answers``'; the client side, the
loop and the drain ``server``'s.
"""
from __future__ import annotations

import os
import sys
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import msgspec
import zmq

from pipeline.frontend import protocol as P
from pipeline.frontend.zmq_server import ZmqServer
from pipeline.gateway.systemd import Notifier
from pipeline.http.launcher import ROUTER_ID, HttpFront
from pipeline.messages import RequestResult, error_result
from pipeline.router.args import RouterArgs
from pipeline.router.pd import DECODE, PREFILL, PDState, decode_request
from pipeline.router.policy import RULES, MixedPolicy, PoolPolicy, Target
from pipeline.router.stats import merge
from pipeline.router.upstream import Upstream

STATS_TIMEOUT_S = 2.0  # a stats op answers with the instances that replied by then
NO_INSTANCE_WAIT_S = 5.0  # a request waits this long for an instance to come up
MAX_TRIES = 2  # a request lost with an instance before its first token runs again elsewhere


@dataclass(slots=True)
class Route:
    identity: bytes
    client_id: str
    msg: P.Generate  # the client's, under the router id
    key: bytes | None  # the prefix key (policy)
    deadline: float  # while no instance runs it: when to give up
    legs: dict[str, Upstream] = field(default_factory=dict)  # upstream id -> the instance running it
    pd: PDState | None = None  # split over a decode and a prefill instance
    answered: bool = False  # the client has had a delta: too late to run it elsewhere
    aborted: bool = False  # the client (or the drain) aborted it: never run again
    tries: int = 0  # instances it was sent to (a split request: decode instances), MAX_TRIES


@dataclass(slots=True)
class StatsOp:
    identity: bytes
    client_id: str
    deadline: float
    waiting: set[str]  # instance addresses
    replies: list[dict[str, Any]] = field(default_factory=list)


class RequestTable(ZmqServer):
    """The router's requests and instances (the base of ``server.Router``)."""
    what = "router"
    log_prefix = "[router]"

    def __init__(self, args: RouterArgs, notify: Notifier) -> None:
        super().__init__(args.max_frame_bytes, id_prefix="r")  # router ids: "r12"
        self.args = args
        self.notify = notify
        self.ctx: zmq.Context = zmq.Context()
        self.policy = MixedPolicy()
        self.pools = PoolPolicy()
        # Requests sent by each rule of the cache-aware policy (mixed, or the prefill pool's
        # legs): the stats reply's ``router_routed``.
        self.routed_by = dict.fromkeys(RULES, 0)
        self.split = bool(args.decode)  # disaggregated pools, else mixed replicas
        keys = args.curve_keys
        self.prefill = [Upstream(self.ctx, a, "prefill", keys) for a in args.prefill]
        self.decode = [Upstream(self.ctx, a, "decode", keys) for a in args.decode]
        self.upstreams = [Upstream(self.ctx, a, "mixed", keys) for a in args.instance] + self.prefill + self.decode
        self.routes: dict[str, Route] = {}
        self.pending: deque[str] = deque()  # router ids waiting for an instance, oldest first
        self.ops: dict[str, StatsOp] = {}
        self.seq = 0  # stats ops' ids: "q7"
        self.stopping = False
        self.drain_deadline: float | None = None
        self.abort_deadline: float | None = None
        self.last_loop = time.monotonic()
        self.http = HttpFront(args.http, f"{ROUTER_ID}{os.getpid()}") if args.http else None

    # ---- a request's end ----
    def _finish(self, rid: str, res: RequestResult | None = None) -> None:
        """Forget a request; send its final (``res``, under the client's id) if given."""
        route = self.routes.pop(rid)
        self.sessions.finish(rid)  # already forgotten if its client is gone
        for uid, u in route.legs.items():
            u.inflight.discard(uid)
        if res is not None:
            self._reply(route.identity, P.Final(result=msgspec.structs.replace(res, id=route.client_id)))

    def _fail(self, rid: str, code: str, message: str, finish_reason: str = "error") -> None:
        self._finish(rid, error_result(rid, code, message, finish_reason=finish_reason))

    def _abort(self, route: Route, but: str | None = None) -> None:
        """Abort a request on every instance running it (but the leg ``but``)."""
        route.aborted = True
        if route.pd is not None:
            route.pd.aborting = True
        for uid, u in route.legs.items():
            if uid != but:
                u.send(P.Abort(id=uid))

    def _dispatch(self, rid: str) -> bool:
        """Send a request to the instance the policy picks (a split one: to a decode
        instance, while a prefill instance is up too); False if none is up."""
        route = self.routes[rid]
        if not self.split:
            return self._launch(route, rid, route.msg, self.upstreams,
                                lambda ups: self.policy.choose(ups, route.key), self.policy)
        if route.pd is None:  # runs whole on a decode instance
            return self._launch(route, rid, route.msg, self.decode, self.pools.choose_decode)
        if not any(u.up for u in self.prefill):
            return False
        uid = route.pd.leg(rid, DECODE)
        return self._launch(route, uid, decode_request(route.msg, uid), self.decode,
                            self.pools.choose_decode)

    def _launch(self, route: Route, uid: str, msg: P.Generate, pool: list[Upstream],
                choose: Callable[[list[Upstream]], Target], policy: MixedPolicy | None = None) -> bool:
        """Send ``msg`` (upstream id ``uid``) to one of ``pool``; False if none is up (True
        as well when the request went meanwhile: a lost instance's failures dropped its client).
        ``policy``: the cache-aware one behind ``choose``, whose rule is counted once sent."""
        rid = uid.partition(".")[0]
        now = time.monotonic()
        while ups := [u for u in pool if u.up and not u.tripped(now)]:
            target = choose(ups)
            assert isinstance(target, Upstream)
            if target.send(msg):
                route.legs[uid] = target
                target.inflight.add(uid)
                target.routed += 1
                route.tries += not uid.endswith(PREFILL)  # a split request's try is its decode leg
                if policy is not None:  # its last choice is this one: a failed send chose again
                    self.routed_by[policy.by] += 1
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
        stats = merge(op.replies) | {"router_routed": dict(self.routed_by),
                                     "instances": {u.address: u.describe() for u in self.upstreams}}
        self._reply(op.identity, P.StatsReply(id=op.client_id, stats=stats))

    # ---- an instance lost ----
    def _down(self, u: Upstream, why: str) -> None:
        lost = u.reset(why)
        if u.failed(time.monotonic(), why):
            self._log(f"{u.name()} is taken out: {u.why_down}")
        self._log(f"{u.name()} is down ({why}); {len(lost)} request(s) lost with it")
        for uid in lost:
            rid = uid.partition(".")[0]
            route = self.routes.get(rid)
            if route is None or route.legs.get(uid) is not u:
                continue
            del route.legs[uid]  # that connection is gone: nothing to abort there
            if not route.answered and not route.aborted and route.tries < MAX_TRIES \
                    and self._rerun(rid, route):
                continue
            self._abort(route)
            self._fail(rid, "instance_failed", f"{u.name()} failed with the request in flight: {why}")
        for key in list(self.ops):
            if u.address in self.ops[key].waiting:
                self.ops[key].waiting.discard(u.address)
                self._maybe_answer(key)

    def _rerun(self, rid: str, route: Route) -> bool:
        """Nothing of the request reached its client yet: run it again from the start, on
        another instance; False when it cannot be (a split request needs both pools up now).
        A plain request waits NO_INSTANCE_WAIT_S for an instance if none is up. A split one
        starts over under new leg ids (``PDState.of``): its other leg is aborted (a decode
        instance's reservation, or a prefill instance writing into a reservation that is gone)."""
        if route.pd is None:
            if not self._dispatch(rid):
                route.deadline = time.monotonic() + NO_INSTANCE_WAIT_S
                self.pending.append(rid)
            return True
        if not any(u.up and not u.tripped(time.monotonic()) for u in self.prefill):
            return False
        for uid, leg in route.legs.items():
            leg.inflight.discard(uid)
            leg.send(P.Abort(id=uid))
        route.legs.clear()
        route.pd = PDState.of(route.msg, route.tries)
        return self._dispatch(rid)

    def _dispatch_pending(self) -> None:
        # Each in turn (oldest first): in disaggregated mode a request that runs whole needs
        # only a decode instance, so it does not wait behind a split one.
        waiting = list(self.pending)
        self.pending = deque(rid for rid in waiting if rid in self.routes and not self._dispatch(rid))

    def _log(self, text: str) -> None:
        print(f"[router] {text}", file=sys.stderr, flush=True)
