"""Cache messager stage: the KV link over ZMQ (data over TCP, control always): its wire and
the prefill end; the decode end is `tcp_receiver.KVReceiver`.

Owns `TcpTransfer` (prefill side, a DEALER: the handshake, then one multipart message per
contiguous run of a layer, `[b"D", header, K run, V run]`, the header naming the layer and the
run's remote blocks, the K and V frames zero-copy views of the local pool; flushes; and the
"done" message of a request) and the wire both ends speak (a ROUTER on the decode side:
handshake, then each run copied from the received frame straight into its pool, each done
message handed to `on_done`). Every message has a fixed number of frames:
- `[b"H", Hello]` (the sender's layout and host identity) answered `[b"O", PeerInfo]` (the
  receiver's layout, whether it is on the sender's host and only then the name of its KV
  shared-memory segment and, when its pool is on CUDA, the pool's CUDA IPC handle: what the
  prefill side needs to choose ipc or cuda_ipc) or `[b"E", reason]`: a layout mismatch is
  answered with the differing field names only (values, model hash included, are logged at
  the receiver, never told to the peer);
- `[b"D", KVHeader, K, V]`: one run of one layer;
- `[b"F", seq]` answered `[b"F", FlushAck]` once every earlier message of that peer was
  applied or rejected (ZMQ keeps a peer's messages in order), `[b"E", reason]` to a peer
  without a handshake (a receiver that restarted: the sender fails at once, no time-out);
- `[b"R", KVDone]`: request `req_id`'s KV is in (its first `token`) or failed (`error`);
  applied after that peer's earlier data, for the same ordering reason.
With `curve_keys` (EngineConfig.curve_keys, ipc/curve.py's layout) the receiver is a
CURVE server admitting DIR/authorized_clients and the sender a CURVE client: a peer without
the deployment's client key never gets past the ZMQ handshake (nothing parsed, nothing
answered). A malformed or unexpected message is rejected whole (checked before a byte of it
is written), logged and counted against its peer's next flush; it never stops the receiver.
Every frame is bounded in bytes (MAXMSGSIZE: one layer of the pool; headers and the
handshake by MAX_SMALL_FRAME, done messages by MAX_DONE_FRAME) and every field by the layout
or the KVDone limits.
Sending blocks over the socket from or into GPU memory is not built: a TcpTransfer without a
local pool (a CUDA one) is control only (flushes, done messages) and a KVReceiver without a
host pool (its pool is on CUDA: blocks come by CUDA IPC) rejects every data message, saying so.
State: TcpTransfer: the socket, messages sent since the last flush, when a reply last came.
"""
from __future__ import annotations

import logging
import socket
import time
from typing import Annotated

import msgspec
import numpy as np
import zmq
from msgspec import Meta
from zmq.utils.monitor import recv_monitor_message

from pipeline.cache.transfer import KVTransfer, KVTransferError, runs
from pipeline.ipc.cuda_ipc import MAX_CUDA_IPC
from pipeline.ipc.curve import client_socket_setup
from pipeline.messages.kv_layout import MUST_MATCH, KVLayout

logger = logging.getLogger(__name__)

HELLO, OK, ERR, DATA, FLUSH, DONE = b"H", b"O", b"E", b"D", b"F", b"R"
MAX_SMALL_FRAME = 1024  # bytes of a header, layout or flush frame
MAX_REQ_ID = 256  # characters of a request id (KVTransferParams.remote_req_id's limit)
MAX_DONE_ERROR = 4096  # characters of a done message's error (clipped by the sender)
MAX_DONE_FRAME = 4 * (MAX_DONE_ERROR + MAX_REQ_ID) + 64  # UTF-8: at most 4 bytes a character
MAX_REPLY_FRAME = 64 * 1024  # what the prefill side takes from a receiver in one frame
MAX_TOKEN = 2**31 - 1
# What the sender's monitor reports: the receiver gone, nothing listening (a connect that
# ZMQ retries was refused), or the CURVE handshake failed.
MONITORED = (zmq.EVENT_DISCONNECTED | zmq.EVENT_CONNECT_RETRIED | zmq.EVENT_HANDSHAKE_FAILED_AUTH
             | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL)
_GONE: dict[int, str] = {zmq.EVENT_DISCONNECTED: "disconnected (its instance stopped or died)",
         zmq.EVENT_CONNECT_RETRIED: "is not listening (connection refused)"}


