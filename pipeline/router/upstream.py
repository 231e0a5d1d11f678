"""Router: the connection to one `pipeline serve` instance.

State: one DEALER socket (all the router's requests to this instance multiplexed on it,
under the router's own ids) and its monitor; its role (the pool it serves: mixed, prefill or
decode); whether the instance is up; the router ids in flight on it; the latest stats it
reported; the health probe outstanding. The instance is up from a health reply "ok" (in a
pool: whose detail names that role, when it names one) until its connection drops (the
monitor reports it at once, e.g. after a SIGKILL), a probe goes unanswered PROBE_TIMEOUT_S,
or it reports another status.
Going down replaces the socket: nothing queued for the old connection reaches a restarted
instance, and a live instance sees its client gone and aborts what the router had sent it.
Not thread-safe: the router's loop owns it.
"""
from __future__ import annotations

import time
from typing import Any

import zmq
from zmq.utils.monitor import recv_monitor_message

from pipeline.frontend import protocol as P
from pipeline.ipc.curve import client_socket_setup

PROBE_INTERVAL_S = 0.5
# The circuit breaker: an instance that went down BREAKER_FAILURES times within
# BREAKER_WINDOW_S is not sent requests for BREAKER_OUT_S, doubling each time it trips again
# (up to BREAKER_MAX_OUT_S) unless it served BREAKER_CALM_S since it was last back (then the
# doubling starts over: one bad hour last week does not cost five minutes today); its reason
# shows in health and stats ("out_until", "why_out").
BREAKER_FAILURES = 3
BREAKER_WINDOW_S = 60.0
BREAKER_OUT_S = 5.0
BREAKER_MAX_OUT_S = 300.0
BREAKER_CALM_S = 3600.0
PROBE_TIMEOUT_S = 3.0
# Dropped connections, and CURVE handshakes the instance refused (its keys are not ours, or
# it speaks no CURVE while we do, or the reverse): libzmq retries those forever in silence.
HANDSHAKE_FAILED = (zmq.EVENT_HANDSHAKE_FAILED_AUTH | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
                    | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL)
MONITOR_EVENTS = zmq.EVENT_DISCONNECTED | HANDSHAKE_FAILED


