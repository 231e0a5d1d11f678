"""Transport: the single-producer/single-consumer byte ring between two stages, and the
doorbell that lets one reader block on several rings at once (the engine reads new requests,
worker outputs and aborts).

Owns `Ring`, `Doorbell` and `wait_any` over pipeline._ext.shmring's `RingView`.
State: the ring segment (header, head/tail counters, record data, two parkers), created by an
`Instance` and attached by name. Each end records its pid in the header when it attaches with
a role or first sends/receives; a wait that outlives its peer raises `PeerDied`.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

from pipeline._ext import shmring
from pipeline.ipc.instance import Instance
from pipeline.ipc.segment import attach_segment

Role = Literal["reader", "writer"]
DEFAULT_SPIN_US = 20.0  # spin before parking: below a futex round trip, small on a shared box
DEFAULT_SLICE_S = 0.05  # how often a parked waiter checks that its peer is alive
MIN_CAPACITY = 1024
MAX_CAPACITY = 1 << 32


def _check_capacity(capacity: int) -> None:
    if not MIN_CAPACITY <= capacity <= MAX_CAPACITY or capacity % 64:
        raise ValueError(f"capacity={capacity} must be a multiple of 64 within "
                         f"{MIN_CAPACITY}..{MAX_CAPACITY} bytes")


class Doorbell:
    """A parker in its own segment, shared by every ring one reader waits on."""

    def __init__(self, seg: shmring.Segment) -> None:
        self.segment = seg

    @property
    def name(self) -> str:
        return self.segment.name

    @classmethod
    def create(cls, instance: Instance, what: str) -> Doorbell:
        seg = instance.create_segment(what, shmring.DOORBELL_SIZE)
        shmring.layout_doorbell(seg)
        return cls(seg)

    def close(self) -> None:
        self.segment.close()


class Ring(shmring.RingView):
    """SPSC ring of variable-size messages (at most capacity/2 bytes each).

    `send(data, timeout)` / `recv(timeout)` / `try_recv()` spin for `spin_ns`, then park on a
    semaphore; a timeout raises TimeoutError, a dead peer PeerDied, both naming the ring."""

    @classmethod
    def create(cls, instance: Instance, what: str, capacity: int, doorbell: Doorbell | None = None,
               role: Role = "writer", spin_us: float = DEFAULT_SPIN_US,
               slice_s: float = DEFAULT_SLICE_S, claim: bool = False) -> Ring:
        """Create the ring; this process holds the `role` end (claimed now if `claim`)."""
        _check_capacity(capacity)
        seg = instance.create_segment(what, shmring.RingView.segment_size(1, capacity))
        shmring.RingView.layout(seg, 1, capacity, doorbell.name if doorbell else "")
        return cls._open(seg, role, spin_us, slice_s, claim)

    @classmethod
    def attach(cls, name: str, role: Role = "reader", spin_us: float = DEFAULT_SPIN_US,
               slice_s: float = DEFAULT_SLICE_S, claim: bool = True) -> Ring:
        """Attach to an existing ring by name and claim the `role` end for this process."""
        return cls._open(attach_segment(name), role, spin_us, slice_s, claim)

    @classmethod
    def _open(cls, seg: shmring.Segment, role: Role, spin_us: float, slice_s: float,
              claim: bool) -> Ring:
        if role not in ("reader", "writer"):
            raise ValueError(f"role={role!r} must be 'reader' or 'writer'")
        bell_name = shmring.RingView.doorbell_of(seg)
        bell = attach_segment(bell_name) if bell_name else None
        ring = cls(seg, role == "writer", 0, bell, spin_us, slice_s)
        if claim:
            ring.claim()
        return ring

    def __repr__(self) -> str:
        end = "writer" if self.is_writer else "reader"
        return f"Ring({self.name!r}, {end}, capacity={self.capacity})"

    def __enter__(self) -> Ring:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def wait_any(rings: Sequence[Ring], timeout: float | None = None) -> list[Ring]:
    """Block until at least one of `rings` (reader ends sharing one Doorbell) holds a message;
    return those that do. Spins with rings[0]'s budget, then parks on the doorbell.
    TimeoutError past `timeout`, PeerDied if a writer died."""
    views = list(rings)
    ready = shmring.wait_any(views, timeout)
    return [views[i] for i in ready]
