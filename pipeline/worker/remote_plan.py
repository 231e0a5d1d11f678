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

Owns: the sockets of one end. No state beyond them.
"""
from __future__ import annotations

import time

import msgspec
import zmq

from pipeline.ipc.errors import PeerDied
from pipeline.messages import SchedulerOutput

HEARTBEAT_S = 1.0
SILENCE_S = 10.0
_HELLO, _PING, _STOP = b"hello", b"ping", b"stop"


def plan_endpoint(addr: str, master_port: int) -> str:
    return f"tcp://{addr}:{master_port + 1}"


class PlanSender:
    """Worker rank 0 of node 0: the plan to every rank of ``ranks`` (those on other hosts)."""

    def __init__(self, addr: str, master_port: int, ranks: list[int], timeout_s: float) -> None:
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.bind(plan_endpoint(addr, master_port))
        self._peers: list[bytes] = []
        self._encoder = msgspec.msgpack.Encoder()
        deadline = time.monotonic() + timeout_s
        want = {str(r).encode() for r in ranks}
        while want - set(self._peers):
            left = deadline - time.monotonic()
            if left <= 0 or not self._sock.poll(int(left * 1000)):
                self.close(stop=False)
                missing = sorted(int(r) for r in want - set(self._peers))
                raise RuntimeError(f"tensor parallel: rank(s) {missing} on other hosts did not "
                                   f"ask for step plans at {plan_endpoint(addr, master_port)} "
                                   f"within {timeout_s:.0f} s")
            ident, msg = self._sock.recv_multipart()
            if msg == _HELLO and ident in want and ident not in self._peers:
                self._peers.append(ident)
        self.last_send = time.monotonic()

    def _send(self, payload: bytes) -> None:
        for ident in self._peers:
            try:
                self._sock.send_multipart([ident, payload])
            except zmq.ZMQError as exc:
                raise PeerDied(f"tensor parallel: rank {int(ident)} on another host is gone "
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
            for ident in self._peers:
                try:
                    self._sock.send_multipart([ident, _STOP], zmq.NOBLOCK)
                except zmq.ZMQError:
                    pass
            self._sock.setsockopt(zmq.LINGER, 1000)
        self._sock.close()
        self._ctx.term()


class PlanReceiver:
    """A rank of node R > 0: the plans worker rank 0 of node 0 forwards."""

    def __init__(self, addr: str, master_port: int, rank: int) -> None:
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.DEALER)
        self._sock.setsockopt(zmq.IDENTITY, str(rank).encode())
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.connect(plan_endpoint(addr, master_port))
        self._sock.send(_HELLO)
        self._decoder = msgspec.msgpack.Decoder(SchedulerOutput)
        self.endpoint = plan_endpoint(addr, master_port)

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