class Upstream:
    def __init__(self, ctx: zmq.Context, address: str, role: str = "mixed", curve_keys: str = "") -> None:
        self.ctx = ctx
        self.curve_keys = curve_keys  # "": plain; else the router is a CURVE client of the instance
        self.address = address
        self.role = role  # mixed (--instance: any instance serves) | prefill | decode
        self.up = False
        self.why_down = "not reached yet"
        self.inflight: set[str] = set()  # router ids this instance runs
        self.routed = 0  # requests sent to it, ever
        self.stats: dict[str, Any] = {}
        self.model: dict[str, Any] | None = None  # its health detail's "model" (the HTTP front's)
        self._probe: tuple[str, float] | None = None  # (health op id, sent at)
        self._seq = 0
        self._refused = False  # the instance's authenticator refused the router's keys
        self.failures: list[float] = []  # when it went down, within BREAKER_WINDOW_S
        self.out_until = 0.0  # the breaker: no requests before this (monotonic)
        self.out_for = BREAKER_OUT_S  # the next trip's length
        self.why_out: str | None = None
        self.sock, self.mon = self._connect()

    def _connect(self) -> tuple[zmq.Socket, zmq.Socket]:
        sock = self.ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.IMMEDIATE, 1)  # a send with no live connection fails at once
        sock.setsockopt(zmq.SNDHWM, 0)
        sock.setsockopt(zmq.RCVHWM, 0)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.TCP_KEEPALIVE, 1)
        sock.setsockopt(zmq.TCP_KEEPALIVE_IDLE, P.KEEPALIVE_IDLE_S)
        sock.setsockopt(zmq.TCP_KEEPALIVE_INTVL, P.KEEPALIVE_INTERVAL_S)
        sock.setsockopt(zmq.TCP_KEEPALIVE_CNT, P.KEEPALIVE_PROBES)
        if self.curve_keys:
            client_socket_setup(sock, self.curve_keys)
        mon = sock.get_monitor_socket(MONITOR_EVENTS)
        sock.connect(self.address)
        return sock, mon

    def send(self, msg: P.ClientMsg) -> bool:
        """False when the instance has no live connection (the caller takes it as down)."""
        try:
            self.sock.send(P.encode(msg), flags=zmq.NOBLOCK)
            return True
        except zmq.Again:
            return False

    def load(self) -> int:
        """Requests on it: the router's own (live) or what it last reported, the larger."""
        reported = int(self.stats.get("running", 0)) + int(self.stats.get("waiting", 0))
        return max(len(self.inflight), reported)

    def free_share(self) -> float:
        total = self.stats.get("kv_blocks_total", 0)
        return 1.0 if not total else self.stats.get("kv_blocks_free", 0) / total

    def tier_group(self) -> str:
        """Its KV tier's group (``EngineStats.kv_tier_group``): "" with no tier, or before
        its first stats reply."""
        group = self.stats.get("kv_tier_group", "")
        return group if isinstance(group, str) else ""

    def disconnected(self) -> bool:
        """Drain the monitor; True if it reported the connection dropped. A refused handshake
        sets ``why_down`` (the instance is not up, and never will be with these keys)."""
        dropped = False
        while True:
            try:
                event = recv_monitor_message(self.mon, zmq.NOBLOCK)
            except zmq.Again:
                return dropped
            if event["event"] & HANDSHAKE_FAILED:
                self.why_down = handshake_failure(event["event"], event["value"], bool(self.curve_keys))
                # libzmq does not retry a connection the instance's authenticator refused:
                # ``probe`` starts a fresh one, in case the instance admits the key later.
                self._refused = event["event"] == zmq.EVENT_HANDSHAKE_FAILED_AUTH
            else:
                dropped = True

    def probe(self, now: float) -> str | None:
        """Send the next health and stats probes; the reason to take the instance down
        if the previous probe went unanswered PROBE_TIMEOUT_S."""
        if self._refused and not self.up:
            self._refused = False
            self.close()
            self.sock, self.mon = self._connect()
            return None
        if self._probe is not None:
            op, sent = self._probe
            if now - sent < PROBE_TIMEOUT_S:
                return None
            self._probe = None
            if self.up:
                return f"no answer to a health check within {PROBE_TIMEOUT_S:g} s"
        self._seq += 1
        op = f"probe.{self._seq}"
        if self.send(P.Health(id=op)):
            self._probe = (op, now)
            self.send(P.Stats(id=op))
        return None

    def on_health(self, op: str, status: str, detail: dict[str, Any]) -> bool | None:
        """A health answer: whether the instance is now up (None if not our probe's). In a
        pool, an instance whose health names another role is not used (``why_down`` says so):
        a request split for that pool would only be refused there."""
        if self._probe is None or self._probe[0] != op:
            return None
        self._probe = None
        role = detail.get("role", self.role) if isinstance(detail, dict) else self.role
        if isinstance(detail, dict) and isinstance(detail.get("model"), dict):
            self.model = detail["model"]
        if status == "ok" and self.role != "mixed" and role != self.role:
            self.why_down = f"its role is {role!r}, not {self.role!r} (it is in the {self.role} pool)"
            return False
        return status == "ok"

    def failed(self, now: float, why: str) -> bool:
        """It went down; True if that trips the breaker (it is out for a while)."""
        self.failures = [t for t in self.failures if now - t < BREAKER_WINDOW_S] + [now]
        if len(self.failures) < BREAKER_FAILURES:
            return False
        self.failures.clear()
        if self.out_until and now - self.out_until >= BREAKER_CALM_S:
            self.out_for = BREAKER_OUT_S
        self.out_until = now + self.out_for
        self.why_out = (f"taken out for {self.out_for:g} s: down {BREAKER_FAILURES} times within "
                        f"{BREAKER_WINDOW_S:g} s, last: {why}")
        self.out_for = min(2 * self.out_for, BREAKER_MAX_OUT_S)
        return True

    def tripped(self, now: float) -> bool:
        return now < self.out_until

    def name(self) -> str:
        """How messages name it: "instance ADDR", or "decode instance ADDR" in a pool."""
        return f"instance {self.address}" if self.role == "mixed" else f"{self.role} instance {self.address}"

    def reset(self, why: str) -> list[str]:
        """The instance is down: a fresh socket; returns the router ids it was running."""
        self.up = False
        self.why_down = why
        self.stats = {}
        self._probe = None
        lost = sorted(self.inflight)
        self.inflight.clear()
        self.close()
        self.sock, self.mon = self._connect()
        return lost

    def describe(self) -> dict[str, Any]:
        out = self.tripped(time.monotonic())
        return {"role": self.role, "up": self.up, "why_down": None if self.up else self.why_down,
                "out": out, "why_out": self.why_out if out else None,
                "inflight": len(self.inflight), "routed": self.routed, "load": self.load(),
                "tier_group": self.tier_group()}

    def close(self) -> None:
        self.sock.disable_monitor()
        self.mon.close(linger=0)
        self.sock.close(linger=0)


def handshake_failure(event: int, value: int, curve: bool) -> str:
    """Why a refused handshake: what the router can tell from its own side (the instance
    reveals nothing about itself, by design)."""
    if event == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
        return (f"it refused the router's CURVE keys (ZAP status {value}): its "
                "authorized_clients does not hold the router's client.key")
    if curve:
        return ("the CURVE handshake failed: the instance's server key is not the router's "
                "--curve-keys server.key, or it runs without --curve-keys")
    return "the handshake failed: the instance uses --curve-keys and the router has none"
