"""Transport errors (every stage): what a ring, broadcast ring, doorbell or layer signal raises
besides ValueError (bad argument, naming the limit) and TimeoutError (its deadline passed)."""
from __future__ import annotations


class PeerDied(ConnectionError):
    """The process at the other end of a ring or signal exited while we waited on it."""

    def __init__(self, message: str, name: str = "") -> None:
        super().__init__(message)
        self.name = name


class ShmSpaceError(OSError):
    """/dev/shm cannot hold a new segment; says how many bytes were asked and are free."""

    def __init__(self, name: str, asked: int, free: int) -> None:
        super().__init__(
            28, f"cannot create shared-memory segment {name}: asked {asked} bytes, /dev/shm has "
            f"{free} bytes free (enlarge it, e.g. docker --shm-size or mount -o remount,size=...)")
        self.name, self.asked, self.free = name, asked, free
