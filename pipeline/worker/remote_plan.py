"""Worker stage: each step's plan for the ranks on other hosts (tensor parallelism across
nodes, ``--nnodes``).

On node 0 the engine broadcasts each SchedulerOutput on the host's step ring. The ranks of
node R > 0 have no such ring: worker rank 0 forwards every plan to each of them over ZMQ
(``PlanSender``, a ROUTER bound at ``--master-addr:--master-port + 1``; each remote rank a
DEALER, ``PlanReceiver``) before it runs the step itself. ZMQ rather than a
torch.distributed broadcast: a remote rank waits for its next plan for as long as the engine
is idle, which a collective would time out, and a message carries any plan size without a
length round. While idle, rank 0 sends a heartbeat every ``HEARTBEAT_S``; a remote rank
that hears nothing for ``SILENCE_S`` concludes node 0 is gone and stops. Rank 0 sends to
each rank with ROUTER_MANDATORY, so a remote rank whose connection dropped fails the send
(and the instance, naming the rank) at once instead of being skipped.

Who gets the plans (prompt token ids included): with ``--curve-keys`` the ROUTER is a CURVE
server and each rank a CURVE client of the deployment's one key set, so a peer without the
client key never gets past the handshake; without keys ``--master-addr`` must be loopback or
``--allow-insecure-network`` given (EngineConfig.check). A rank proves which rank it is with
its hello, one frame ``hello <rank> <plan_key>``: the key each rank drew at random and
exchanged over the torch.distributed group it joined (RankModel.plan_key), so only the
process that joined as rank R can take rank R's place, once; the ZMQ identity is the
ROUTER's own, never the peer's. Rank 0 answers the accepted hello with ``welcome`` (the
remote rank is ready only then) and reads nothing more once every rank is in; with keys it
then admits no new CURVE client at all. Frames from peers are at most ``MAX_HELLO_BYTES``
and few are queued per connection (RCVHWM).

Owns: the sockets of one end (and node 0's CURVE authenticator). No state beyond them.
"""
from __future__ import annotations

import time
from collections.abc import Mapping

import msgspec
import zmq

from pipeline.ipc.errors import PeerDied
from pipeline.messages import SchedulerOutput

HEARTBEAT_S = 1.0
SILENCE_S = 10.0
MAX_HELLO_BYTES = 1024  # a hello is ~50 bytes; CURVE's handshake commands (INITIATE) need ~300
_HELLO, _WELCOME, _PING, _STOP = b"hello", b"welcome", b"ping", b"stop"


def plan_endpoint(addr: str, master_port: int) -> str:
    return f"tcp://{addr}:{master_port + 1}"


def hello(rank: int, plan_key: str) -> bytes:
    return b"%s %d %s" % (_HELLO, rank, plan_key.encode())


def _claimed_rank(msg: bytes, keys: Mapping[int, str]) -> int | None:
    """The rank a hello proves, or None (not a hello, an unknown rank or the wrong key)."""
    parts = msg.split(b" ")
    if len(parts) != 3 or parts[0] != _HELLO or not parts[1].isdigit():
        return None
    rank = int(parts[1])
    return rank if rank in keys and keys[rank].encode() == parts[2] else None


class _NoNewPeers:
    """CURVE credentials once every rank is in: no key is let in any more."""

    def callback(self, domain: str, key: bytes) -> bool:
        return False


