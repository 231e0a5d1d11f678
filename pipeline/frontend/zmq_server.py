"""The one ZMQ server of the daemon's protocol (``protocol``): `pipeline serve`
(``gateway.serve_front.DaemonFront``) and `pipeline router` (``router.server.Router``) are
subclasses that differ only in where an accepted generate goes (the daemon's tokenizer ring,
the router's instances), how an abort and a client gone reach it, and what health, stats and
metrics say.

Owns the front ROUTER socket (ROUTER_MANDATORY, keepalive, no high-water marks, a frame cap
above ``max_frame_bytes``) and its disconnect monitor, and the client sessions
(``sessions.ClientSessions``: which client waits for which request). One thread, the
subclass's loop, touches the socket: ``_receive`` takes client frames in, ``_reply`` sends
answers out. Every frame gets the protocol's answer (bad frames an error or a final, a
duplicate id ``duplicate_id``), and a client gone (``bye``, or a send to it failing) has its
requests handed to ``_client_gone``. Not thread-safe.
"""
from __future__ import annotations

import ctypes
import sys
import traceback
from typing import Any

import zmq
from zmq.auth.thread import ThreadAuthenticator

from pipeline.frontend import protocol as P
from pipeline.frontend.sessions import ClientSessions, DuplicateRequestId
from pipeline.messages import ErrorInfo, RequestResult, error_result

PING = P.encode(P.Ping())
# Whole messages libzmq queues per client before it stops reading that client (see _open_socket).
RCVHWM = 16
# The ROUTER forgets a dropped peer a moment after its monitor reports the disconnect (the
# pipe's termination is a round trip with libzmq's I/O thread): probe the clients that long
# after the report. The periodic probe catches any peer this one misses.
DISCONNECT_SETTLE_S = 0.01


