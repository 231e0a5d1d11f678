"""KV disk tier: blocks of KV kept in files, shared by the instances of one host.

Owns ``DiskTier``: ``save`` a pool block to a file, ``lookup`` how much of a chain of block
hashes is on disk, ``load`` a block (or a layer range of it) back into a pool block, and
``touch`` a chain's recency. State: the directory's ``Budget`` (lock fd) and counters; the
files themselves are the only shared state, so any number of processes may use one
directory (several models too: each layout has its own namespace subdirectory).

Files: ``DIR/<namespace hex>/<key hex>`` (format.py). A save writes a temp file in the same
directory, sized to its final length first, then renames it into place: a reader opens either
nothing or a complete file, and two writers of one key both succeed, the last rename wins,
each file whole. No fsync: the tier is a cache, and a file torn by a power loss fails its
checksums and is a miss (removed), never wrong bytes. ``load`` checks the header (namespace,
key, every layout field, the header crc) and the checksum of each row it reads; anything
wrong (truncated, flipped, swapped, foreign) returns False and removes the file. On False the
destination block's bytes are unspecified (it was read into): the caller recomputes it.
"""
from __future__ import annotations

import errno
import os
import threading
import time
from collections.abc import Sequence

import numpy as np

from pipeline._ext.kv_io import copy_rows, pwrite_rows, row_checksums
from pipeline.cache.kv_tier import format as fmt
from pipeline.cache.kv_tier.budget import TMP_PREFIX, Budget
from pipeline.messages.kv_layout import KVLayout

Key = bytes | int


