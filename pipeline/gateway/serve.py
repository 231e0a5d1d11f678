"""`pipeline serve`: the daemon, a ZMQ front (``serve_front.DaemonFront``, on
``frontend.zmq_server``) whose accepted generates go to the ``Gateway``.

Owns, beyond the front's gateway, metrics and answers queue: the daemon's life (start-up,
the serve loop, the drain, the close), the metrics' HTTP server and the HTTP front end's
launcher (``--http``); the CURVE setup and its authenticator are the front's
(``ZmqServer._secure``, as the router's). Start-up checks every flag (``serve_args``) and
binds ``--listen`` and ``--metrics-port`` before the model loads, so a bad value or a busy
port costs no load time and leaves nothing behind (a client that connects meanwhile is
answered once the stages are up). systemd Type=notify: READY=1 once
serving, STATUS= lines, WATCHDOG=1 while healthy, STOPPING=1 on drain. Exit status: 0 after a
clean drain (or a stop during start-up), 1 when a stage died, 2 when start-up failed (one
line on stderr says why).
"""
from __future__ import annotations

import math
import os
import signal
import sys
import threading
import time
from typing import TYPE_CHECKING, Any

import zmq

from pipeline.chat_parse import ChatParsers
from pipeline.config import EngineConfig
from pipeline.engine_args import config_from_args
from pipeline.frontend import protocol as P
from pipeline.frontend.args import cannot_start
from pipeline.frontend.zmq_server import DISCONNECT_SETTLE_S
from pipeline.gateway.serve_args import ServeArgs, add_args, check_args
from pipeline.gateway.serve_front import DaemonFront
from pipeline.gateway.systemd import Notifier
from pipeline.http.launcher import HttpFront
from pipeline.http.openai_response import fingerprint, served_model_name
from pipeline.ipc.prctl import name_process
from pipeline.runtime.lifecycle import StartupError
from pipeline.runtime.rings import message_limits

if TYPE_CHECKING:
    import argparse

__all__ = ["Server", "add_args", "main"]


class _StoppedDuringStartup(Exception):
    """SIGTERM/SIGINT while the stages start: unwinds Gateway.start, which cleans up."""


class Server(DaemonFront):
    """The daemon: its front started, served until stopped or failed, drained and closed."""

    def __init__(self, args: ServeArgs, config: EngineConfig, notify: Notifier) -> None:
        super().__init__(args.max_frame_bytes, config)
        self.args = args
        self.notify = notify
        self.stop = threading.Event()
        self.started = False  # the stages are up: a signal drains instead of unwinding start-up
        self.draining: threading.Thread | None = None
        self.http = HttpFront(args.http, config.instance_id) if args.http else None
        self.model_detail: dict[str, Any] | None = None  # set once the model is loaded

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

    def health_detail(self) -> dict[str, Any]:
        c = self.gw.config
        return {"inflight": self.gw.num_inflight(), "client_requests": len(self.sessions),
                "stages": self.gw.stats_stages(), "failure": self.gw.failure,
                "role": c.kv_transfer_config.role, "kv_listen": c.kv_transfer_config.kv_listen or None,
                "http": None if self.http is None else self.http.detail(), "model": self.model_detail}

    def healthy(self) -> bool:
        return self.gw.failure is None and time.monotonic() - self.last_loop < 5.0

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
        sock = self._open_socket(zmq.Context.instance())
        if self.http is not None:
            # Bound before CURVE is set up: an endpoint takes the socket's security options
            # at bind time, and this one is private to this user (HttpFront's directory).
            sock.bind(self.http.endpoint)
        if a.curve_keys:
            self._secure(a.curve_keys)  # the one CURVE setup of a ZMQ server (the router's too)
        if a.listen is not None:
            self._bind(a.listen)
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
                self._read_disconnects()
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
                # What an HTTP front end needs of the model (this one's, or a router's).
                self.model_detail = dict(
                    model_path=self.config.model_config.model, max_model_len=model.max_model_len,
                    model=served_model_name(self.config.model_config.model, self.args.served_model_name),
                    fingerprint=fingerprint(model.kv.model_hash), chat_template=self.config.model_config.chat_template,
                    answer_limit=message_limits(self.config, model.max_model_len)["answers"],
                    hidden_size=model.hidden_size,
                    **vars(ChatParsers.of(self.config.model_config)))
                if self.http is not None:
                    self.notify.status("starting the HTTP front end")
                    self.http.start(dict(self.model_detail, api_key=self.args.api_key))
                    print(f"[gateway] OpenAI API on {self.http.url}/v1", file=sys.stderr, flush=True)
                self.started = True
            except (StartupError, ValueError, OSError, RuntimeError, zmq.ZMQError) as exc:
                return cannot_start("serve", self.notify, exc)
            except _StoppedDuringStartup as exc:
                print(f"pipeline serve: stopped by {exc} during start-up", file=sys.stderr)
                return 0
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
        self._close_socket()  # stops the CURVE authenticator too
        self.metrics.close()
        self.notify.close()
        os.close(self.wake_r)
        os.close(self.wake_w)


def main(args: argparse.Namespace) -> int:
    notify = Notifier.from_env()
    try:
        serve_args = check_args(args)
        config = config_from_args(args)
    except ValueError as exc:
        code = cannot_start("serve", notify, exc)
        notify.close()
        return code
    if config.parallel_config.node_rank > 0:  # only this host's worker ranks (tensor parallelism across hosts)
        notify.close()
        from pipeline.gateway import worker_node
        return worker_node.run(config)
    name_process("gateway")  # beside its pl-<stage> children in top and `bench cpu`'s CPU split
    return Server(serve_args, config, notify).run()
