"""KV disk tier: the directory's size budget, shared by every process using the directory.

Owns ``Budget``: the lock file ``DIR/.lock`` (``fcntl.flock``) whose first 8 bytes are the
directory's byte count, and the eviction scan. State: the lock file's fd (reopened after a
fork: flock locks belong to the open file, which a forked child would share).

Rule (docs/kv_tier.md): a save creates its temp file at its final size, then reserves its
bytes under the lock, then writes (so any scan after the reservation sees the file whole).
When the count would pass the budget, the holder scans every namespace directory (one stat
per file), sets the count to the scanned truth, and removes the least recently used files
(oldest mtime: a load stamps it) until the count is at most 90% of the budget, so a scan is
paid once per tenth of the budget written, not per save. The count can only be too high
between scans (two writers of one key both reserve; a failed rename), never too low, so the
directory never exceeds the budget; the first instance on a directory scans at start.
Temp files older than ``STALE_TMP_S`` (a writer that died mid-write) are removed by a scan.
"""
from __future__ import annotations

import fcntl
import os
import struct
import time
from collections.abc import Iterator
from contextlib import contextmanager

LOCK_NAME = ".lock"
TMP_PREFIX = ".tmp."
LOW_WATER = 0.9
STALE_TMP_S = 600
_COUNT = struct.Struct("<Q")


class Budget:
    def __init__(self, root: str, size_bytes: int) -> None:
        self.root = root
        self.size_bytes = size_bytes
        self.num_scans = 0
        self.num_evicted = 0
        self._fd = -1
        self._pid = -1
        with self._locked() as fd:
            # The first instance on a directory (or one whose lock file was lost) learns the
            # truth once; the others trust the shared count.
            if os.fstat(fd).st_size < _COUNT.size:
                self._write(fd, self._scan_and_evict(self.size_bytes))
            else:
                count = self._read(fd)
                if count > size_bytes:  # a smaller budget than the last instance's
                    self._write(fd, self._scan_and_evict(int(size_bytes * LOW_WATER)))

    def close(self) -> None:
        if self._fd >= 0 and self._pid == os.getpid():
            os.close(self._fd)
        self._fd = -1

    @contextmanager
    def _locked(self) -> Iterator[int]:
        if self._pid != os.getpid():  # new process: its own open file, its own lock
            self._fd = os.open(os.path.join(self.root, LOCK_NAME),
                               os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
            self._pid = os.getpid()
        fcntl.flock(self._fd, fcntl.LOCK_EX)
        try:
            yield self._fd
        finally:
            fcntl.flock(self._fd, fcntl.LOCK_UN)

    @staticmethod
    def _read(fd: int) -> int:
        raw = os.pread(fd, _COUNT.size, 0)
        return _COUNT.unpack(raw)[0] if len(raw) == _COUNT.size else 0

    @staticmethod
    def _write(fd: int, count: int) -> None:
        os.pwrite(fd, _COUNT.pack(max(count, 0)), 0)

    def reserve(self, nbytes: int, own: str | None = None) -> None:
        """Count ``nbytes`` about to be written (into the temp file ``own``, already at its
        final size: this reservation's own scan leaves it out, the others' count it), evicting
        first if they would not fit."""
        with self._locked() as fd:
            count = self._read(fd) + nbytes
            if count > self.size_bytes:
                count = self._scan_and_evict(int(self.size_bytes * LOW_WATER) - nbytes, own) + nbytes
            self._write(fd, count)

    def release(self, nbytes: int) -> None:
        """Uncount ``nbytes`` (a reservation not written, a removed corrupt file)."""
        with self._locked() as fd:
            self._write(fd, self._read(fd) - nbytes)

    def usage(self) -> int:
        """The shared count (an upper bound of the bytes on disk)."""
        with self._locked() as fd:
            return self._read(fd)

    def _scan_and_evict(self, target: int, own: str | None = None) -> int:
        """With the lock held: remove LRU files until at most ``target`` bytes remain (and
        stale temp files); returns the bytes left (not counting the temp file ``own``)."""
        self.num_scans += 1
        now = time.time()
        files: list[tuple[int, int, str]] = []
        total = 0
        with os.scandir(self.root) as top:
            dirs = [e.path for e in top if e.is_dir(follow_symlinks=False)]
        for d in dirs:
            with os.scandir(d) as it:
                for e in it:
                    try:
                        st = e.stat(follow_symlinks=False)
                    except FileNotFoundError:  # removed by a reader that found it corrupt
                        continue
                    if e.name.startswith(TMP_PREFIX):
                        if e.path == own:
                            continue
                        if now - st.st_mtime > STALE_TMP_S:
                            _unlink(e.path)
                        else:  # being written: its writer reserved it
                            total += st.st_size
                        continue
                    files.append((st.st_mtime_ns, st.st_size, e.path))
                    total += st.st_size
        if total > target:
            files.sort()
            for _, size, path in files:
                if total <= target:
                    break
                _unlink(path)
                total -= size
                self.num_evicted += 1
        return total


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
