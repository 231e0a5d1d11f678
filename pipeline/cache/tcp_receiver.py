"""Cache messager stage, decode side: `KVReceiver`, the end of the KV link that a prefill
instance's `TcpTransfer` (`pipeline/cache/tcp.py`, with the wire both speak) connects to.

A ROUTER served by one thread: the handshake, then each run of blocks copied from the
received frame straight into the pool (checked whole before a byte is written), each done
message handed to `on_done`. A malformed or unexpected message is rejected, logged and
counted against its peer's next flush; it never stops the receiver.
What one peer can make it hold: with `curve_keys` nothing from a peer without the
deployment's client key (CURVE: it never gets past the ZMQ handshake). A peer let in is
bounded per frame (MAXMSGSIZE: one layer of the pool) and by RCVHWM (whole messages queued
per peer); libzmq still buffers a whole multipart message before we see it, so a message of
more frames than the protocol's is dropped at once, its frames released before the next
wait (150 x 8 MiB from a peer let in: +1201 MiB at peak, +1 MiB kept after; before, the last
message's frames stayed referenced while the loop waited: the issue measured 1.08 GB kept).
State: the socket (and its CURVE authenticator), the pool view, per handshaken peer (at most
MAX_PEERS, least recent dropped) the applied / rejected counts since its last flush, and the
exception that ended its thread, if one did.
"""
from __future__ import annotations

import logging
import os
import threading
from collections import OrderedDict
from collections.abc import Callable

import msgspec
import numpy as np
import zmq

from pipeline.cache.tcp import (
    DATA,
    DONE,
    ERR,
    FLUSH,
    HELLO,
    MAX_DONE_FRAME,
    MAX_SMALL_FRAME,
    MAX_TOKEN,
    OK,
    FlushAck,
    Hello,
    KVDone,
    KVHeader,
    PeerInfo,
    host_identity,
)
from pipeline.ipc.curve import server_socket_setup
from pipeline.ipc.errors import PeerDied
from pipeline.messages.kv_layout import MUST_MATCH, KVLayout

logger = logging.getLogger(__name__)

_enc = msgspec.msgpack.Encoder()
_hello_dec = msgspec.msgpack.Decoder(Hello)
_header_dec = msgspec.msgpack.Decoder(KVHeader)
_done_dec = msgspec.msgpack.Decoder(KVDone)
_int_dec = msgspec.msgpack.Decoder(int)


class _Rejected(Exception):
    pass


class _Peer:
    __slots__ = ("applied", "rejected", "reason")

    def __init__(self) -> None:
        self.applied = self.rejected = 0
        self.reason = ""


DoneFn = Callable[[str, int, str], None]


CLOSE_JOIN_S = 10.0  # KVReceiver.close: how long the receiver thread gets to end
CURVE_OVERHEAD = 64  # a CURVE MESSAGE command: name, nonce, flags, MAC (50 bytes), rounded up
MAX_PEERS = 256  # handshaken peers remembered (a prefill instance is one peer per link)
# Whole messages libzmq queues per peer before it stops reading that peer's connection: the
# sender gets back-pressure (its SNDTIMEO), we hold at most this many of its messages.
RCVHWM = 8


