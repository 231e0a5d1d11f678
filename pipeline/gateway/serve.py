"""`pipeline serve`: the daemon. Gateway front end speaking the ZMQ protocol (``protocol``).

Owns the ROUTER socket and the client sessions (which client waits for which request); the
stages, the in-flight table and supervision belong to the Gateway. One thread (this
module's loop) touches the socket: client frames in, answers out. Answers produced by the
gateway's threads reach it through a queue plus a wake-up pipe the poller watches. systemd
Type=notify: READY=1 once serving, STATUS= lines, WATCHDOG=1 while healthy, STOPPING=1 on
drain. Exit status: 0 after a clean drain, 1 when a stage died, 2 when start-up failed.
"""
from __future__ import annotations

import argparse
import ipaddress
import os
import queue
import signal
import sys
import threading
import time
from typing import TYPE_CHECKING
from urllib.parse import urlparse

import msgspec
import zmq

from pipeline.config import add_engine_args, config_from_args
from pipeline.gateway import protocol as P
from pipeline.gateway.gateway import Answer, Gateway
from pipeline.gateway.metrics import Metrics
from pipeline.gateway.sessions import ClientSessions, DuplicateRequestId
from pipeline.gateway.supervisor import StartupError
from pipeline.gateway.systemd import Notifier
from pipeline.messages import RequestResult, error_result

if TYPE_CHECKING:
    from zmq.auth.thread import ThreadAuthenticator

DEFAULT_LISTEN = "tcp://127.0.0.1:7001"


def add_args(p: argparse.ArgumentParser) -> None:
    add_engine_args(p)
    p.add_argument("--listen", default=DEFAULT_LISTEN,
                   help="ZMQ endpoint to bind (loopback by default; tcp://0.0.0.0:PORT to open it)")
    p.add_argument("--curve-keys", default=None, metavar="DIR",
                   help="enable ZMQ CURVE: DIR holds server.key_secret and authorized client keys")
    p.add_argument("--metrics-port", type=int, default=0, help="Prometheus /metrics port (0: off)")
    p.add_argument("--metrics-host", default="127.0.0.1")
    p.add_argument("--drain-timeout", type=float, default=30.0,
                   help="on SIGTERM/Ctrl-C, seconds to let in-flight requests finish")
    p.add_argument("--max-frame-bytes", type=int, default=P.MAX_FRAME_BYTES)


