"""Bench: the memory bandwidth a decode step is held against, measured in the same run as the
figures it bounds (``bench worker``, ``bench cpu``).

- ``read_bandwidth``: every usable core summing a buffer far larger than the caches.
- ``cuda_read_bandwidth``: a reduction over a GPU buffer far larger than its L2.
Owns nothing.
"""
from __future__ import annotations

import os
import time

import numpy as np
import torch


def read_bandwidth(nbytes: int = 1 << 30, reps: int = 5) -> float:
    """Bytes read per second by every usable core summing a buffer far larger than the
    caches (``cpu_ops.read_sum``: eight vector accumulators per thread, so loads bound it),
    best of ``reps``: the most a decode step that streams its weights once can read."""
    from pipeline._ext.cpu_ops import read_sum
    buf = np.ones(nbytes // 4, dtype=np.float32)
    threads = len(os.sched_getaffinity(0))
    ptr = buf.ctypes.data
    read_sum(ptr, buf.size, threads)  # pages faulted in, threads started
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        total = read_sum(ptr, buf.size, threads)
        best = min(best, time.perf_counter() - t)
    assert total == buf.size  # the reads happened
    return nbytes / best


def cuda_read_bandwidth(nbytes: int = 4 << 30, reps: int = 5) -> float:
    """Bytes read per second by a reduction over a GPU buffer far larger than its L2, best of
    ``reps``: the most a decode step that streams its weights once can read on the GPU."""
    buf = torch.ones(nbytes // 4, dtype=torch.float32, device="cuda")
    buf.sum()
    best = float("inf")
    for _ in range(reps):
        torch.cuda.synchronize()
        t = time.perf_counter()
        buf.sum()
        torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t)
    del buf
    torch.cuda.empty_cache()
    return nbytes / best
