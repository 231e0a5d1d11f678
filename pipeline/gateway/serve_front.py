"""The daemon's side of the ZMQ protocol (the base of ``serve.Server``): an accepted generate
goes to the ``Gateway`` (its tokenizer ring), and the gateway's answers come back to the
client that waits for them.

Owns the ``Gateway``, the metrics (what they count: frames, generates, refusals, results,
clients dropped) and the answers queue: answers produced by the gateway's threads reach the
serve loop (the one thread that touches the socket) through it plus a wake-up pipe the
poller watches. ``serve.Server`` adds the start-up, the loop and the drain, and closes all
of these.
"""
from __future__ import annotations

import os
import queue
import time
from typing import Any

import msgspec

from pipeline.config import EngineConfig
from pipeline.frontend import protocol as P
from pipeline.frontend.request_parser import gateway_request, sampling_params
from pipeline.frontend.zmq_server import ZmqServer
from pipeline.gateway.gateway import Answer, Gateway
from pipeline.gateway.metrics import Metrics
from pipeline.messages import RequestResult, error_result


class DaemonFront(ZmqServer):
    """The daemon's ZMQ front: an accepted generate goes to the gateway (its tokenizer ring)."""
    what = "daemon"
    log_prefix = "[gateway]"

    def __init__(self, max_frame_bytes: int, config: EngineConfig) -> None:
        super().__init__(max_frame_bytes)
        self.config = config
        self.answers: queue.SimpleQueue[Answer] = queue.SimpleQueue()
        self.wake_r, self.wake_w = os.pipe()
        os.set_blocking(self.wake_r, False)
        os.set_blocking(self.wake_w, False)
        self.gw = Gateway(config, self._on_output)
        self.metrics = Metrics(engine_state=lambda: self.gw.engine_stats, inflight=self.gw.num_inflight)
        self.last_loop = time.monotonic()  # the watchdog pings only while the loop turns

    # Called from the gateway's threads.
    def _on_output(self, out: Answer) -> None:
        self.answers.put(out)
        try:
            os.write(self.wake_w, b"\0")
        except BlockingIOError:
            pass  # the pipe is full, so the loop is awake anyway

    def _final(self, identity: bytes, res: RequestResult) -> None:
        self.metrics.observe_result(res)
        super()._final(identity, res)

    def _count_malformed(self) -> None:
        self.metrics.malformed_frames.inc()

    def _count_generate(self) -> None:
        self.metrics.requests_received.inc()

    def _count_rejected(self, code: str) -> None:
        self.metrics.reject(code)

    def _client_gone(self, identity: bytes, internals: list[str], why: str) -> None:
        if internals:
            self.metrics.clients_dropped.inc()
            self.gw.abort(internals, message=f"aborted by the server: the client {why}")

    def _abort_request(self, internal: str) -> None:
        self.gw.abort([internal])

    def _accept(self, identity: bytes, msg: P.Generate, client_id: str, internal: str) -> None:
        try:
            req = gateway_request(msg, sampling_params(msg), internal)
        except P.ProtocolError as exc:
            self.sessions.finish(internal)
            self._final(identity, error_result(client_id, exc.error.code, exc.error.message))
            return
        # A refusal (draining, too large, stage died) comes back as an error answer.
        self.gw.submit(req)

    def _stats(self, identity: bytes, op_id: str) -> None:
        self._reply(identity, P.StatsReply(id=op_id, stats=self.stats()))

    def _metrics(self, identity: bytes, op_id: str) -> None:
        self._reply(identity, P.MetricsReply(id=op_id, text=self.metrics.render().decode()))

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

    def stats(self) -> dict[str, Any]:
        """Engine counters and gauges (scheduler, KV blocks, step timing), and the metrics
        (the daemon's counters, TTFT/ITL/e2e histograms) as Prometheus sees them."""
        return {**self.metrics.snapshot(), **self.gw.engine_stats.as_dict()}
