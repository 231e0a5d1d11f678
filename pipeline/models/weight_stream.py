"""Models: the reading side of a streaming load: a thread that reads the checkpoint's tensors
in file order and hands out complete parameters, the fused ones (q/k/v, gate/up) assembled
by reading each part straight into its rows of one buffer (no concatenation copy). A
parameter the consumer packs into new memory smaller than what is read (``maps``: int8,
int4) is not read but mapped, a view of the page cache (a fused one part by part,
``RowParts``, while each part starts at a 16-row block), and comes with that memory,
faulted in here: the copy from the page cache and the faults of a buffer packed over and
dropped are gone, and the page faults of the packed form are taken on this thread, beside
the packing on the consumer's.

It stays at most ``READ_AHEAD_BYTES`` of complete parameters ahead of the consumer (which
packs each one and calls ``release``), but always reads the next tensor: the disk or the
page-cache copy runs while the previous parameter packs, and memory holds the read-ahead and
the parameters being assembled (their parts are adjacent in the files HF writes), never the
model. Errors (a bad file, a shape config.json does not imply) reach the
consumer as the exception itself.

Owns the reader thread (joined by ``close``) and the buffers of parameters in assembly.
"""
from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from pipeline.models.parallel import TPShard
from pipeline.models.safetensors_read import SafetensorsFile, empty
from pipeline.models.weights import RowParts

# Enough to keep the disk busy while a parameter packs; small beside any model worth streaming.
READ_AHEAD_BYTES = 32 << 20


@dataclass(slots=True)
class Item:
    """One tensor read: its file (index, tensors in it), and the parameter it completed."""
    file: int
    tensors: int
    nbytes: int  # read from the file
    param: str | None = None
    value: torch.Tensor | RowParts | None = None
    mapped: bool = False  # value is a read-only view of the file (SafetensorsFile.map), or its parts
    out: torch.Tensor | None = None  # memory for its packed form (WeightPlan.output_for)
    held: int = 0  # bytes counted against the read-ahead until ``release``