def host_identity() -> str:
    """This host as a peer can compare it: boot id and host name ("" if the boot id is not
    readable: then no peer is taken for the same host)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        return ""
    return f"{boot}/{socket.gethostname()}" if boot else ""


class KVHeader(msgspec.Struct, array_like=True):
    """One run of one layer: blocks start..start+count-1 of the remote pool."""
    layer: int
    start: int
    count: int


class Hello(msgspec.Struct, array_like=True):
    """The sender's handshake: its layout, and its `host_identity()` (so that the receiver
    tells its segment only to a peer on its own host)."""
    layout: KVLayout
    host: Annotated[str, Meta(max_length=512)]


class FlushAck(msgspec.Struct, array_like=True):
    seq: int
    applied: int
    rejected: int
    reason: str  # the last rejection's, "" if none


class PeerInfo(msgspec.Struct, array_like=True):
    """The receiver's handshake reply, after the layout check passed. `segment` and `cuda_ipc`
    are given only to a peer on the receiver's own host (`same_host`): only it can use them."""
    layout: KVLayout
    same_host: bool
    on_cuda: bool  # its pool is on CUDA: it takes no blocks over tcp
    segment: Annotated[str, Meta(max_length=255)] = ""  # its KV pool's shared-memory name
    # its KV pool's CUDA IPC handle (`ipc.cuda_ipc.export_pool`), b"" if the pool is not on CUDA
    cuda_ipc: Annotated[bytes, Meta(max_length=MAX_CUDA_IPC)] = b""


class KVDone(msgspec.Struct, array_like=True):
    """The receiver's request `req_id`: KV in and first `token` sampled, or `error`."""
    req_id: Annotated[str, Meta(min_length=1, max_length=MAX_REQ_ID)]
    token: Annotated[int, Meta(ge=-1, le=MAX_TOKEN)] = -1
    error: Annotated[str, Meta(max_length=MAX_DONE_ERROR)] = ""


def _ours(local: KVLayout, refusal: bytes) -> str:
    """Our values of the fields a refusal names (the receiver tells only their names)."""
    named = [f for f in MUST_MATCH if f.encode() in refusal.split(b" on ", 1)[-1].split(b", ")]
    return f" (this instance's: {', '.join(f'{f}={getattr(local, f)!r}' for f in named)})" if named else ""


_enc = msgspec.msgpack.Encoder()
_peer_dec = msgspec.msgpack.Decoder(PeerInfo)
_ack_dec = msgspec.msgpack.Decoder(FlushAck)


