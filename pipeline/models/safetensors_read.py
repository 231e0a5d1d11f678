"""Models: read a safetensors file one tensor (or one tensor's rows) at a time, straight into
memory this process owns, or (``map``) as a view of the page cache for a tensor that is
packed into new memory at once.

The format is an 8-byte little-endian header length, a JSON header (name -> dtype, shape,
byte offsets), then the raw tensors. Each read is a ``pread`` into a fresh tensor: the bytes
are copied once from the page cache, and none of the file stays mapped, so a load's resident
memory is what it keeps, not what it has read (a ``mmap`` of the whole file holds every page
it has touched in RSS until it is unmapped: a 1 GB single-file checkpoint would count twice
at the peak). ``map`` maps one tensor alone, for as long as its view lives, so the same
holds. ``pread`` releases the GIL, so a thread can read ahead while another packs.

``get_slice(name)[rows]`` / ``[:, cols]`` match ``safetensors.safe_open(...).get_slice``,
which ``loader.read_shard`` (tensor parallelism) uses: a row range is read alone; a column
range reads the tensor and keeps those columns.

Owns the open file descriptor (closed by ``close`` or the ``with`` block).
"""
from __future__ import annotations

import ctypes
import json
import mmap
import os
import struct
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16,
           "BF16": torch.bfloat16, "I64": torch.int64, "I32": torch.int32, "I16": torch.int16,
           "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool,
           "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2}
# Linux caps one read at 2 GiB - 4 KiB; larger tensors take several.
_MAX_READ = 1 << 30
_MADV_POPULATE_WRITE = 23  # Linux 5.14+; older kernels refuse it (EINVAL) and fault as before
_PAGE = mmap.PAGESIZE
_madvise: Callable[..., int] | None
try:
    _madvise = ctypes.CDLL(None, use_errno=True).madvise
except (OSError, AttributeError):  # no libc symbols to find (not Linux)
    _madvise = None


