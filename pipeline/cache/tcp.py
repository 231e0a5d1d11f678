"""Cache messager stage: KV transfer across hosts over ZMQ (TCP), both ends.

Owns `TcpTransfer` (prefill side, a DEALER: one multipart message per layer sent,
`[b"D", header, K run 1, V run 1, K run 2, ...]`, the header naming the layer and each
contiguous run's remote blocks, the K and V frames zero-copy views of the local pool) and
`KVReceiver` (decode side, a ROUTER served by one thread: handshake, then each run copied
from the received frame straight into its pool). Wire: `[b"H", KVLayout]` answered
`[b"O", KVLayout]` or `[b"E", reason]`; `[b"F", seq]` answered `[b"F", FlushAck]` once every
earlier message of that peer was applied or rejected (ZMQ keeps a peer's messages in order).
A malformed or unexpected message is rejected whole (checked before a byte of it is written),
logged and counted against its peer's next flush; it never stops the receiver. Every frame
is bounded in bytes (MAXMSGSIZE: one layer of the pool; headers by the pool's block count)
and every header field by the layout.
State: TcpTransfer: the socket and messages sent since the last flush. KVReceiver: the
socket, the pool view, per handshaken peer the applied / rejected counts since its last flush.
"""
from __future__ import annotations

import logging
import threading

import msgspec
import numpy as np
import zmq

from pipeline.cache.layout import KVLayout, runs
from pipeline.cache.transfer import KVTransfer, KVTransferError

logger = logging.getLogger(__name__)

HELLO, OK, ERR, DATA, FLUSH = b"H", b"O", b"E", b"D", b"F"
MAX_SMALL_FRAME = 1024  # bytes of a header, layout or flush frame


class KVHeader(msgspec.Struct, array_like=True):
    """One layer's runs: run k is blocks starts[k]..starts[k]+counts[k]-1 of the remote pool."""
    layer: int
    starts: list[int]
    counts: list[int]


class FlushAck(msgspec.Struct, array_like=True):
    seq: int
    applied: int
    rejected: int
    reason: str  # the last rejection's, "" if none


_enc = msgspec.msgpack.Encoder()
_layout_dec = msgspec.msgpack.Decoder(KVLayout)
_header_dec = msgspec.msgpack.Decoder(KVHeader)
_ack_dec = msgspec.msgpack.Decoder(FlushAck)
_int_dec = msgspec.msgpack.Decoder(int)


class TcpTransfer(KVTransfer):
    """Prefill side: connects to a `KVReceiver`, handshakes, then streams runs of blocks."""

    def __init__(self, local_pool: object, local: KVLayout, endpoint: str,
                 timeout_s: float = 10.0) -> None:
        self.local = local
        self._src: np.ndarray | None = local.pool(local_pool)
        self._timeout_ms = int(timeout_s * 1000)
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.DEALER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.SNDTIMEO, self._timeout_ms)  # a dead peer must not block us
        self._sent = self._seq = 0
        self.endpoint = endpoint
        try:
            self._sock.connect(endpoint)
            self._sock.send_multipart([HELLO, _enc.encode(local)])
            kind, body = self._reply("handshake")
            if kind == ERR:
                raise ValueError(f"KV receiver at {endpoint} refused the handshake: "
                                 f"{body.decode(errors='replace')}")
            self.remote = _layout_dec.decode(body)
            local.check_peer(self.remote)
        except BaseException:
            self.close()
            raise

    def _reply(self, what: str) -> tuple[bytes, bytes]:
        if not self._sock.poll(self._timeout_ms):
            raise KVTransferError(f"KV receiver at {self.endpoint}: no {what} reply within "
                                  f"{self._timeout_ms / 1000} s")
        frames = self._sock.recv_multipart()
        if len(frames) != 2:
            raise KVTransferError(f"KV receiver at {self.endpoint}: malformed {what} reply")
        return frames[0], frames[1]

    def send_layer(self, layer: int, pairs: object) -> int:
        if self._src is None:
            raise KVTransferError(f"transfer to {self.endpoint} is closed")
        arr = self.check(layer, pairs)
        src = self._src[layer]
        rs = runs(arr)
        if not rs:
            return 0
        frames: list = [DATA, _enc.encode(KVHeader(layer, [r for _, r, _ in rs], [n for _, _, n in rs]))]
        for lo, _, n in rs:
            frames += (src[0, lo:lo + n], src[1, lo:lo + n])
        try:
            self._sock.send_multipart(frames, copy=False)
            self._sent += 1
        except zmq.ZMQError as e:
            raise KVTransferError(f"KV send to {self.endpoint} failed: {e}") from e
        return 2 * len(arr) * self.local.block_bytes

    def flush(self) -> None:
        self._seq += 1
        sent, self._sent = self._sent, 0
        try:
            self._sock.send_multipart([FLUSH, _enc.encode(self._seq)])
            while True:  # a reply to an earlier, timed-out flush may still come first
                kind, body = self._reply("flush")
                ack = _ack_dec.decode(body) if kind == FLUSH else None
                if ack is None or ack.seq == self._seq:
                    break
        except (zmq.ZMQError, msgspec.DecodeError) as e:
            raise KVTransferError(f"KV flush to {self.endpoint} failed: {e}") from e
        if ack is None or ack.applied != sent or ack.rejected:
            raise KVTransferError(
                f"KV receiver at {self.endpoint} applied {ack.applied if ack else 0} of {sent} "
                f"messages, rejected {ack.rejected if ack else '?'}"
                + (f": {ack.reason}" if ack and ack.reason else ""))

    def close(self) -> None:
        self._src = None  # the view pins the local pool's mapping
        if not self._ctx.closed:
            self._sock.close()
            self._ctx.term()


