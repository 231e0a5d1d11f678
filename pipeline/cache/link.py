"""Cache messager stage (prefill side): the link to one decode peer, and the bounded set of them.

Owns `KVLink`, a `KVTransfer` to one decode instance's cache messager: its ZMQ connection
(`TcpTransfer`: handshake, flush round trips, done messages) always, and the blocks either
over that same socket (tcp) or copied straight into the peer's KV segment (`IpcTransfer`,
ipc) when mode allows, the peer's host identity equals ours and its segment maps. On ipc a
flush is still one round trip on the socket: it proves the peer that owns the segment is the
live receiver we shook hands with (a dead or restarted one fails the step instead of its
blocks silently landing in a segment nobody reads). Owns `LinkCache`: peer endpoint -> link,
the least recently used closed beyond `max_links`; a peer whose connect failed is refused
for `retry_s` (with its error) so that a dead peer costs one handshake time-out, not one per
step. A cached link is checked before use: one whose receiver disconnected (a decode
instance restarted on the same address) or that idled over `idle_s` and fails a flush
round trip is replaced by a new handshake, so a restart costs no request.
A local pool on CUDA (a torch CUDA tensor, from `cuda_ipc.open_pool`) takes the cuda path
instead: the blocks go only by `CudaIpcTransfer` into a peer whose pool is on CUDA on this
host (its handshake reply carries the pool's CUDA IPC handle), whatever the mode but "tcp";
anything else is refused saying why (tcp from GPU memory is not built). A CPU pool is refused
by a peer whose pool is on CUDA (it takes no blocks over tcp).
State: KVLink: its two transfers. LinkCache: the links, the recently failed peers.
With curve_keys every link is a CURVE client (docs/security.md).
"""
from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Callable

from pipeline.cache.cuda_ipc import CudaIpcTransfer
from pipeline.cache.tcp import TcpTransfer
from pipeline.cache.transfer import IpcTransfer, KVTransfer, KVTransferError
from pipeline.messages.kv import MAX_KV_ENDPOINT_BYTES
from pipeline.messages.kv_layout import KVLayout

logger = logging.getLogger(__name__)

MODES = ("auto", "ipc", "tcp")
IDLE_S = 5.0  # a cached link unused this long is checked by a round trip before use


def check_peer_endpoint(peer: object) -> str:
    """`peer` if it is a ZMQ endpoint a link can connect to, else ValueError naming the limit."""
    if not isinstance(peer, str) or not peer.startswith(("tcp://", "ipc://")) \
            or len(peer.encode()) > MAX_KV_ENDPOINT_BYTES:
        raise ValueError(f"peer={peer!r} must be tcp://HOST:PORT or ipc://PATH of at most "
                         f"{MAX_KV_ENDPOINT_BYTES} bytes")
    return peer