def empty(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """``torch.empty`` with its pages already in place (one ``madvise`` call rather than a
    page fault per 4 KB inside the read: a loaded model is memory first touched by its read,
    and the faults cost as much as the copy; 0.47 s against 0.53 s for 942 MiB kept)."""
    t = torch.empty(shape, dtype=dtype)
    n = t.numel() * t.element_size()
    if _madvise is not None and n >= 64 * _PAGE:
        lo = -(-t.data_ptr() // _PAGE) * _PAGE
        hi = (t.data_ptr() + n) // _PAGE * _PAGE
        _madvise(ctypes.c_void_p(lo), ctypes.c_size_t(hi - lo), _MADV_POPULATE_WRITE)
    return t


class TensorEntry:
    __slots__ = ("dtype", "shape", "start", "end")

    def __init__(self, dtype: torch.dtype, shape: tuple[int, ...], start: int, end: int) -> None:
        self.dtype, self.shape, self.start, self.end = dtype, shape, start, end

    @property
    def row_bytes(self) -> int:
        rows = self.shape[0] if self.shape else 1
        return (self.end - self.start) // rows if rows else 0


class SafetensorsFile:
    """One ``*.safetensors`` file opened for reading (``keys()`` in file order)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self._fd = os.open(self.path, os.O_RDONLY)
        try:
            self.entries = self._parse()
            # Tell the kernel we read front to back: a cold file gets large read-ahead.
            os.posix_fadvise(self._fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
        except BaseException:
            os.close(self._fd)
            raise

    def _parse(self) -> dict[str, TensorEntry]:
        size = os.fstat(self._fd).st_size
        head = os.pread(self._fd, 8, 0)
        n = struct.unpack("<Q", head)[0] if len(head) == 8 else -1
        if not 0 < n <= size - 8:
            raise ValueError(f"{self.path}: not a safetensors file (header length {n}, file {size} bytes)")
        header: dict[str, Any] = json.loads(os.pread(self._fd, n, 8))
        header.pop("__metadata__", None)
        base, out = 8 + n, {}
        for name, e in sorted(header.items(), key=lambda kv: kv[1]["data_offsets"][0]):
            dtype = _DTYPES.get(e["dtype"])
            if dtype is None:
                raise ValueError(f"{self.path}: tensor {name!r} has dtype {e['dtype']}, which torch "
                                 f"cannot hold (supported: {', '.join(_DTYPES)})")
            lo, hi = e["data_offsets"]
            shape = tuple(int(s) for s in e["shape"])
            numel = 1
            for s in shape:
                numel *= s
            if hi - lo != numel * dtype.itemsize or base + hi > size:
                raise ValueError(f"{self.path}: tensor {name!r} ({e['dtype']} {list(shape)}) has "
                                 f"data_offsets [{lo}, {hi}] that do not fit its size or the file "
                                 f"({size} bytes): truncated or corrupt")
            out[name] = TensorEntry(dtype, shape, base + lo, base + hi)
        return out

    def keys(self) -> list[str]:
        return list(self.entries)

    def nbytes(self) -> int:
        return sum(e.end - e.start for e in self.entries.values())

    def _read(self, e: TensorEntry, row_lo: int, row_hi: int,
              out: torch.Tensor | None = None) -> torch.Tensor:
        shape = (row_hi - row_lo, *e.shape[1:]) if e.shape else ()
        buf = empty(shape, e.dtype) if out is None else out
        if tuple(buf.shape) != shape or buf.dtype != e.dtype or not buf.is_contiguous():
            raise ValueError(f"{self.path}: cannot read {e.dtype} {list(shape)} into "
                             f"{buf.dtype} {list(buf.shape)}")
        if buf.numel() == 0:
            return buf
        view = memoryview(buf.view(-1).view(torch.uint8).numpy())
        pos, off = 0, e.start + row_lo * e.row_bytes
        while pos < len(view):
            got = os.preadv(self._fd, [view[pos:pos + _MAX_READ]], off + pos)
            if got <= 0:
                raise ValueError(f"{self.path}: file ended while reading a tensor at byte {off + pos}")
            pos += got
        return buf

    def get_tensor(self, name: str) -> torch.Tensor:
        e = self.entries[name]
        return self._read(e, 0, e.shape[0] if e.shape else 1)

    def read_into(self, name: str, out: torch.Tensor) -> torch.Tensor:
        """Tensor ``name`` into ``out`` (contiguous, its dtype and shape: e.g. rows of a fused
        parameter), with no copy of its own."""
        e = self.entries[name]
        return self._read(e, 0, e.shape[0] if e.shape else 1, out)

    def map(self, name: str) -> torch.Tensor:
        """Tensor ``name`` as a read-only view of the file's pages (page cache, no copy), mapped
        and faulted in by this call (``MAP_POPULATE``: one call, read ahead if cold) and
        unmapped when the last view of it is dropped. For a tensor that is packed into new
        memory at once (``WeightPlan.maps``): reading it costs no copy and no fresh pages.
        Never write to it (the mapping is read-only: a write faults)."""
        e = self.entries[name]
        lo = e.start // _PAGE * _PAGE
        if e.end == e.start:
            return torch.empty(e.shape, dtype=e.dtype)
        mm = mmap.mmap(self._fd, e.end - lo, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0),
                       prot=mmap.PROT_READ, offset=lo)
        with warnings.catch_warnings():  # torch warns that the buffer is not writable: it is not
            warnings.simplefilter("ignore", UserWarning)
            flat = torch.frombuffer(mm, dtype=torch.uint8, count=e.end - e.start, offset=e.start - lo)
        return flat.view(e.dtype).view(e.shape)

    def get_slice(self, name: str) -> TensorSlice:
        return TensorSlice(self, self.entries[name])

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def __enter__(self) -> SafetensorsFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class TensorSlice:
    """What ``safe_open(...).get_slice`` returns, for the indexing ``read_shard`` does."""

    def __init__(self, f: SafetensorsFile, e: TensorEntry) -> None:
        self.f, self.e = f, e

    def get_shape(self) -> list[int]:
        return list(self.e.shape)

    def __getitem__(self, idx: slice | tuple[slice, ...]) -> torch.Tensor:
        idx = idx if isinstance(idx, tuple) else (idx,)
        e = self.e
        if not e.shape:
            return self.f._read(e, 0, 1)
        lo, hi, step = idx[0].indices(e.shape[0])
        if step != 1:
            raise ValueError(f"{self.f.path}: a strided row slice is not supported, got {idx[0]}")
        t = self.f._read(e, lo, max(lo, hi))  # rows are contiguous in the file
        rest = idx[1:]
        return t[(slice(None), *rest)].contiguous() if rest else t