class _Rejected(Exception):
    pass


class _Peer:
    __slots__ = ("applied", "rejected", "reason")

    def __init__(self) -> None:
        self.applied = self.rejected = 0
        self.reason = ""


class KVReceiver:
    """Decode side: receives runs of blocks into `pool` (laid out as `layout`) on a thread."""

    def __init__(self, pool: object, layout: KVLayout, endpoint: str = "tcp://127.0.0.1:0") -> None:
        self.layout, self._dst = layout, layout.pool(pool)
        self.rejected = 0  # all peers, since start: for tests and metrics
        self._peers: dict[bytes, _Peer] = {}
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        # The largest legal frame is one layer's K (or V) of the whole pool.
        self._sock.setsockopt(zmq.MAXMSGSIZE, max(MAX_SMALL_FRAME, layout.num_blocks * layout.block_bytes))
        # A header names at most one run per block: two msgpack ints (<= 9 bytes each) per run.
        self._max_header = MAX_SMALL_FRAME + 18 * layout.num_blocks
        self._sock.bind(endpoint)
        self.endpoint = self._sock.getsockopt_string(zmq.LAST_ENDPOINT)
        stop_addr = f"inproc://kv-receiver-stop-{id(self)}"
        self._stop_rx = self._ctx.socket(zmq.PAIR)
        self._stop_rx.bind(stop_addr)
        self._stop_tx = self._ctx.socket(zmq.PAIR)
        self._stop_tx.connect(stop_addr)
        self._thread = threading.Thread(target=self._serve, name="kv-receiver", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        poller.register(self._stop_rx, zmq.POLLIN)
        while self._stop_rx not in dict(poller.poll()):  # blocks: no timeout, no polling
            frames = self._sock.recv_multipart(copy=False)
            peer = frames[0].bytes
            try:
                self._handle(peer, frames[1:])
            except Exception as e:  # noqa: BLE001 - a bad message must never end the receiver
                self.rejected += 1
                logger.warning("KV receiver %s: rejected a message from peer %s: %s",
                               self.endpoint, peer.hex(), e)
                if (p := self._peers.get(peer)) is not None:
                    p.rejected += 1
                    p.reason = str(e)

    def _handle(self, peer: bytes, frames: list) -> None:
        kind = frames[0].bytes if frames and len(frames[0]) <= 1 else None
        if kind == HELLO and len(frames) == 2 and len(frames[1]) <= MAX_SMALL_FRAME:
            theirs = _layout_dec.decode(frames[1].buffer)
            try:
                theirs.check_peer(self.layout)
            except ValueError as e:
                self._sock.send_multipart([peer, ERR, str(e).encode()])
                raise _Rejected(e) from None
            self._peers[peer] = _Peer()
            self._sock.send_multipart([peer, OK, _enc.encode(self.layout)])
            return
        p = self._peers.get(peer)
        if p is None:
            raise _Rejected("message before a successful handshake")
        if kind == DATA and len(frames) >= 4 and len(frames[1]) <= self._max_header:
            self._apply(_header_dec.decode(frames[1].buffer), frames[2:])
            p.applied += 1
        elif kind == FLUSH and len(frames) == 2 and len(frames[1]) <= MAX_SMALL_FRAME:
            seq = _int_dec.decode(frames[1].buffer)
            self._sock.send_multipart([peer, FLUSH, _enc.encode(FlushAck(seq, p.applied, p.rejected, p.reason))])
            self._peers[peer] = _Peer()
        else:
            raise _Rejected(f"unexpected message: kind {kind!r}, {len(frames)} frames")

    def _apply(self, h: KVHeader, kv: list) -> None:
        """Checks the whole message before writing a byte of it."""
        lay = self.layout
        if not 0 <= h.layer < lay.num_layers:
            raise _Rejected(f"layer={h.layer} out of range 0..{lay.num_layers - 1}")
        if len(h.starts) != len(h.counts) or len(kv) != 2 * len(h.starts):
            raise _Rejected(f"{len(h.starts)} run starts, {len(h.counts)} run counts and "
                            f"{len(kv)} K/V frames (need 2 per run)")
        for k, (start, n) in enumerate(zip(h.starts, h.counts)):
            if not (n >= 1 and 0 <= start and start + n <= lay.num_blocks):
                raise _Rejected(f"blocks {start}..{start + n - 1} out of range 0..{lay.num_blocks - 1}")
            want = n * lay.block_bytes
            if len(kv[2 * k]) != want or len(kv[2 * k + 1]) != want:
                raise _Rejected(f"K/V frames of {len(kv[2 * k])}/{len(kv[2 * k + 1])} bytes, "
                                f"{n} blocks need {want} each")
        dst = self._dst[h.layer]
        for k, (start, n) in enumerate(zip(h.starts, h.counts)):
            for j in (0, 1):
                dst[j, start:start + n] = np.frombuffer(kv[2 * k + j].buffer, np.uint8).reshape(n, -1)

    def close(self) -> None:
        """Stop the thread, close the sockets, drop the pool view. Idempotent."""
        if self._ctx.closed:
            return
        self._stop_tx.send(b"")
        self._thread.join()
        for s in (self._sock, self._stop_rx, self._stop_tx):
            s.close()
        self._ctx.term()
        self._dst = None  # type: ignore[assignment]