class TcpTransfer(KVTransfer):
    """Prefill side: connects to a `KVReceiver`, handshakes, then streams runs of blocks.

    `timeout_s` bounds every send and every reply (flush); `connect_timeout_s` (default: the
    same) the handshake's reply. `peer` is what the receiver said about itself. `local_pool`
    None: control only (the pool is on CUDA), `send_layer` refuses. `curve_keys`: a CURVE
    client with DIR's client key pair, DIR/server.key the receiver's ("": none). `host`: ours
    as told to the receiver (default `host_identity()`)."""

    def __init__(self, local_pool: object | None, local: KVLayout, endpoint: str,
                 timeout_s: float = 10.0, connect_timeout_s: float | None = None, *,
                 curve_keys: str = "", host: str | None = None) -> None:
        self.local = local
        self._control_only = local_pool is None
        self._src: np.ndarray | None = None if local_pool is None else local.pool(local_pool)
        self._timeout_ms = int(timeout_s * 1000)
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.DEALER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.SNDTIMEO, self._timeout_ms)  # a dead peer must not block us
        self._sock.setsockopt(zmq.MAXMSGSIZE, MAX_REPLY_FRAME)  # replies are small
        if curve_keys:
            client_socket_setup(self._sock, curve_keys)
        # A dead receiver (its instance killed) closes the connection, a receiver with other
        # keys (or none) fails the ZMQ handshake: the monitor says so at once, where a reply
        # would only time out (ZMQ queues sends for a lost peer).
        self._mon = self._sock.get_monitor_socket(MONITORED)
        self._sent = self._seq = 0
        self.endpoint = endpoint
        self.last_reply = time.monotonic()  # when the receiver last answered (LinkCache: idle)
        try:
            self._sock.connect(endpoint)
            me = host_identity() if host is None else host
            self._sock.send_multipart([HELLO, _enc.encode(Hello(local, me))])
            kind, body = self._reply("handshake", connect_timeout_s)
            if kind == ERR:
                raise ValueError(f"KV receiver at {endpoint} refused the handshake: "
                                 f"{body.decode(errors='replace')}{_ours(local, body)}")
            if kind != OK:
                raise KVTransferError(f"KV receiver at {endpoint}: unexpected handshake reply {kind!r}")
            self.peer = _peer_dec.decode(body)
            self.remote = self.peer.layout
            local.check_peer(self.remote)
        except msgspec.DecodeError as e:
            self.close()
            raise KVTransferError(f"KV receiver at {endpoint}: malformed handshake reply: {e}") from None
        except zmq.ZMQError as e:
            self.close()
            raise KVTransferError(f"KV receiver at {endpoint}: {e}") from None
        except BaseException:
            self.close()
            raise

    def _check_connected(self) -> None:
        if self._mon.poll(0):
            event = int(recv_monitor_message(self._mon)["event"])
            why = _GONE.get(event, "refused the ZMQ handshake (CURVE: its --curve-keys and this "
                                   "instance's differ, or one side has none)")
            raise KVTransferError(f"KV receiver at {self.endpoint} {why}")

    def alive(self, probe: bool = True) -> bool:
        """Whether the receiver we shook hands with still serves: no disconnect seen and, if
        `probe`, a flush round trip (nothing sent since the last one) acknowledged; a restarted
        one answers that it has no handshake from us. For a link left idle."""
        try:
            self._check_connected()
            if probe and not self._sent:  # mid-step, the step's own flush tells
                self.flush()
            return True
        except KVTransferError:
            return False

    def _reply(self, what: str, timeout_s: float | None = None) -> tuple[bytes, bytes]:
        ms = self._timeout_ms if timeout_s is None else int(timeout_s * 1000)
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        poller.register(self._mon, zmq.POLLIN)
        events = dict(poller.poll(ms))
        if self._sock not in events:
            self._check_connected()
            raise KVTransferError(f"KV receiver at {self.endpoint}: no {what} reply within "
                                  f"{ms / 1000} s")
        frames = self._sock.recv_multipart()
        if len(frames) != 2:
            raise KVTransferError(f"KV receiver at {self.endpoint}: malformed {what} reply")
        self.last_reply = time.monotonic()
        return frames[0], frames[1]

    def send_layer(self, layer: int, pairs: object) -> int:
        if self._src is None:
            if self._control_only and not self._ctx.closed:
                raise KVTransferError(f"KV send to {self.endpoint}: this KV pool is on CUDA and "
                                      "sending blocks from GPU memory over tcp is not built")
            raise KVTransferError(f"transfer to {self.endpoint} is closed")
        arr = self.check(layer, pairs)
        src = self._src[layer]
        rs = runs(arr)
        if not rs:
            return 0
        self._check_connected()
        try:
            for lo, r, n in rs:  # one message a run: a fixed 4 frames, what the receiver admits
                self._sock.send_multipart([DATA, _enc.encode(KVHeader(layer, r, n)),
                                           src[0, lo:lo + n], src[1, lo:lo + n]], copy=False)
                self._sent += 1
        except zmq.ZMQError as e:
            raise KVTransferError(f"KV send to {self.endpoint} failed: {e}") from e
        return 2 * len(arr) * self.local.block_bytes

    def flush(self) -> None:
        if self._ctx.closed:
            raise KVTransferError(f"transfer to {self.endpoint} is closed")
        self._seq += 1
        sent, self._sent = self._sent, 0
        try:
            self._sock.send_multipart([FLUSH, _enc.encode(self._seq)])
            while True:  # a reply to an earlier, timed-out flush may still come first
                kind, body = self._reply("flush")
                if kind == ERR:
                    raise KVTransferError(f"KV receiver at {self.endpoint} refused the flush: "
                                          f"{body.decode(errors='replace')}")
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

    def send_done(self, req_id: str, token: int = -1, error: str = "") -> None:
        """Tell the receiver its request `req_id` has its KV (and first `token`) or failed
        (`error`, clipped to MAX_DONE_ERROR). Not acknowledged: a lost one times out there.
        ValueError for a field the receiver would refuse; KVTransferError if it cannot be
        queued within the time-out."""
        if self._ctx.closed:
            raise KVTransferError(f"transfer to {self.endpoint} is closed")
        self._check_connected()
        if not 0 < len(req_id) <= MAX_REQ_ID:
            raise ValueError(f"req_id of {len(req_id)} characters must be 1..{MAX_REQ_ID}")
        if not error and not 0 <= token <= MAX_TOKEN:
            raise ValueError(f"token={token} must be in 0..{MAX_TOKEN} (or give an error)")
        msg = KVDone(req_id, -1 if error else token, error[:MAX_DONE_ERROR])
        try:
            self._sock.send_multipart([DONE, _enc.encode(msg)])
        except zmq.ZMQError as e:
            raise KVTransferError(f"KV done message to {self.endpoint} failed: {e}") from e

    def close(self) -> None:
        self._src = None  # the view pins the local pool's mapping
        if not self._ctx.closed:
            self._sock.disable_monitor()
            self._mon.close()
            self._sock.close()
            self._ctx.term()