class WeightStream:
    """``route(key)`` -> (param, rows lo, rows hi, parts) or None; ``shapes[param]`` the
    model's shape; ``read_shard(key, slice, shard)`` the rank's part of a tensor."""

    def __init__(self, files: list[Path], route: Callable[[str], tuple[str, int, int, int] | None],
                 shapes: dict[str, tuple[int, ...]], shard: TPShard | None,
                 read_shard: Callable[[str, object, TPShard | None], torch.Tensor],
                 maps: Callable[[str, torch.dtype], bool] = lambda param, dtype: False,
                 output_for: Callable[[str, tuple[int, ...]], torch.Tensor | None] = lambda p, s: None) -> None:
        """``maps(param, dtype)``: a parameter the consumer packs into new memory, handed out
        as a view of the file (``SafetensorsFile.map``: no copy, no fresh pages to fault) with
        ``output_for(param, shape)``, memory for its packed form, faulted in on this thread."""
        self.files, self.route, self.shapes, self.shard, self.read_shard = files, route, shapes, shard, read_shard
        self.maps, self.output_for = maps, output_for
        self.q: queue.Queue[Item | BaseException | None] = queue.Queue()
        self.held = 0
        self.cv = threading.Condition()
        self.stop = False
        # A fused parameter in assembly: its buffer, or None while its parts are mapped (listed).
        self.pending: dict[str, tuple[torch.Tensor | None, set[int], list[tuple[int, torch.Tensor]]]] = {}
        self.thread = threading.Thread(target=self._run, name="weights-reader", daemon=True)
        self.thread.start()

    def _hold(self, item: Item) -> None:
        v = item.value
        assert v is not None
        item.held = (v.nbytes if isinstance(v, RowParts) else v.numel() * v.element_size()) + (
            0 if item.out is None else item.out.numel() * item.out.element_size())
        with self.cv:
            self.held += item.held

    def _run(self) -> None:
        try:
            for i, path in enumerate(self.files):
                with SafetensorsFile(path) as f:
                    for key in f.keys():
                        with self.cv:
                            self.cv.wait_for(lambda: self.stop or self.held < READ_AHEAD_BYTES)
                            if self.stop:
                                return
                        self.q.put(self._read(f, i, key))
            if self.pending:
                raise ValueError(f"checkpoint is missing parts of: {', '.join(sorted(self.pending))}")
            self.q.put(None)
        except BaseException as exc:  # noqa: BLE001 - handed to the consumer
            self.q.put(exc)

    def _read(self, f: SafetensorsFile, i: int, key: str) -> Item:
        e = f.entries[key]
        item = Item(i, len(f.entries), e.end - e.start)
        slot = self.route(key)
        if slot is None:
            return item
        param, lo, hi, parts = slot
        if parts == 1:
            item.param = param
            if (self.shard is None or self.shard.size == 1) and self.maps(param, e.dtype):
                item.value = _map(f, key)
            if item.value is not None:
                item.mapped, item.out = True, self.output_for(param, tuple(item.value.shape))
            else:
                item.value = self.read_shard(key, f.get_slice(key), self.shard)
            self._hold(item)
            return item
        # A buffer in assembly is not held against the limit: only reading its other parts
        # completes it (a fused parameter larger than the limit would wait forever).
        if param not in self.shapes:
            raise ValueError(f"checkpoint tensor {key!r} maps to unknown parameter {param!r} "
                             f"(does config.json match the weights?)")
        shape = self.shapes[param]
        if param not in self.pending:
            whole = self.shard is None or self.shard.size == 1
            self.pending[param] = (None if whole and self.maps(param, e.dtype) else empty(shape, e.dtype), set(), [])
        buf, seen, mapped = self.pending[param]
        if lo in seen:
            raise ValueError(f"checkpoint has {key!r} twice (in two shards?)")
        if buf is None:
            # Parts are packed one by one into their blocks of 16 rows (lowp, int4): each must
            # start at a block and have the rows the route gives it, in one dtype.
            view = (_map(f, key) if lo % 16 == 0 and e.shape == (hi - lo, *shape[1:])
                    and all(t.dtype == e.dtype for _, t in mapped) else None)
            if view is not None:
                mapped.append((lo, view))
            else:  # not packable part by part (or not mappable): one buffer after all
                buf = empty(shape, mapped[0][1].dtype if mapped else e.dtype)
                for plo, t in mapped:
                    buf[plo:plo + t.shape[0]].copy_(t)
                mapped.clear()
                self.pending[param] = (buf, seen, mapped)
        if buf is not None:
            dest = buf[lo:hi]
            direct = (self.shard is None or self.shard.size == 1) and e.dtype == buf.dtype
            if direct and e.shape == tuple(dest.shape):
                f.read_into(key, dest)
            else:
                t = self.read_shard(key, f.get_slice(key), self.shard)
                if tuple(t.shape) != tuple(dest.shape):
                    raise ValueError(f"checkpoint tensor {key!r} has shape {tuple(t.shape)}, "
                                     f"config.json implies {tuple(dest.shape)}")
                dest.copy_(t)
        seen.add(lo)
        if len(seen) == parts:
            del self.pending[param]
            item.param = param
            if buf is None:
                item.value, item.mapped, item.out = RowParts(mapped, shape), True, self.output_for(param, shape)
            else:
                item.value = buf
            self._hold(item)
        return item

    def __iter__(self) -> Iterator[Item]:
        while (item := self.q.get()) is not None:
            if isinstance(item, BaseException):
                raise item
            yield item

    def release(self, nbytes: int) -> None:
        """The consumer is done with ``nbytes`` of what it was handed."""
        with self.cv:
            self.held -= nbytes
            self.cv.notify()

    def close(self) -> None:
        with self.cv:
            self.stop = True
            self.cv.notify()
        self.thread.join()
        self.pending.clear()


def _map(f: SafetensorsFile, key: str) -> torch.Tensor | None:
    """``f.map(key)``, or None where the file cannot be mapped (a file system without
    ``mmap``): the tensor is then read as any other."""
    try:
        return f.map(key)
    except OSError:
        return None
