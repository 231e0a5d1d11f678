"""The ring roles of an instance, and `Channel`: one end of a ring speaking its messages.

RING_ROLES is the wiring diagram: for each single-producer/single-consumer ring, its size,
its producer and its consumer. The engine -> workers step ring is a broadcast ring (one
reader per TP rank). A consumer that reads several rings blocks on one doorbell shared by
them (``SHARED_DOORBELLS``, ``ipc.ring.wait_any``). The gateway creates every ring; stages
attach their ends by the names in their StageSpec. Owns no state.
"""
from __future__ import annotations

from typing import Any, Literal

from pipeline.ipc.broadcast import BroadcastRing
from pipeline.ipc.codec import TaggedCodec
from pipeline.ipc.ring import Ring
from pipeline.messages import RING_MESSAGES
from pipeline.runtime.spec import StageSpec

MiB = 1 << 20
# role -> (capacity, producer, consumer)
RING_ROLES: dict[str, tuple[int, str, str]] = {
    "submit": (8 * MiB, "gateway", "tokenizer"),
    "rejects": (2 * MiB, "tokenizer", "gateway"),
    "register": (8 * MiB, "tokenizer", "output"),
    "requests": (16 * MiB, "tokenizer", "engine"),
    "results": (4 * MiB, "worker", "engine"),
    "outputs": (8 * MiB, "engine", "output"),
    "stops": (1 * MiB, "output", "engine"),
    "answers": (16 * MiB, "output", "gateway"),
    "stats": (256 * 1024, "engine", "gateway"),
}
SHARED_DOORBELLS = ("gateway", "engine", "output")
STEPS_ROLE = "steps"  # engine -> every worker rank (broadcast)
STEPS_CAPACITY = 32 * MiB

End = Literal["reader", "writer"]


class Channel:
    """A ring end plus the codec of the role it plays: send and receive structs, not bytes.

    ``ring`` is the underlying Ring/BroadcastRing (for ``wait_any`` and ``close``)."""
    __slots__ = ("ring", "role", "_encode", "_decode")

    def __init__(self, ring: Ring | BroadcastRing, role: str) -> None:
        codec = TaggedCodec(RING_MESSAGES[role])
        self.ring, self.role = ring, role
        self._encode, self._decode = codec.encode, codec.decode

    def send(self, msg: Any, timeout: float | None = None) -> None:
        """Blocks while the ring is full (back-pressure); PeerDied if its reader died."""
        self.ring.send(self._encode(msg), timeout)

    def recv(self, timeout: float | None = None) -> Any:
        return self._decode(self.ring.recv(timeout))

    def try_recv(self) -> Any:
        buf = self.ring.try_recv()
        return None if buf is None else self._decode(buf)

    def close(self) -> None:
        self.ring.close()


def attach(spec: StageSpec, role: str, end: End = "reader") -> Channel:
    """This stage's `end` of ring `role` (for the step ring, a reader attaches as its rank)."""
    name = spec.rings[role]
    if role == STEPS_ROLE:
        ring: Ring | BroadcastRing = (BroadcastRing.attach_writer(name) if end == "writer"
                                      else BroadcastRing.attach(name, spec.rank))
    else:
        ring = Ring.attach(name, end)
    return Channel(ring, role)
