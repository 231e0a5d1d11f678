"""`pipeline router`: the answers of the instances: deltas and finals forwarded to their
clients (a split request's through its ``pd.PDState``), health replies that bring an
instance up or down, stats replies for the stats ops. Owns no state of its own: the request
table is ``table``'s.
"""
from __future__ import annotations

import msgspec
import zmq

from pipeline.frontend import protocol as P
from pipeline.messages import RequestDelta
from pipeline.messages.kv import KVReservation
from pipeline.router.pd import DECODE, PREFILL, prefill_request
from pipeline.router.table import RequestTable, Route
from pipeline.router.upstream import Upstream


class InstanceAnswers(RequestTable):
    """What the router does with each answer of an instance (the base of ``server.Router``)."""

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
        route.answered = True
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
                self._drop_leg(route, pd.leg(rid, DECODE), abort=True)
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
        assert route.pd is not None
        uid = route.pd.leg(rid, PREFILL)
        leg = route.legs.pop(uid, None)
        if leg is not None:
            leg.inflight.discard(uid)

    def _start_prefill(self, route: Route, rid: str, kv: KVReservation) -> None:
        """The decode instance reserved the prompt's KV: a prefill instance computes it."""
        assert route.pd is not None
        uid = route.pd.leg(rid, PREFILL)
        if not self._launch(route, uid, prefill_request(route.msg, uid, kv), self.prefill,
                            lambda ups: self.pools.choose_prefill(ups, route.key), self.pools.prefill):
            self._abort(route)
            self._fail(rid, "unavailable", "no prefill instance available: none of "
                       f"{' '.join(u.address for u in self.prefill)} is up")
