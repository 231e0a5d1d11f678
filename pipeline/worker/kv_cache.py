"""Worker stage: the paged KV cache memory of one worker (one TP rank).

Owns the cache memory, described by ``KVCache.layout`` (a `messages.kv_layout.KVLayout`,
what the worker stage reports in ``ModelInfo.kv``). Layout of the one allocation (CPU shared
memory or one CUDA tensor): ``[num_layers, 2 (K, V), num_blocks, block_size, num_kv_heads,
head_dim]``, so each layer's K and V are contiguous and a layer can be shipped as two slabs. On CPU it is a
POSIX shared-memory segment ``/pipeline.<instance_id>.kv`` (rank > 0 adds ``.<rank>``) that
the cache messager maps by name (``pipeline.ipc.segment.attach_segment``); it is named
through ``Instance.join(id)`` of ``pipeline.ipc.instance`` (a view of the gateway's instance
when served, or, in-process (``LLM``, benchmarks), an instance this process owns, so the
segment always has an owner record) and created O_EXCL with mode 0600, its space reserved up
front (a full /dev/shm is an error at start-up, never a SIGBUS at a first write) but its pages
mapped at first touch (``create_lazy_segment``: no start-up time spent on page tables). Its
default size follows the model (``worker.kv_sizing``), so a small model reserves little.
Unlinked on close() or at this process's exit (SIGTERM too), and swept by
``unlink_instance``/``sweep_stale`` as soon as its owner is dead if this process dies first
(SIGKILL). On CUDA the one tensor is what the worker stage exports by CUDA IPC
(``pipeline.ipc.cuda_ipc.export_pool``) on a prefill or decode instance: ``buffer`` must
stay this allocation (never reallocated) while peers may map it.

Under tensor parallelism on a prefill or decode instance (``shared_ranks``), the ranks of the
host share ONE segment, ``[num_layers, ranks, 2, num_blocks, block_size, kv_heads_per_rank,
head_dim]``: rank 0 creates it, the others attach, and each keeps its ``[:, rank]`` view.
To the cache messager it is one pool of ``num_layers * ranks`` "layers" (rank r's layer l is
layer ``l * ranks + r``), so it ships every rank's shard with the one-pool code.
"""
from __future__ import annotations

import mmap
import os

import numpy as np
import torch

from pipeline.ipc.instance import Instance
from pipeline.ipc.segment import create_lazy_segment, unlink_segment
from pipeline.messages.kv_layout import KVLayout


def kv_layout(num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int,
              head_dim: int, dtype: torch.dtype) -> KVLayout:
    """The layout of a cache of ``dtype`` (its torch name is what the layout carries)."""
    return KVLayout(num_layers=num_layers, num_blocks=num_blocks, block_size=block_size,
                    num_kv_heads=num_kv_heads, head_dim=head_dim,
                    dtype=str(dtype).removeprefix("torch."))


def _attach_lazy(name: str) -> mmap.mmap:
    """Map another rank's KV segment, its pages at first touch (as ``create_lazy_segment``)."""
    import posix_ipc
    shm = posix_ipc.SharedMemory(name)
    try:
        return mmap.mmap(shm.fd, os.fstat(shm.fd).st_size)
    finally:
        shm.close_fd()


def kv_segment_what(rank: int) -> str:
    return "kv" + (f".{rank}" if rank else "")


class KVCache:
    def __init__(self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int,
                 head_dim: int, dtype: torch.dtype, device: torch.device,
                 instance_id: str = "", rank: int = 0, shared_ranks: int = 0) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        shape: tuple[int, ...] = (num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim)
        # The one segment of every rank (see the module docstring): rank 0 creates it.
        ranks = shared_ranks if shared_ranks > 1 and device.type == "cpu" else 1
        if ranks > 1:
            shape = (num_layers, ranks, 2, num_blocks, block_size, num_kv_heads, head_dim)
        # What the cache messager sees: the whole segment, ranks interleaved per layer.
        self.layout = kv_layout(num_layers * ranks, num_blocks, block_size, num_kv_heads,
                                head_dim, dtype)
        nbytes = self.layout.total_bytes
        self._segment: mmap.mmap | None = None
        self._attached = False
        self._instance: Instance | None = None
        self.shm_name: str | None = None
        if device.type == "cpu":
            if not instance_id:
                raise ValueError("instance_id is required for the CPU KV cache (it names the segment)")
            self._instance = Instance.join(instance_id)
            self.shm_name = self._instance.name(kv_segment_what(0 if ranks > 1 else rank))
            self._attached = ranks > 1 and rank > 0  # rank 0 unlinks the shared one
            try:
                self._segment = (_attach_lazy(self.shm_name) if self._attached
                                 else create_lazy_segment(self.shm_name, nbytes))
                if len(self._segment) != nbytes:
                    raise ValueError(f"KV segment {self.shm_name} is {len(self._segment)} bytes, "
                                     f"rank {rank} expects {nbytes}")
            except BaseException:
                self.close()  # an owner record of our own must not outlive the failure
                raise
            self.buffer = torch.frombuffer(self._segment, dtype=torch.uint8).view(dtype).view(shape)
            if ranks > 1:
                self.buffer = self.buffer[:, rank]
        else:
            self.buffer = torch.zeros(shape, dtype=dtype, device=device)
        self.k_caches = [self.buffer[i, 0] for i in range(num_layers)]
        self.v_caches = [self.buffer[i, 1] for i in range(num_layers)]
        self.layers = list(zip(self.k_caches, self.v_caches))

    @property
    def num_blocks(self) -> int:
        return self.layout.num_blocks

    def segment_bytes(self) -> np.ndarray:
        """The whole CPU segment as uint8 (every rank's part when ranks share it: the pool a
        cache messager moves, ``layout``'s)."""
        if self._segment is None:
            raise ValueError("the KV cache has no shared-memory segment (CUDA, or closed)")
        return np.frombuffer(self._segment, dtype=np.uint8)

    def close(self) -> None:
        """Drop the tensors, unmap and unlink the segment. Idempotent."""
        self.k_caches = self.v_caches = self.layers = []
        self.buffer = None
        if self._segment is not None:
            try:
                self._segment.close()
            except BufferError:
                # A caller still holds a view; the mapping dies with it, the name dies now.
                pass
            self._segment = None
            assert self.shm_name is not None  # set with the segment
            if not self._attached:
                unlink_segment(self.shm_name)  # and off this process's exit list
        if self._instance is not None:
            # The owner record, when this process owns the instance (after the segment).
            self._instance.cleanup()
            self._instance = None

    def __del__(self) -> None:
        self.close()