class DiskTier:
    """Blocks of one KV layout in files under ``root``, the directory kept to ``size_bytes``
    (shared by every DiskTier on it: pass the same size)."""

    def __init__(self, root: str | os.PathLike[str], size_bytes: int, layout: KVLayout) -> None:
        self.layout = layout
        self.file_bytes = fmt.file_len(layout)
        if size_bytes < self.file_bytes:
            raise ValueError(f"kv offload size {size_bytes} bytes is less than one block's "
                             f"file ({self.file_bytes} bytes: {layout.bytes_per_block} of KV "
                             f"plus the header)")
        self.root = os.fspath(root)
        os.makedirs(self.root, exist_ok=True)
        self.ns = layout.tier_namespace()
        self.dir = os.path.join(self.root, self.ns.hex())
        os.makedirs(self.dir, exist_ok=True)
        self.budget = Budget(self.root, size_bytes)
        self._hlen = fmt.header_len(layout)
        self._header_check = fmt.HeaderCheck(layout, self.ns)
        self._row_bytes = 2 * layout.block_bytes  # one layer: K and V
        self.num_saved = self.num_loaded = self.num_corrupt = 0
        self._local = threading.local()  # per thread: its staging buffer

    def close(self) -> None:
        self.budget.close()

    def path(self, key: Key) -> str:
        return os.path.join(self.dir, fmt.key_bytes(key).hex())

    # -- lookup ----------------------------------------------------------------------------
    def lookup(self, keys: Sequence[Key]) -> int:
        """How many leading ``keys`` of a chain have a complete-sized file (one stat each, no
        read: a file found corrupt later is a miss at load)."""
        n = 0
        for k in keys:
            try:
                if os.stat(self.path(k)).st_size != self.file_bytes:
                    break
            except OSError:
                break
            n += 1
        return n

    def touch(self, keys: Sequence[Key]) -> None:
        """Mark a chain used now, its head the newest, so eviction takes tails first (a tail
        without its head can never be hit)."""
        t = time.time_ns()
        for i, k in enumerate(keys):
            stamp = t - i * 1000
            try:
                os.utime(self.path(k), ns=(stamp, stamp))
            except OSError:
                pass

    # -- save ------------------------------------------------------------------------------
    def save(self, key: Key, src: np.ndarray) -> bool:
        """Write block ``src`` (``pool[:, :, block_id, :]``: ``[num_layers, 2, block_bytes]``
        uint8) under ``key``. False when the key is already stored (its recency is renewed)
        or the disk refused the write (full: the tier is a cache, a miss is the cost)."""
        self._check_view(src, "src")
        k = fmt.key_bytes(key)
        path = os.path.join(self.dir, k.hex())
        try:
            _stamp(path)
            return False
        except FileNotFoundError:
            pass
        crcs = np.empty(2 * self.layout.num_layers, dtype=np.uint32)
        row_checksums(src, crcs)
        header = fmt.pack_header(self.layout, self.ns, k, crcs.tobytes())
        tmp = os.path.join(self.dir, f"{TMP_PREFIX}{os.getpid()}.{os.urandom(6).hex()}")
        reserved = False
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
            try:
                # Final size first, then the reservation: an eviction scan in another process
                # that runs after the reservation counts the file whole. (Reserved first, a
                # scan before the file existed set the count to the truth without it, and
                # the count stayed a file below the disk: seen in CI with two instances.)
                os.ftruncate(fd, self.file_bytes)
                self.budget.reserve(self.file_bytes, own=tmp)
                reserved = True
                ok = (os.pwrite(fd, header, 0) == len(header)
                      and pwrite_rows(fd, self._hlen, src) == src.nbytes)
                _stamp(fd)
            finally:
                os.close(fd)
            if ok:
                os.rename(tmp, path)
                self.num_saved += 1
                return True
        except OSError as e:
            if e.errno not in (errno.ENOSPC, errno.EDQUOT, errno.EIO):
                self._abandon(tmp, reserved)
                raise
        self._abandon(tmp, reserved)
        return False

    def _abandon(self, tmp: str, reserved: bool) -> None:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        if reserved:
            self.budget.release(self.file_bytes)

    # -- load ------------------------------------------------------------------------------
    def load(self, key: Key, dst: np.ndarray, layers: tuple[int, int] | None = None) -> bool:
        """Read ``key``'s block into ``dst`` (``[num_layers, 2, block_bytes]`` uint8, e.g.
        ``pool[:, :, block_id, :]``); ``layers=(lo, hi)`` reads only those layers (one
        contiguous range of the file, verified on its own). True only when every byte read
        passed its checksum; a missing file is False, a bad one False and removed."""
        self._check_view(dst, "dst")
        nl = self.layout.num_layers
        lo, hi = layers if layers is not None else (0, nl)
        if not 0 <= lo < hi <= nl:
            raise ValueError(f"layers=({lo}, {hi}) must satisfy 0 <= lo < hi <= {nl}")
        k = fmt.key_bytes(key)
        path = os.path.join(self.dir, k.hex())
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            return False
        hl, rb = self._hlen, self._row_bytes
        stage, all_crcs = self._stage()
        try:
            # Into a staging buffer that stays in cache, checked there, then copied into the
            # pool once (kv_io.copy_rows: streaming stores): faster than reading straight
            # into the pool's strided rows (docs/kv_tier.md). From 0: header and rows in one
            # read; else the header, then the range.
            if lo == 0:
                ok = os.preadv(fd, [stage[:hl + hi * rb]], 0) == hl + hi * rb
            else:
                ok = (os.preadv(fd, [stage[:hl]], 0) == hl
                      and os.preadv(fd, [stage[hl + lo * rb:hl + hi * rb]], hl + lo * rb)
                      == (hi - lo) * rb)
            hdr = fmt.parse_header(stage[:hl], self.layout, self.ns, k) if ok else None
            if hdr is not None:
                crcs = all_crcs[:2 * (hi - lo)]
                copy_rows(stage[hl + lo * rb:hl + hi * rb], dst[lo:hi], crcs)
                if hdr.row_crcs[8 * lo:8 * hi] == crcs.data.cast("B"):
                    if lo == 0:
                        _stamp(fd)  # recency, once per block (its first layers)
                    self.num_loaded += 1
                    return True
            self._remove_bad(fd, path)
            return False
        except OSError:  # an I/O error reading it: a miss, the file left for a later look
            return False
        finally:
            os.close(fd)

    def load_chain(self, keys: Sequence[bytes], pool: np.ndarray, block_ids: Sequence[int]) -> int:
        """How many leading blocks of a chain load whole: ``load`` of ``keys[i]`` into
        ``pool[:, :, block_ids[i], :]`` (``pool``: ``[num_layers, 2, num_blocks,
        block_bytes]`` uint8) for each in turn, up to the first that does not (missing, bad:
        removed as ``load`` does; an id outside the pool), without the recency stamps (the
        caller's ``touch``). What ``load`` does per call and not per block (checking the
        destination, the header's fixed bytes, the staging views) is done once: this is the
        mover's hot loop, 128 blocks for a 2k-token prefix, where ``load``'s Python around
        the read and the copy cost a fifth of the time."""
        nb = pool.shape[2] if pool.ndim == 4 else 0
        if nb:
            self._check_view(pool[:, :, 0, :], "pool[:, :, i, :]")
        check = self._header_check
        stage, crcs = self._stage()
        flen = self.file_bytes
        rows = stage[self._hlen:flen]
        n = 0
        for key, bid in zip(keys, block_ids):
            if not 0 <= bid < nb:
                break
            path = os.path.join(self.dir, key.hex())
            try:
                fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
            except OSError:
                break
            try:
                want = check.row_crcs(stage, key) if os.preadv(fd, [stage], 0) == flen else None
                if want is not None:
                    copy_rows(rows, pool[:, :, bid, :], crcs)
                    if want == crcs.data.cast("B"):
                        n += 1
                        continue
                self._remove_bad(fd, path)
                break
            except OSError:  # an I/O error: a miss, the file left for a later look
                break
            finally:
                os.close(fd)
        self.num_loaded += n
        return n

    def _stage(self) -> tuple[memoryview, np.ndarray]:
        """This thread's staging buffer, one file long, its rows 64-byte aligned (the header
        length is a multiple of 64) for the streaming copy, and its row checksums' array."""
        stage = getattr(self._local, "stage", None)
        if stage is None:
            raw = np.empty(self.file_bytes + 64, dtype=np.uint8)
            off = -raw.ctypes.data % 64
            stage = self._local.stage = (memoryview(raw[off:off + self.file_bytes]),  # type: ignore[arg-type]
                                         np.empty(2 * self.layout.num_layers, dtype=np.uint32))
        return stage

    def _remove_bad(self, fd: int, path: str) -> None:
        # Only the file we read: a writer may have renamed a good one over it since.
        self.num_corrupt += 1
        try:
            if os.stat(path).st_ino != os.fstat(fd).st_ino:
                return
            os.unlink(path)
        except OSError:
            return
        self.budget.release(os.fstat(fd).st_size)

    def _check_view(self, a: np.ndarray, name: str) -> None:
        lay = self.layout
        want = (lay.num_layers, 2, lay.block_bytes)
        if not isinstance(a, np.ndarray) or a.dtype != np.uint8 or a.shape != want:
            got = (a.dtype, a.shape) if isinstance(a, np.ndarray) else type(a).__name__
            raise ValueError(f"{name} must be a uint8 array of shape {want} "
                             f"(pool[:, :, block_id, :]), got {got}")
        if a.strides[2] != 1:
            raise ValueError(f"{name}: each row must be contiguous, strides {a.strides}")


def _stamp(f: int | str) -> None:
    # Explicit nanoseconds: a plain utime takes the kernel's coarse clock (a tick), and LRU
    # order between uses in one tick would be lost.
    t = time.time_ns()
    os.utime(f, ns=(t, t))
