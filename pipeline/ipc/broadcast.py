"""Transport: the one-writer/N-reader broadcast ring (engine -> tensor-parallel workers).

Owns `BroadcastRing` over pipeline._ext.shmring's `RingView`.
State: one segment with the writer's head, one tail and parker per reader, and the records.
Every reader sees every message in order; the writer waits for the slowest reader, and a
dead reader (or a dead writer, seen from a reader) raises `PeerDied`.
"""
from __future__ import annotations

from pipeline._ext import shmring
from pipeline.ipc.instance import Instance
from pipeline.ipc.ring import DEFAULT_SLICE_S, DEFAULT_SPIN_US, _check_capacity
from pipeline.ipc.segment import attach_segment


class BroadcastRing(shmring.RingView):
    """Writer end from `create`, reader `reader_index` from `attach`. Same send/recv/try_recv
    contract as `Ring` (messages at most capacity/2 bytes)."""

    @classmethod
    def create(cls, instance: Instance, what: str, capacity: int, num_readers: int,
               spin_us: float = DEFAULT_SPIN_US, slice_s: float = DEFAULT_SLICE_S,
               claim: bool = False) -> BroadcastRing:
        """Create the ring and return its writer end (claimed now if `claim`, else on send)."""
        _check_capacity(capacity)
        if not 1 <= num_readers <= shmring.MAX_READERS:
            raise ValueError(f"num_readers={num_readers} must be within 1..{shmring.MAX_READERS}")
        seg = instance.create_segment(what, shmring.RingView.segment_size(num_readers, capacity))
        shmring.RingView.layout(seg, num_readers, capacity, "")
        ring = cls(seg, True, 0, None, spin_us, slice_s)
        if claim:
            ring.claim()
        return ring

    @classmethod
    def attach(cls, name: str, reader_index: int, spin_us: float = DEFAULT_SPIN_US,
               slice_s: float = DEFAULT_SLICE_S, claim: bool = True) -> BroadcastRing:
        """Attach as reader `reader_index` (0..num_readers-1) and record this process's pid."""
        seg = attach_segment(name)
        ring = cls(seg, False, reader_index, None, spin_us, slice_s)
        if claim:
            ring.claim()
        return ring

    @classmethod
    def attach_writer(cls, name: str, spin_us: float = DEFAULT_SPIN_US,
                      slice_s: float = DEFAULT_SLICE_S) -> BroadcastRing:
        """Attach as the writer when the ring was created by another process (the gateway)."""
        ring = cls(attach_segment(name), True, 0, None, spin_us, slice_s)
        ring.claim()
        return ring

    def __repr__(self) -> str:
        end = "writer" if self.is_writer else "reader"
        return f"BroadcastRing({self.name!r}, {end}, readers={self.num_readers})"
