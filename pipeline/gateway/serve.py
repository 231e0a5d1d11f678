"""`pipeline serve`: the daemon. Gateway front end speaking the ZMQ protocol (``protocol``).

Owns the ROUTER socket and its disconnect monitor, the client sessions (which client waits
for which request) and the metrics' HTTP server; the stages, the in-flight table and
supervision belong to the Gateway. One thread (this module's loop) touches the socket: client
frames in, answers out. Answers produced by the gateway's threads reach it through a queue
plus a wake-up pipe the poller watches. Start-up checks every flag and binds ``--listen`` and
``--metrics-port`` before the model loads, so a bad value or a busy port costs no load time
and leaves nothing behind (a client that connects meanwhile is answered once the stages are
up). systemd Type=notify: READY=1 once serving, STATUS= lines,
WATCHDOG=1 while healthy, STOPPING=1 on drain. Exit status: 0 after a clean drain (or a stop
during start-up), 1 when a stage died, 2 when start-up failed (one line on stderr says why).
"""
from __future__ import annotations

import argparse
import math
import os
import queue
import signal
import sys
import threading
import time
import traceback
from typing import TYPE_CHECKING

import msgspec
import zmq

from pipeline.config import EngineConfig, add_engine_args, add_node_args, add_pd_args, config_from_args
from pipeline.gateway import protocol as P
from pipeline.gateway.front import add_front_args, cannot_start, check_front_args, is_loopback
from pipeline.gateway.gateway import Answer, Gateway
from pipeline.gateway.http_front import HttpFront, parse_http
from pipeline.gateway.metrics import Metrics
from pipeline.gateway.openai_convert import fingerprint, served_model_name
from pipeline.gateway.sessions import ClientSessions, DuplicateRequestId
from pipeline.gateway.supervisor import StartupError
from pipeline.gateway.systemd import Notifier
from pipeline.messages import ErrorInfo, RequestResult, error_result

if TYPE_CHECKING:
    from zmq.auth.thread import ThreadAuthenticator

DEFAULT_LISTEN = "tcp://127.0.0.1:7001"
# The ROUTER forgets a dropped peer a moment after its monitor reports the disconnect (the
# pipe's termination is a round trip with libzmq's I/O thread): probe the clients that long
# after the report. The periodic probe catches any peer this one misses.
DISCONNECT_SETTLE_S = 0.01
PING = P.encode(P.Ping())


def add_args(p: argparse.ArgumentParser) -> None:
    add_engine_args(p)
    add_pd_args(p)
    add_node_args(p)
    p.add_argument("--listen", default=None,
                   help=f"ZMQ endpoint to bind (default {DEFAULT_LISTEN} unless only --http is given; "
                        "tcp://0.0.0.0:PORT to open it)")
    p.add_argument("--http", default=None, metavar="[HOST:]PORT",
                   help="serve the OpenAI API over HTTP too (HOST 127.0.0.1 by default)")
    p.add_argument("--api-key", default=os.environ.get("PIPELINE_API_KEY"),
                   help="--http requires `Authorization: Bearer KEY` (default: $PIPELINE_API_KEY)")
    p.add_argument("--served-model-name", default=None,
                   help="the `model` HTTP requests name (default: the --model path; \"default\" for "
                        "the embedded model)")
    p.add_argument("--curve-keys", default=None, metavar="DIR",
                   help="enable ZMQ CURVE: DIR holds server.key_secret and authorized client keys")
    p.add_argument("--metrics-port", type=int, default=0, help="Prometheus /metrics port (0: off)")
    p.add_argument("--metrics-host", default="127.0.0.1")
    add_front_args(p)


def check_args(args: argparse.Namespace) -> None:
    """The daemon's own flags (``EngineConfig.check`` does the engine's): ValueError naming
    the flag and its limit."""
    if args.listen is None and args.http is None:
        args.listen = DEFAULT_LISTEN
    check_front_args(args)
    if args.http is not None:
        parse_http(args.http)
    if args.api_key is not None and not args.api_key.strip():
        raise ValueError("--api-key: must not be empty")
    if not 0 <= args.metrics_port <= 65535:
        raise ValueError(f"--metrics-port must be in [0, 65535] (0: off), got {args.metrics_port}")