def is_loopback(endpoint: str) -> bool:
    u = urlparse(endpoint)
    if u.scheme in ("ipc", "inproc"):
        return True
    host = (u.hostname or "").strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class Server:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.answers: queue.SimpleQueue[Answer] = queue.SimpleQueue()
        self.wake_r, self.wake_w = os.pipe()
        os.set_blocking(self.wake_r, False)
        os.set_blocking(self.wake_w, False)
        self.config = config_from_args(args)
        self.gw = Gateway(self.config, self._on_output)
        self.sessions = ClientSessions()
        self.notify = Notifier.from_env()  # also keeps the stages from talking to systemd
        self.metrics = Metrics()
        self.last_loop = time.monotonic()  # the watchdog pings only while the loop turns
        self.stop = threading.Event()
        self.draining: threading.Thread | None = None
        self.sock: zmq.Socket | None = None
        self.auth: ThreadAuthenticator | None = None  # the CURVE authenticator thread, when --curve-keys
        # Gateway-only counters; finished requests by reason are in the metrics.
        self.counters = {"requests_received": 0, "requests_rejected": 0, "malformed_frames": 0,
                         "clients_dropped": 0}

    # Called from the gateway's threads.
    def _on_output(self, out: Answer) -> None:
        self.answers.put(out)
        try:
            os.write(self.wake_w, b"\0")
        except BlockingIOError:
            pass  # the pipe is full, so the loop is awake anyway

    def _reply(self, identity: bytes, msg: P.ReplyMsg) -> bool:
        assert self.sock is not None  # set by serve(), whose loop is the only caller
        try:
            self.sock.send_multipart([identity, P.encode(msg)], flags=zmq.NOBLOCK)
            return True
        except zmq.ZMQError as exc:
            if exc.errno in (zmq.EHOSTUNREACH, zmq.EAGAIN):
                self._drop_client(identity)
                return False
            raise

    def _drop_client(self, identity: bytes) -> None:
        ids = self.sessions.drop_client(identity)
        if ids:
            self.counters["clients_dropped"] += 1
            self.gw.abort(ids)

    def _route_answers(self) -> None:
        try:
            while os.read(self.wake_r, 4096):
                pass
        except BlockingIOError:
            pass
        while True:
            try:
                out = self.answers.get_nowait()
            except queue.Empty:
                return
            if isinstance(out, RequestResult):
                self.metrics.observe_result(out)
                owner = self.sessions.finish(out.id)
            else:
                owner = self.sessions.owner(out.id)
            if owner is None:
                continue  # its client is gone; the engine was told to abort it
            identity, client_id = owner
            out = msgspec.structs.replace(out, id=client_id)
            self._reply(identity, P.Final(result=out) if isinstance(out, RequestResult) else P.Delta(delta=out))

    def _handle_frame(self, identity: bytes, frame: bytes, now: float) -> None:
        self.sessions.seen(identity, now)
        try:
            msg = P.decode_client(frame, self.args.max_frame_bytes)
        except P.ProtocolError as exc:
            self.counters["malformed_frames"] += 1
            if exc.op == "generate" and exc.req_id is not None \
                    and self.sessions.internal_id(identity, exc.req_id) is None:
                self._reply(identity, P.Final(result=error_result(exc.req_id, exc.error.code,
                                                                  exc.error.message)))
            else:
                self._reply(identity, P.Error(id=exc.req_id, error=exc.error))
            return
        if isinstance(msg, P.Generate):
            self._generate(identity, msg, now)
        elif isinstance(msg, P.Abort):
            internal = self.sessions.internal_id(identity, msg.id)
            if internal is not None:
                self.gw.abort([internal])
        elif isinstance(msg, P.Bye):
            self._drop_client(identity)
        elif isinstance(msg, P.Health):
            self._reply(identity, P.HealthReply(id=msg.id, status=self.status(),
                                                detail=self.health_detail()))
        elif isinstance(msg, P.Stats):
            self._reply(identity, P.StatsReply(id=msg.id, stats=self.stats()))
        # Ping: being seen is all it is for.

    def _generate(self, identity: bytes, msg: P.Generate, now: float) -> None:
        self.counters["requests_received"] += 1
        if msg.id is None:
            self._reply(identity, P.Error(id=None, error=P.invalid("field `id`: required for a "
                                                                   "generate over ZMQ")))
            return
        client_id = str(msg.id)
        try:
            sp = P.sampling_params(msg)
            internal = self.sessions.start(identity, client_id, now)
        except P.ProtocolError as exc:
            self.counters["requests_rejected"] += 1
            self._reply(identity, P.Final(result=error_result(client_id, exc.error.code,
                                                              exc.error.message)))
            return
        except DuplicateRequestId as exc:
            self.counters["requests_rejected"] += 1
            self._reply(identity, P.Final(result=error_result(client_id, "duplicate_id", str(exc))))
            return
        # A refusal (draining, stage died) comes back as an error answer through the queue.
        self.gw.submit(P.gateway_request(msg, sp, internal))

    # ---- observability ----
    def status(self) -> str:
        if self.gw.failure is not None:
            return "failed"
        return "draining" if self.stop.is_set() else "ok"

    def health_detail(self) -> dict:
        return {"inflight": self.gw.num_inflight(), "client_requests": len(self.sessions),
                "stages": self.gw.stats_stages(), "failure": self.gw.failure}

    def _feed_engine_state(self) -> None:
        e = self.gw.engine_stats
        if e.timestamp:  # the engine has published at least once
            self.metrics.set_engine_state(
                running=e.running, waiting=e.waiting, kv_blocks_used=e.kv_blocks_used,
                kv_blocks_cached=e.kv_blocks_cached, kv_blocks_total=e.kv_blocks_total,
                prefix_cache_queries=e.prefix_cache_queried_tokens,
                prefix_cache_hits=e.prefix_cache_hit_tokens, preemptions=e.num_preemptions)

    def healthy(self) -> bool:
        return self.gw.failure is None and time.monotonic() - self.last_loop < 5.0

    def stats(self) -> dict:
        """Engine counters and gauges (scheduler, KV blocks, step timing), the gateway's
        counters, and the metrics (TTFT/ITL/e2e histograms) as Prometheus sees them."""
        self._feed_engine_state()
        return {**self.metrics.snapshot(), **self.gw.engine_stats.as_dict(),
                "requests_inflight": self.gw.num_inflight(), **self.counters}

    # ---- lifecycle ----
    def request_stop(self) -> None:
        """SIGTERM / Ctrl-C: from this instant the gateway refuses new requests, before
        anything can report "draining", so no request is accepted after a client saw that.
        The drain itself (waiting for the in-flight ones) starts at the end of the loop turn."""
        self.gw.stop_accepting()
        self.stop.set()

    def _begin_drain(self) -> None:
        self.notify.stopping(f"draining {self.gw.num_inflight()} request(s)")
        self.draining = threading.Thread(target=self.gw.drain, args=(self.args.drain_timeout,),
                                         name="gateway-drain", daemon=True)
        self.draining.start()

    def serve(self) -> int:
        ctx: zmq.Context[zmq.Socket] = zmq.Context.instance()
        self.sock = sock = ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        sock.setsockopt(zmq.LINGER, 1000)
        sock.setsockopt(zmq.SNDHWM, 0)  # answers are never dropped; clients read them
        sock.setsockopt(zmq.RCVHWM, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, self.args.max_frame_bytes + 1024)
        if self.args.curve_keys:
            from pipeline.gateway.curve import server_socket_setup
            self.auth = server_socket_setup(sock, self.args.curve_keys)
        sock.bind(self.args.listen)
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        poller.register(self.wake_r, zmq.POLLIN)
        next_tick = 0.0
        self.notify.ready(f"serving on {self.args.listen}")
        self.notify.start_watchdog(self.healthy)
        print(f"[gateway] serving on {self.args.listen}", file=sys.stderr, flush=True)
        while True:
            events = dict(poller.poll(100))
            now = self.last_loop = time.monotonic()
            if self.wake_r in events:
                self._route_answers()
            if sock in events:
                for _ in range(256):  # bounded, so answers are not starved by a flood
                    try:
                        identity, *rest = sock.recv_multipart(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    if len(rest) != 1:
                        self.counters["malformed_frames"] += 1
                        self._reply(identity, P.Error(id=None, error=P.invalid(
                            f"a message must be exactly 1 frame, got {len(rest)}")))
                        continue
                    self._handle_frame(identity, rest[0], now)
            if now >= next_tick:
                next_tick = now + 1.0
                expired = self.sessions.expired(now)
                if expired:
                    self.gw.abort(expired)
                self._feed_engine_state()
                self.notify.status(f"serving on {self.args.listen}: "
                                   f"{self.gw.num_inflight()} request(s) in flight")
            if self.gw.failed.is_set():
                self._route_answers()  # every in-flight request gets its error answer
                self.notify.status(f"failed: {self.gw.failure}")
                return 1
            if self.stop.is_set() and self.draining is None:
                self._begin_drain()
            if self.draining is not None and not self.draining.is_alive():
                self._route_answers()
                return 0

    def run(self) -> int:
        self.notify.status("loading the model and starting the stages")
        try:
            self.gw.start()
        except (StartupError, ValueError, OSError) as exc:
            print(f"pipeline serve: cannot start: {exc}", file=sys.stderr)
            self.notify.status(f"start-up failed: {exc}")
            self.gw.close()
            return 2
        if not is_loopback(self.args.listen) and not self.args.curve_keys:
            print(f"[gateway] WARNING: {self.args.listen} is not loopback and --curve-keys is "
                  "not set: anyone who can reach it can use the model", file=sys.stderr)
        if self.args.metrics_port:
            port = self.metrics.serve(self.args.metrics_port, self.args.metrics_host)
            print(f"[gateway] Prometheus metrics on http://{self.args.metrics_host}:{port}/metrics",
                  file=sys.stderr, flush=True)
        old = {s: signal.signal(s, lambda *_: self.request_stop())
               for s in (signal.SIGINT, signal.SIGTERM)}
        try:
            code = self.serve()
        finally:
            for s, h in old.items():
                signal.signal(s, h)
            self.gw.close()
            if self.sock is not None:
                self.sock.close(linger=1000)
            if self.auth is not None:
                self.auth.stop()
            self.metrics.close()
            self.notify.close()
            os.close(self.wake_r)
            os.close(self.wake_w)
        if code:
            print(f"pipeline serve: {self.gw.failure}", file=sys.stderr)
        return code


def main(args: argparse.Namespace) -> int:
    return Server(args).run()