class ZmqServer:
    what = "server"  # who failed, in an internal error's answer ("the daemon failed on a frame")
    log_prefix = "[server]"

    def __init__(self, max_frame_bytes: int, id_prefix: str | None = None) -> None:
        self.max_frame_bytes = max_frame_bytes
        self.sessions = ClientSessions(id_prefix)
        self.sock: zmq.Socket | None = None
        self.mon: zmq.Socket | None = None  # the ROUTER's disconnect events
        self.auth: ThreadAuthenticator | None = None  # the CURVE authenticator (``_secure``)

    # ---- what a subclass decides ----
    def _accept(self, identity: bytes, msg: P.Generate, client_id: str, internal: str) -> None:
        """Run a generate the sessions registered under ``internal``; its one final comes later."""
        raise NotImplementedError

    def _abort_request(self, internal: str) -> None:
        raise NotImplementedError

    def _client_gone(self, identity: bytes, internals: list[str], why: str) -> None:
        """Its sessions are forgotten; abort ``internals`` where they run."""
        raise NotImplementedError

    def status(self) -> str:
        raise NotImplementedError

    def health_detail(self) -> dict[str, Any]:
        raise NotImplementedError

    def _stats(self, identity: bytes, op_id: str) -> None:
        raise NotImplementedError

    def _metrics(self, identity: bytes, op_id: str) -> None:
        raise NotImplementedError

    # Counters (the daemon's metrics; the router has none of its own).
    def _count_malformed(self) -> None:
        pass

    def _count_generate(self) -> None:
        pass

    def _count_rejected(self, code: str) -> None:
        pass

    # ---- the socket ----
    def _open_socket(self, ctx: zmq.Context) -> zmq.Socket:
        """The ROUTER with its options and monitor, bound to nothing yet."""
        self.sock = sock = ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        sock.setsockopt(zmq.LINGER, 1000)
        sock.setsockopt(zmq.SNDHWM, 0)  # answers are never dropped; clients read them
        # What one peer can make this process hold (issue 25, item 4): libzmq reads a frame
        # over MAXMSGSIZE no further and drops the connection (the server answers the ones
        # between max_frame_bytes and that); at most RCVHWM whole messages wait per peer (then
        # libzmq stops reading it: TCP back-pressure, nothing lost). libzmq has no limit on the
        # frames of one multipart message and buffers it whole before we see any frame: only
        # who may connect bounds that (--curve-keys, loopback), see docs/hardening.md.
        sock.setsockopt(zmq.RCVHWM, RCVHWM)
        sock.setsockopt(zmq.MAXMSGSIZE, self.max_frame_bytes + P.FRAME_SLACK_BYTES)
        release_large_frees()
        sock.setsockopt(zmq.TCP_KEEPALIVE, 1)
        sock.setsockopt(zmq.TCP_KEEPALIVE_IDLE, P.KEEPALIVE_IDLE_S)
        sock.setsockopt(zmq.TCP_KEEPALIVE_INTVL, P.KEEPALIVE_INTERVAL_S)
        sock.setsockopt(zmq.TCP_KEEPALIVE_CNT, P.KEEPALIVE_PROBES)
        self.mon = sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        return sock

    def _secure(self, curve_keys: str) -> None:
        """Make the socket a CURVE server admitting DIR/authorized_clients (endpoints bound from
        now on take it; one bound before, like the HTTP front end's private ipc, stays plain).
        ValueError naming --curve-keys if the keys cannot be loaded."""
        from pipeline.ipc.curve import server_socket_setup
        assert self.sock is not None
        try:
            self.auth = server_socket_setup(self.sock, curve_keys)
        except (OSError, ValueError) as exc:
            raise ValueError(f"--curve-keys {curve_keys}: {exc}") from None

    def _bind(self, listen: str) -> None:
        """Bind --listen; ValueError naming the flag if it cannot be."""
        assert self.sock is not None
        try:
            self.sock.bind(listen)
        except zmq.ZMQError as exc:
            raise ValueError(f"--listen {listen}: {exc.strerror} "
                             "(expected a free tcp://HOST:PORT or ipc://PATH)") from None

    def _read_disconnects(self) -> None:
        """Empty the monitor; the caller probes the clients DISCONNECT_SETTLE_S later."""
        assert self.mon is not None
        while True:
            try:
                self.mon.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return

    def _close_socket(self) -> None:
        if self.sock is not None:
            if self.mon is not None:
                self.sock.disable_monitor()
            self.sock.close(linger=1000)
        if self.mon is not None:
            self.mon.close(linger=0)
        if self.auth is not None:
            self.auth.stop()
            self.auth = None

    # ---- to clients ----
    def _send(self, identity: bytes, frame: bytes) -> bool:
        assert self.sock is not None  # bound by the subclass's open; its loop is the only caller
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
        """A final the server builds itself (the request never ran)."""
        self._reply(identity, P.Final(result=res))

    def _drop_client(self, identity: bytes, why: str) -> None:
        self._client_gone(identity, self.sessions.drop_client(identity), why)

    def _probe_clients(self) -> None:
        """Ping every client with requests in flight: a send to a dropped peer fails
        (ROUTER_MANDATORY) and its requests are aborted (see the protocol docstring)."""
        for identity in self.sessions.clients():
            self._send(identity, PING)

    # ---- from clients ----
    def _receive(self) -> None:
        assert self.sock is not None
        sock = self.sock
        for _ in range(256):  # bounded, so answers are not starved by a flood
            try:
                identity = sock.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            # A whole message is in once its first frame is: the rest never blocks.
            frame = sock.recv() if sock.rcvmore else b""
            extra = 0
            while sock.rcvmore:  # frames past the protocol's one: each released as it is read
                sock.recv(copy=False)
                extra += 1
            try:
                if extra:
                    del frame
                    self._count_malformed()
                    self._reply(identity, P.Error(id=None, error=P.invalid(
                        f"a message must be exactly 1 frame, got {extra + 1}")))
                else:
                    self._handle_frame(identity, frame)
            except Exception as exc:  # noqa: BLE001 -- one frame must not take the server down
                self._log_internal("handling a client frame")
                self._reply(identity, P.Error(id=None, error=ErrorInfo(
                    "internal_error", f"the {self.what} failed on a frame: {type(exc).__name__}: {exc}")))

    def _log_internal(self, what: str) -> None:
        print(f"{self.log_prefix} internal error {what}, still serving:\n{traceback.format_exc()}",
              file=sys.stderr, flush=True)

    def _handle_frame(self, identity: bytes, frame: bytes) -> None:
        try:
            msg = P.decode_client(frame, self.max_frame_bytes)
        except P.ProtocolError as exc:
            self._count_malformed()
            self._refuse(identity, exc)
            return
        if isinstance(msg, P.Generate):
            self._generate(identity, msg)
        elif isinstance(msg, P.Abort):
            internal = self.sessions.internal_id(identity, msg.id)
            if internal is not None:
                self._abort_request(internal)
        elif isinstance(msg, P.Bye):
            self._drop_client(identity, "closed (bye) with the request in flight")
        elif isinstance(msg, P.Health):
            self._reply(identity, P.HealthReply(id=msg.id, status=self.status(),
                                                detail=self.health_detail()))
        elif isinstance(msg, P.Stats):
            self._stats(identity, msg.id)
        elif isinstance(msg, P.Metrics):
            self._metrics(identity, msg.id)
        # Ping: nothing to do (older clients send it; liveness is the connection's).

    def _refuse(self, identity: bytes, exc: P.ProtocolError) -> None:
        """Answer a frame that could not be decoded. Only a generate whose id is free gets a
        final, and only a health/stats op an error with its id: an answer keyed by an id in
        flight would be taken for that request's."""
        rid = exc.req_id
        if exc.op == "generate":
            self._count_generate()
        if exc.op == "generate" and rid is not None and self.sessions.internal_id(identity, rid) is None:
            self._final(identity, error_result(rid, exc.error.code, exc.error.message))
        elif exc.op in ("health", "stats", "metrics") and rid is not None:
            self._reply(identity, P.Error(id=rid, error=exc.error))
        else:
            about = f"{exc.op or 'frame'} {rid!r}: " if rid is not None else ""
            self._reply(identity, P.Error(id=None, error=ErrorInfo(exc.error.code, about + exc.error.message)))

    def _generate(self, identity: bytes, msg: P.Generate) -> None:
        self._count_generate()
        if msg.id is None:
            self._count_rejected("invalid_request")
            self._reply(identity, P.Error(id=None, error=P.invalid("field `id`: required for a "
                                                                   "generate over ZMQ")))
            return
        client_id = str(msg.id)
        try:
            internal = self.sessions.start(identity, client_id)
        except DuplicateRequestId as exc:
            self._count_rejected("duplicate_id")
            self._reply(identity, P.Error(id=None, error=ErrorInfo("duplicate_id", str(exc))))
            return
        self._accept(identity, msg, client_id, internal)


def release_large_frees() -> None:
    """Make glibc give large blocks back to the kernel when freed: its default threshold
    rises to the size of the last large block freed (up to 32 MiB), after which a refused
    frame's buffer stays in the heap and the process keeps its RSS (1.08 GB after one
    attack, issue 25). A fixed threshold keeps every block >= 256 KiB mmap'd. No-op off glibc."""
    try:
        ctypes.CDLL(None).mallopt(M_MMAP_THRESHOLD, 256 << 10)
    except (OSError, AttributeError):
        pass


M_MMAP_THRESHOLD = -3  # glibc's malloc.h