class _StoppedDuringStartup(Exception):
    """SIGTERM/SIGINT while the stages start: unwinds Gateway.start, which cleans up."""


class Server:
    def __init__(self, args: argparse.Namespace, config: EngineConfig, notify: Notifier) -> None:
        self.args = args
        self.config = config
        self.notify = notify
        self.answers: queue.SimpleQueue[Answer] = queue.SimpleQueue()
        self.wake_r, self.wake_w = os.pipe()
        os.set_blocking(self.wake_r, False)
        os.set_blocking(self.wake_w, False)
        self.gw = Gateway(config, self._on_output)
        self.sessions = ClientSessions()
        self.metrics = Metrics(engine_state=lambda: self.gw.engine_stats, inflight=self.gw.num_inflight)
        self.last_loop = time.monotonic()  # the watchdog pings only while the loop turns
        self.stop = threading.Event()
        self.started = False  # the stages are up: a signal drains instead of unwinding start-up
        self.draining: threading.Thread | None = None
        self.sock: zmq.Socket | None = None
        self.mon: zmq.Socket | None = None  # the ROUTER's disconnect events
        self.auth: ThreadAuthenticator | None = None  # the CURVE authenticator thread, when --curve-keys
        self.http = HttpFront(args.http, config.instance_id) if args.http else None

    # Called from the gateway's threads.
    def _on_output(self, out: Answer) -> None:
        self.answers.put(out)
        try:
            os.write(self.wake_w, b"\0")
        except BlockingIOError:
            pass  # the pipe is full, so the loop is awake anyway

    def _send(self, identity: bytes, frame: bytes) -> bool:
        assert self.sock is not None  # bound by _open(); this loop is the only caller
        try:
            self.sock.send_multipart([identity, frame], flags=zmq.NOBLOCK)
            return True
        except zmq.ZMQError as exc:
            if exc.errno in (zmq.EHOSTUNREACH, zmq.EAGAIN):
                self._drop_client(identity, "is gone (its connection closed)")
                return False
            raise

    def _reply(self, identity: bytes, msg: P.ReplyMsg) -> bool:
        return self._send(identity, P.encode(msg))

    def _final(self, identity: bytes, res: RequestResult) -> None:
        """A final answer the daemon builds itself (the request never reached the gateway)."""
        self.metrics.observe_result(res)
        self._reply(identity, P.Final(result=res))

    def _drop_client(self, identity: bytes, why: str) -> None:
        ids = self.sessions.drop_client(identity)
        if ids:
            self.metrics.clients_dropped.inc()
            self.gw.abort(ids, message=f"aborted by the server: the client {why}")

    def _probe_clients(self) -> None:
        """Ping every client with requests in flight: a send to a dropped peer fails
        (ROUTER_MANDATORY) and its requests are aborted (see the protocol docstring)."""
        for identity in self.sessions.clients():
            self._send(identity, PING)

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
            try:
                self._route(out)
            except Exception:  # noqa: BLE001 -- one answer must not stop the others
                self._log_internal(f"routing the answer of {out.id}")

    def _route(self, out: Answer) -> None:
        if isinstance(out, RequestResult):
            self.metrics.observe_result(out)
            owner = self.sessions.finish(out.id)
        else:
            owner = self.sessions.owner(out.id)
        if owner is None:
            return  # its client is gone; the engine was told to abort it
        identity, client_id = owner
        out = msgspec.structs.replace(out, id=client_id)
        self._reply(identity, P.Final(result=out) if isinstance(out, RequestResult) else P.Delta(delta=out))

    def _receive(self) -> None:
        assert self.sock is not None
        for _ in range(256):  # bounded, so answers are not starved by a flood
            try:
                identity, *rest = self.sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            try:
                if len(rest) != 1:
                    self.metrics.malformed_frames.inc()
                    self._reply(identity, P.Error(id=None, error=P.invalid(
                        f"a message must be exactly 1 frame, got {len(rest)}")))
                else:
                    self._handle_frame(identity, rest[0])
            except Exception as exc:  # noqa: BLE001 -- one frame must not take the daemon down
                self._log_internal("handling a client frame")
                self._reply(identity, P.Error(id=None, error=ErrorInfo(
                    "internal_error", f"the daemon failed on a frame: {type(exc).__name__}: {exc}")))

    def _log_internal(self, what: str) -> None:
        print(f"[gateway] internal error {what}, still serving:\n{traceback.format_exc()}",
              file=sys.stderr, flush=True)

    def _handle_frame(self, identity: bytes, frame: bytes) -> None:
        try:
            msg = P.decode_client(frame, self.args.max_frame_bytes)
        except P.ProtocolError as exc:
            self.metrics.malformed_frames.inc()
            self._refuse(identity, exc)
            return
        if isinstance(msg, P.Generate):
            self._generate(identity, msg)
        elif isinstance(msg, P.Abort):
            internal = self.sessions.internal_id(identity, msg.id)
            if internal is not None:
                self.gw.abort([internal])
        elif isinstance(msg, P.Bye):
            self._drop_client(identity, "closed (bye) with the request in flight")
        elif isinstance(msg, P.Health):
            self._reply(identity, P.HealthReply(id=msg.id, status=self.status(),
                                                detail=self.health_detail()))
        elif isinstance(msg, P.Stats):
            self._reply(identity, P.StatsReply(id=msg.id, stats=self.stats()))
        elif isinstance(msg, P.Metrics):
            self._reply(identity, P.MetricsReply(id=msg.id, text=self.metrics.render().decode()))
        # Ping: nothing to do (older clients send it; liveness is the connection's).

    def _refuse(self, identity: bytes, exc: P.ProtocolError) -> None:
        """Answer a frame that could not be decoded. Only a generate whose id is free gets a
        final, and only a health/stats op an error with its id: an answer keyed by an id in
        flight would be taken for that request's."""
        rid = exc.req_id
        if exc.op == "generate":
            self.metrics.requests_received.inc()
        if exc.op == "generate" and rid is not None and self.sessions.internal_id(identity, rid) is None:
            self._final(identity, error_result(rid, exc.error.code, exc.error.message))
        elif exc.op in ("health", "stats", "metrics") and rid is not None:
            self._reply(identity, P.Error(id=rid, error=exc.error))
        else:
            about = f"{exc.op or 'frame'} {rid!r}: " if rid is not None else ""
            self._reply(identity, P.Error(id=None, error=ErrorInfo(exc.error.code, about + exc.error.message)))

    def _generate(self, identity: bytes, msg: P.Generate) -> None:
        self.metrics.requests_received.inc()
        if msg.id is None:
            self.metrics.reject("invalid_request")
            self._reply(identity, P.Error(id=None, error=P.invalid("field `id`: required for a "
                                                                   "generate over ZMQ")))
            return
        client_id = str(msg.id)
        try:
            internal = self.sessions.start(identity, client_id)
        except DuplicateRequestId as exc:
            self.metrics.reject("duplicate_id")
            self._reply(identity, P.Error(id=None, error=ErrorInfo("duplicate_id", str(exc))))
            return
        try:
            req = P.gateway_request(msg, P.sampling_params(msg), internal)
        except P.ProtocolError as exc:
            self.sessions.finish(internal)
            self._final(identity, error_result(client_id, exc.error.code, exc.error.message))
            return
        # A refusal (draining, too large, stage died) comes back as an error answer.
        self.gw.submit(req)

    def _check_http(self) -> None:
        if self.http is None or self.stop.is_set():
            return
        try:
            self.http.check(lambda m: print(f"[gateway] {m}", file=sys.stderr, flush=True))
        except RuntimeError as exc:  # tried again at the next heartbeat
            print(f"[gateway] {exc}", file=sys.stderr, flush=True)

    # ---- observability ----
    def status(self) -> str:
        if self.gw.failure is not None:
            return "failed"
        return "draining" if self.stop.is_set() else "ok"

    def health_detail(self) -> dict:
        c = self.gw.config
        return {"inflight": self.gw.num_inflight(), "client_requests": len(self.sessions),
                "stages": self.gw.stats_stages(), "failure": self.gw.failure, "role": c.role,
                "kv_listen": c.kv_listen or None, "http": None if self.http is None else self.http.detail()}

    def healthy(self) -> bool:
        return self.gw.failure is None and time.monotonic() - self.last_loop < 5.0

    def stats(self) -> dict:
        """Engine counters and gauges (scheduler, KV blocks, step timing), and the metrics
        (the daemon's counters, TTFT/ITL/e2e histograms) as Prometheus sees them."""
        return {**self.metrics.snapshot(), **self.gw.engine_stats.as_dict()}

    # ---- lifecycle ----
    def request_stop(self) -> None:
        """SIGTERM / Ctrl-C: from this instant the gateway refuses new requests, before
        anything can report "draining", so no request is accepted after a client saw that.
        The drain itself (waiting for the in-flight ones) starts at the end of the loop turn."""
        self.gw.stop_accepting()
        self.stop.set()

    def _on_signal(self, signum: int, frame: object) -> None:
        first = not self.stop.is_set()
        self.request_stop()
        if first and not self.started:
            raise _StoppedDuringStartup(signal.Signals(signum).name)

    def _begin_drain(self) -> None:
        self.notify.stopping(f"draining {self.gw.num_inflight()} request(s)")
        self.draining = threading.Thread(target=self.gw.drain, args=(self.args.drain_timeout,),
                                         name="gateway-drain", daemon=True)
        self.draining.start()

    def _open(self) -> None:
        """Bind --listen and --metrics-port; ValueError naming the flag if either fails."""
        a = self.args
        ctx: zmq.Context[zmq.Socket] = zmq.Context.instance()
        self.sock = sock = ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        sock.setsockopt(zmq.LINGER, 1000)
        sock.setsockopt(zmq.SNDHWM, 0)  # answers are never dropped; clients read them
        sock.setsockopt(zmq.RCVHWM, 0)
        # The daemon answers frames over max_frame_bytes; libzmq would drop the connection.
        sock.setsockopt(zmq.MAXMSGSIZE, a.max_frame_bytes + P.FRAME_SLACK_BYTES)
        sock.setsockopt(zmq.TCP_KEEPALIVE, 1)
        sock.setsockopt(zmq.TCP_KEEPALIVE_IDLE, P.KEEPALIVE_IDLE_S)
        sock.setsockopt(zmq.TCP_KEEPALIVE_INTVL, P.KEEPALIVE_INTERVAL_S)
        sock.setsockopt(zmq.TCP_KEEPALIVE_CNT, P.KEEPALIVE_PROBES)
        self.mon = sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        if self.http is not None:
            # Bound before CURVE is set up: an endpoint takes the socket's security options
            # at bind time, and this one is private to this user (HttpFront's directory).
            sock.bind(self.http.endpoint)
        if a.curve_keys:
            from pipeline.gateway.curve import server_socket_setup
            try:
                self.auth = server_socket_setup(sock, a.curve_keys)
            except (OSError, ValueError) as exc:
                raise ValueError(f"--curve-keys {a.curve_keys}: {exc}") from None
        try:
            if a.listen is not None:
                sock.bind(a.listen)
        except zmq.ZMQError as exc:
            raise ValueError(f"--listen {a.listen}: {exc.strerror} "
                             "(expected a free tcp://HOST:PORT or ipc://PATH)") from None
        if self.http is not None:
            self.http.bind()
        if a.metrics_port:
            try:
                port = self.metrics.serve(a.metrics_port, a.metrics_host)
            except OSError as exc:
                raise ValueError(f"--metrics-port {a.metrics_port} on {a.metrics_host}: {exc}") from None
            print(f"[gateway] Prometheus metrics on http://{a.metrics_host}:{port}/metrics",
                  file=sys.stderr, flush=True)

    def serve(self) -> int:
        assert self.sock is not None and self.mon is not None
        sock, mon = self.sock, self.mon
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        poller.register(mon, zmq.POLLIN)
        poller.register(self.wake_r, zmq.POLLIN)
        next_probe = 0.0
        where = " and ".join(x for x in (self.args.listen, self.http and self.http.url) if x)
        self.notify.ready(f"serving on {where}")
        self.notify.start_watchdog(self.healthy)
        print(f"[gateway] serving on {where}", file=sys.stderr, flush=True)
        while True:
            wait = min(0.1, max(0.0, next_probe - time.monotonic()))
            events = dict(poller.poll(math.ceil(wait * 1000)))
            now = self.last_loop = time.monotonic()
            if self.wake_r in events:
                self._route_answers()
            if sock in events:
                self._receive()
            if mon in events:
                while True:
                    try:
                        mon.recv_multipart(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                next_probe = min(next_probe, now + DISCONNECT_SETTLE_S)
            if now >= next_probe:
                next_probe = now + P.HEARTBEAT_INTERVAL_S
                self._probe_clients()
                self._check_http()
                self.notify.status(f"serving on {where}: "
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
        old = {s: signal.signal(s, self._on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
        try:
            try:
                self._open()
                self.notify.status("loading the model and starting the stages")
                model = self.gw.start()
                if self.http is not None:
                    self.notify.status("starting the HTTP front end")
                    name = served_model_name(self.config.model, self.args.served_model_name)
                    self.http.start(dict(
                        model_path=self.config.model, model=name,
                        max_model_len=model.max_model_len, fingerprint=fingerprint(model.kv.model_hash),
                        chat_template=self.config.chat_template, api_key=self.args.api_key))
                    print(f"[gateway] OpenAI API on {self.http.url}/v1", file=sys.stderr, flush=True)
                self.started = True
            except (StartupError, ValueError, OSError, RuntimeError, zmq.ZMQError) as exc:
                return cannot_start("serve", self.notify, exc)
            except _StoppedDuringStartup as exc:
                print(f"pipeline serve: stopped by {exc} during start-up", file=sys.stderr)
                return 0
            if self.http is not None and not is_loopback(f"tcp://{self.http.url[7:]}") and not self.args.api_key:
                print(f"[gateway] WARNING: {self.http.url} is not loopback and --api-key is not set: "
                      "anyone who can reach it can use the model", file=sys.stderr)
            if self.args.listen and not is_loopback(self.args.listen) and not self.args.curve_keys:
                print(f"[gateway] WARNING: {self.args.listen} is not loopback and --curve-keys is "
                      "not set: anyone who can reach it can use the model", file=sys.stderr)
            code = self.serve()
        finally:
            # A second SIGTERM/Ctrl-C while closing (the HTTP front end stopping, the stages
            # exiting) must not kill the daemon halfway through its clean-up.
            for s in old:
                signal.signal(s, lambda *_: self.request_stop())
            self.close()
            for s, h in old.items():
                signal.signal(s, h)
        if code:
            print(f"pipeline serve: {self.gw.failure}", file=sys.stderr)
        return code

    def close(self) -> None:
        if self.http is not None:
            self.http.close()  # after the drain: it answered 503 to new requests meanwhile
        self.gw.close()
        if self.sock is not None:
            self.sock.disable_monitor()
            self.sock.close(linger=1000)
        if self.mon is not None:
            self.mon.close(linger=0)
        if self.auth is not None:
            self.auth.stop()
        self.metrics.close()
        self.notify.close()
        os.close(self.wake_r)
        os.close(self.wake_w)


def main(args: argparse.Namespace) -> int:
    notify = Notifier.from_env()
    try:
        check_args(args)
        config = config_from_args(args)
    except ValueError as exc:
        code = cannot_start("serve", notify, exc)
        notify.close()
        return code
    if config.node_rank > 0:  # only this host's worker ranks (tensor parallelism across hosts)
        notify.close()
        from pipeline.gateway import worker_node
        return worker_node.run(config)
    return Server(args, config, notify).run()