class KVLink(KVTransfer):
    """One decode peer. `kind` is "ipc", "tcp" or "cuda_ipc"; `mode` "ipc" that cannot be used
    raises KVTransferError saying why, as does a CUDA `local_pool` that cannot use cuda_ipc.
    `local_segment`: our own pool's name, never taken as a peer's. `curve_keys`: the
    deployment's key DIR ("": plain ZMQ)."""

    def __init__(self, local_pool: object, local: KVLayout, endpoint: str, mode: str = "auto", *,
                 timeout_s: float = 10.0, connect_timeout_s: float | None = None,
                 host: str | None = None, local_segment: str = "", curve_keys: str = "") -> None:
        if mode not in MODES:
            raise ValueError(f"kv_transfer mode={mode!r} must be one of {MODES}")
        self.endpoint = check_peer_endpoint(endpoint)
        cuda = bool(getattr(local_pool, "is_cuda", False))
        if cuda and mode == "tcp":
            raise KVTransferError(f"kv_transfer=tcp to {endpoint} impossible: this KV pool is on "
                                  "CUDA and sending blocks from GPU memory over tcp is not built")
        self.control = TcpTransfer(None if cuda else local_pool, local, endpoint, timeout_s,
                                   connect_timeout_s, curve_keys=curve_keys, host=host)
        self.local, self.remote = local, self.control.remote
        self.data: KVTransfer = self.control
        self.kind = "tcp"
        if cuda:
            self._cuda(local_pool, endpoint, host)
            return
        if self.control.peer.on_cuda:
            self.control.close()
            raise KVTransferError(f"KV peer {endpoint}: its KV pool is on CUDA and takes blocks "
                                  "only by CUDA IPC from a CUDA prefill instance on its host; this "
                                  "one's pool is in host memory")
        if mode == "tcp":
            return
        peer = self.control.peer
        why = self._elsewhere() or (None if peer.segment else "it has no shared-memory KV segment")
        if why is None and peer.segment == local_segment:
            why = f"it names this instance's own KV segment {peer.segment}"
        if why is None:
            try:
                self.data = IpcTransfer(local_pool, local, peer.segment, self.remote)
                self.kind = "ipc"
            except Exception as e:  # noqa: BLE001 - any failure to map it means "not here"
                why = f"cannot map its KV segment {peer.segment}: {type(e).__name__}: {e}"
        if why is not None and mode == "ipc":
            self.control.close()
            raise KVTransferError(f"kv_transfer=ipc to {endpoint} impossible: {why}")

    def _elsewhere(self) -> str | None:
        """Why the peer is not on this host (None: it is; it compared our host identity)."""
        return None if self.control.peer.same_host else "it runs on another host"

    def _cuda(self, local_pool: object, endpoint: str, host: str | None) -> None:
        peer = self.control.peer
        why = None
        if not peer.on_cuda:
            why = "its KV pool is not on CUDA"
        elif (why := self._elsewhere()) is None:
            try:
                self.data = CudaIpcTransfer(local_pool, self.local, peer.cuda_ipc, self.remote)
                self.kind = "cuda_ipc"
            except Exception as e:  # noqa: BLE001 - any failure to open it means "not here"
                why = f"cannot open its CUDA KV pool: {type(e).__name__}: {e}"
        if why is not None:
            self.control.close()
            raise KVTransferError(f"KV peer {endpoint}: CUDA IPC impossible: {why} (this KV pool "
                                  "is on CUDA; sending blocks from GPU memory over tcp is not built)")

    def send_layer(self, layer: int, pairs: object) -> int:
        return self.data.send_layer(layer, pairs)

    def flush(self) -> None:
        self.data.flush()
        if self.data is not self.control:
            self.control.flush()

    def alive(self, probe: bool = True) -> bool:
        """Whether the receiver we shook hands with still serves (`probe`: a round trip)."""
        return self.control.alive(probe)

    def send_done(self, req_id: str, token: int = -1, error: str = "") -> None:
        """The peer's request `req_id` is complete (its first `token`) or failed (`error`).
        Sent after every earlier block of this link (ipc copies end in send_layer)."""
        self.control.send_done(req_id, token, error)

    def close(self) -> None:
        if self.data is not self.control:
            self.data.close()
        self.control.close()


class LinkCache:
    """peer endpoint -> link made by `connect(peer)`, at most `max_links` kept open."""

    def __init__(self, connect: Callable[[str], KVLink], max_links: int = 64,
                 retry_s: float = 1.0, idle_s: float = IDLE_S) -> None:
        if max_links < 1:
            raise ValueError(f"max_links={max_links} must be >= 1")
        self._connect, self.max_links, self.retry_s = connect, max_links, retry_s
        self.idle_s = idle_s
        self._links: OrderedDict[str, KVLink] = OrderedDict()
        self._down: OrderedDict[str, tuple[float, str]] = OrderedDict()  # peer -> (until, why)

    def __len__(self) -> int:
        return len(self._links)

    def get(self, peer: str) -> KVLink:
        """The open link to `peer`, connecting if needed; KVTransferError / ValueError why not."""
        link = self._links.get(peer)
        if link is not None and self._usable(link):
            self._links.move_to_end(peer)
            return link
        if link is not None:
            logger.info("KV link to %s: its receiver is gone (restarted?), connecting anew", peer)
            self.drop(peer)
        check_peer_endpoint(peer)
        down = self._down.get(peer)
        if down is not None:
            if time.monotonic() < down[0]:
                raise KVTransferError(f"{down[1]} (not retried for {self.retry_s} s)")
            del self._down[peer]
        try:
            link = self._connect(peer)
        except Exception as e:
            self._down[peer] = (time.monotonic() + self.retry_s, f"{type(e).__name__}: {e}")
            while len(self._down) > self.max_links:
                self._down.popitem(last=False)
            raise
        logger.info("KV link to %s: %s", peer, link.kind)
        self._links[peer] = link
        while len(self._links) > self.max_links:
            _, old = self._links.popitem(last=False)
            old.close()
        return link

    def _usable(self, link: KVLink) -> bool:
        """A disconnect seen (free to check), or, after `idle_s` without a reply, a flush round
        trip: a receiver restarted on the same address is caught before a step uses it."""
        return link.alive(probe=time.monotonic() - link.control.last_reply >= self.idle_s)

    def drop(self, peer: str) -> None:
        """Close `peer`'s link (after a failure): the next `get` connects anew."""
        link = self._links.pop(peer, None)
        if link is not None:
            link.close()

    def close(self) -> None:
        while self._links:
            self._links.popitem()[1].close()