class KVReceiver:
    """Decode side: receives runs of blocks into `pool` (laid out as `layout`) on a thread.

    `segment`: the name of `pool`'s shared-memory segment, told to peers so that one on the
    same `host` (default: this one's `host_identity()`) can copy into it directly ("": none).
    `pool` None: the pool is on CUDA, `cuda_ipc` its handle (told to peers the same way) and
    every data message is rejected.
    `on_done(req_id, token, error)`: called on the receiver thread for each valid done
    message; PeerDied from it ends the thread (`error` holds it, `wait` returns True), any
    other exception rejects that message. `max_token`: larger tokens are rejected.
    `curve_keys`: a CURVE server with DIR's server key pair admitting DIR/authorized_clients
    ("": none; the caller checked the bind with `bind.check_bind`)."""

    def __init__(self, pool: object | None, layout: KVLayout, endpoint: str = "tcp://127.0.0.1:0", *,
                 segment: str = "", host: str | None = None, on_done: DoneFn | None = None,
                 max_token: int = MAX_TOKEN, cuda_ipc: bytes = b"", curve_keys: str = "") -> None:
        if pool is None and not cuda_ipc:
            raise ValueError("KVReceiver: no pool and no cuda_ipc handle: nowhere for blocks to go")
        self.layout = layout
        self._dst: np.ndarray | None = None if pool is None else layout.pool(pool)
        self.host = host_identity() if host is None else host
        self._local = PeerInfo(layout, True, pool is None, segment, cuda_ipc)  # a peer on this host
        self._remote = PeerInfo(layout, False, pool is None)  # any other: nothing it could use
        self.on_done, self.max_token = on_done, max_token
        self.rejected = 0  # all peers, since start: for tests and metrics
        self.done = 0  # done messages handed to on_done
        self.error: BaseException | None = None  # what ended the thread, if not close()
        self.stopping = False  # close() was called: on_done may give up waiting
        self._peers: OrderedDict[bytes, _Peer] = OrderedDict()
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        # The largest legal frame is one layer's K (or V) of the whole pool; libzmq applies the
        # limit to the wire frame, which under CURVE carries CURVE_OVERHEAD bytes more.
        self._sock.setsockopt(zmq.MAXMSGSIZE, max(MAX_DONE_FRAME, layout.num_blocks * layout.block_bytes)
                              + CURVE_OVERHEAD)
        self._sock.setsockopt(zmq.RCVHWM, RCVHWM)
        self._auth = None
        try:
            if curve_keys:
                self._auth = server_socket_setup(self._sock, curve_keys)
            self._sock.bind(endpoint)
        except (zmq.ZMQError, OSError, ValueError) as e:
            if self._auth is not None:
                self._auth.stop()
            self._sock.close()
            self._ctx.term()
            raise OSError(f"KV receiver cannot listen on {endpoint}: {e}") from None
        self.endpoint = self._sock.getsockopt_string(zmq.LAST_ENDPOINT)
        stop_addr = f"inproc://kv-receiver-stop-{id(self)}-{os.getpid()}"
        self._stop_rx = self._ctx.socket(zmq.PAIR)
        self._stop_rx.bind(stop_addr)
        self._stop_tx = self._ctx.socket(zmq.PAIR)
        self._stop_tx.connect(stop_addr)
        # The thread says itself when it ended. Thread.join is not trusted for that: on
        # Python 3.11 a signal's exception (the stage's STOP_SIGNAL) raised inside join()
        # can mark a live thread stopped (bpo-45274), and close() then destroyed the
        # sockets under its poll: libzmq aborted the stage (signaler.cpp assertion).
        self._ended = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="kv-receiver", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        try:
            self._loop()
        except BaseException as e:  # noqa: BLE001 - kept for the owner (wait / error)
            self.error = e
            if not isinstance(e, PeerDied):
                logger.error("KV receiver %s stopped: %s: %s", self.endpoint, type(e).__name__, e)
        finally:
            self._ended.set()

    def _loop(self) -> None:
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        poller.register(self._stop_rx, zmq.POLLIN)
        while self._stop_rx not in dict(poller.poll()):  # blocks: no timeout, no polling
            frames = self._sock.recv_multipart(copy=False)
            peer = frames[0].bytes
            try:
                self._handle(peer, frames[1:])
            except PeerDied:
                raise  # on_done's ring reader (the engine) died: nothing left to serve
            except Exception as e:  # noqa: BLE001 - a bad message must never end the receiver
                self.rejected += 1
                logger.warning("KV receiver %s: rejected a message (%d bytes) from peer %s: %s",
                               self.endpoint, sum(len(f) for f in frames), peer.hex(), e)
                if (p := self._peers.get(peer)) is not None:
                    p.rejected += 1
                    p.reason = str(e)[:MAX_SMALL_FRAME]
            del frames  # released now, not kept while we wait for the next message

    def _handle(self, peer: bytes, frames: list) -> None:
        kind = frames[0].bytes if frames and len(frames[0]) <= 1 else None
        if kind == HELLO and len(frames) == 2 and len(frames[1]) <= MAX_SMALL_FRAME:
            self._hello(peer, _hello_dec.decode(frames[1].buffer))
            return
        p = self._peers.get(peer)
        if p is None:
            if kind == FLUSH:  # the sender would otherwise wait out its time-out
                self._sock.send_multipart([peer, ERR, b"no handshake from this peer (receiver restarted?)"])
            raise _Rejected("message before a successful handshake")
        if kind == DATA and self._dst is None:
            raise _Rejected("data message, but this receiver's KV pool is on CUDA: blocks come "
                            "only by CUDA IPC from a CUDA prefill instance on this host (tcp into "
                            "GPU memory is not built)")
        if kind == DATA and len(frames) == 4 and len(frames[1]) <= MAX_SMALL_FRAME:
            self._apply(_header_dec.decode(frames[1].buffer), frames[2], frames[3])
            p.applied += 1
        elif kind == FLUSH and len(frames) == 2 and len(frames[1]) <= MAX_SMALL_FRAME:
            seq = _int_dec.decode(frames[1].buffer)
            self._sock.send_multipart([peer, FLUSH, _enc.encode(FlushAck(seq, p.applied, p.rejected, p.reason))])
            self._peers[peer] = _Peer()
            self._peers.move_to_end(peer)
        elif kind == DONE and len(frames) == 2 and len(frames[1]) <= MAX_DONE_FRAME:
            self._done(_done_dec.decode(frames[1].buffer))
        else:
            raise _Rejected(f"unexpected message: kind {kind!r}, {len(frames)} frames")

    def _hello(self, peer: bytes, h: Hello) -> None:
        """The layout check; the peer is told the differing field names only (the values,
        the model hash among them, stay in our log), and our segment only if on our host."""
        diffs = [f for f in MUST_MATCH if getattr(h.layout, f) != getattr(self.layout, f)]
        if diffs:
            self._sock.send_multipart([peer, ERR, f"KV layout mismatch on {', '.join(diffs)}".encode()])
            raise _Rejected("handshake refused: " + "; ".join(
                f"{f}: ours={getattr(self.layout, f)!r} theirs={getattr(h.layout, f)!r}" for f in diffs))
        self._peers[peer] = _Peer()
        self._peers.move_to_end(peer)
        while len(self._peers) > MAX_PEERS:
            self._peers.popitem(last=False)
        same = bool(self.host) and h.host == self.host
        self._sock.send_multipart([peer, OK, _enc.encode(self._local if same else self._remote)])

    def _done(self, d: KVDone) -> None:
        if not d.error and not 0 <= d.token <= self.max_token:
            raise _Rejected(f"done for {d.req_id!r}: token={d.token} out of range 0..{self.max_token} "
                            f"and no error")
        if self.on_done is None:
            raise _Rejected("done message, but this receiver takes none")
        self.on_done(d.req_id, d.token, d.error)
        self.done += 1

    def _apply(self, h: KVHeader, k: zmq.Frame, v: zmq.Frame) -> None:
        """Checks the whole message before writing a byte of it."""
        lay = self.layout
        start, n = h.start, h.count
        if not 0 <= h.layer < lay.num_layers:
            raise _Rejected(f"layer={h.layer} out of range 0..{lay.num_layers - 1}")
        if not (n >= 1 and 0 <= start and start + n <= lay.num_blocks):
            raise _Rejected(f"blocks {start}..{start + n - 1} out of range 0..{lay.num_blocks - 1}")
        want = n * lay.block_bytes
        if len(k) != want or len(v) != want:
            raise _Rejected(f"K/V frames of {len(k)}/{len(v)} bytes, {n} blocks need {want} each")
        assert self._dst is not None  # _handle refused data without a host pool
        dst = self._dst[h.layer]
        for j, f in enumerate((k, v)):
            dst[j, start:start + n] = np.frombuffer(f.buffer, np.uint8).reshape(n, -1)

    def wait(self, timeout: float | None = None) -> bool:
        """Block until the receiver thread ended (then True; `error` says why) or `timeout`."""
        return self._ended.wait(timeout)

    def close(self) -> None:
        """Stop the thread, close the sockets, drop the pool view. Idempotent."""
        if self.stopping:
            return
        self.stopping = True
        self._stop_tx.send(b"")
        if not self._ended.wait(CLOSE_JOIN_S):
            # Sockets must not close under a thread still using them (libzmq aborts), and
            # term() would block on them: leave both to the process's exit.
            logger.error("KV receiver %s: thread did not end in %.0f s; sockets left open",
                         self.endpoint, CLOSE_JOIN_S)
            return
        if self._auth is not None:
            self._auth.stop()
        # destroy(): close every socket left, then terminate without waiting on them (a
        # plain term() blocks for good on a socket still open).
        self._ctx.destroy(linger=0)
        self._dst = None