class PlanSender:
    """Worker rank 0 of node 0: the plan to every rank of ``keys`` (those on other hosts: rank
    -> the plan_key it drew, as the group's check_same gathered it)."""

    def __init__(self, addr: str, master_port: int, keys: Mapping[int, str], timeout_s: float,
                 curve_keys: str = "") -> None:
        self._ctx = zmq.Context()
        self._auth = None
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.MAXMSGSIZE, MAX_HELLO_BYTES)
        self._sock.setsockopt(zmq.RCVHWM, 4)
        endpoint = plan_endpoint(addr, master_port)
        try:
            if curve_keys:
                from pipeline.ipc.curve import server_socket_setup
                self._auth = server_socket_setup(self._sock, curve_keys)
            self._sock.bind(endpoint)
        except zmq.ZMQError as exc:
            self.close(stop=False)
            raise RuntimeError(f"tensor parallel: cannot bind the step-plan port {endpoint} "
                               f"(--master-port + 1): {exc}") from None
        self._peers: dict[int, bytes] = {}  # rank -> the ROUTER's routing id of its connection
        self._encoder = msgspec.msgpack.Encoder()
        deadline = time.monotonic() + timeout_s
        while len(self._peers) < len(keys):
            left = deadline - time.monotonic()
            if left <= 0 or not self._sock.poll(int(left * 1000)):
                self.close(stop=False)
                missing = sorted(set(keys) - set(self._peers))
                raise RuntimeError(f"tensor parallel: rank(s) {missing} on other hosts did not "
                                   f"ask for step plans at {endpoint} within {timeout_s:.0f} s")
            frames = self._sock.recv_multipart()
            rank = _claimed_rank(frames[1], keys) if len(frames) == 2 else None
            if rank is None or rank in self._peers:
                continue  # not a rank of this group, or its place is taken: no answer
            self._peers[rank] = frames[0]
            self._sock.send_multipart([frames[0], _WELCOME])
        # No unbind once all are in: libzmq's unbind closes the connections it accepted too.
        # With keys, the door shuts instead: no new peer passes the handshake (so none can
        # make this process buffer a message), whatever key it holds.
        if self._auth is not None:
            self._auth.configure_curve_callback("*", _NoNewPeers())
        self.last_send = time.monotonic()

    def _send(self, payload: bytes) -> None:
        for rank, ident in self._peers.items():
            try:
                self._sock.send_multipart([ident, payload])
            except zmq.ZMQError as exc:
                raise PeerDied(f"tensor parallel: rank {rank} on another host is gone "
                               f"(its plan connection dropped: {exc})") from None
        self.last_send = time.monotonic()

    def send(self, plan: SchedulerOutput) -> None:
        self._send(self._encoder.encode(plan))

    def heartbeat(self) -> None:
        self._send(_PING)

    def close(self, stop: bool = True) -> None:
        """Tell the remote ranks to stop (a clean shutdown of node 0), then close."""
        if self._sock.closed:
            return
        if stop:
            for ident in self._peers.values():
                try:
                    self._sock.send_multipart([ident, _STOP], zmq.NOBLOCK)
                except zmq.ZMQError:
                    pass
            self._sock.setsockopt(zmq.LINGER, 1000)
        self._sock.close()
        if self._auth is not None:
            self._auth.stop()
        self._ctx.term()


class PlanReceiver:
    """A rank of node R > 0: the plans worker rank 0 of node 0 forwards."""

    def __init__(self, addr: str, master_port: int, rank: int, plan_key: str, timeout_s: float,
                 curve_keys: str = "") -> None:
        """Returns once node 0 welcomed this rank (it is bound and took the hello)."""
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.DEALER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self.endpoint = plan_endpoint(addr, master_port)
        if curve_keys:
            from pipeline.ipc.curve import client_socket_setup
            client_socket_setup(self._sock, curve_keys)
        self._sock.connect(self.endpoint)
        self._sock.send(hello(rank, plan_key))
        self._decoder = msgspec.msgpack.Decoder(SchedulerOutput)
        if not self._sock.poll(int(timeout_s * 1000)) or self._sock.recv() != _WELCOME:
            self.close()
            keys = (f"--curve-keys {curve_keys} (node 0 must have the same key set)" if curve_keys
                    else "no --curve-keys (node 0 must have none either)")
            raise RuntimeError(f"tensor parallel: node 0 did not take rank {rank}'s step-plan "
                               f"hello at {self.endpoint} within {timeout_s:.0f} s; this node has "
                               f"{keys}")

    def recv(self) -> SchedulerOutput | None:
        """The next plan; None when node 0 shut down cleanly; PeerDied when it went silent."""
        while True:
            if not self._sock.poll(int(SILENCE_S * 1000)):
                raise PeerDied(f"tensor parallel: node 0 ({self.endpoint}) sent no step plan or "
                               f"heartbeat for {SILENCE_S:.0f} s; it is gone")
            msg = self._sock.recv()
            if msg == _PING:
                continue
            if msg == _STOP:
                return None
            return self._decoder.decode(msg)

    def close(self) -> None:
        self._sock.close()
        self._ctx.term()
