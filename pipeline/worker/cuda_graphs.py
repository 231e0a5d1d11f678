"""Worker stage: CUDA graphs for decode steps.

A decode step of a small model on a GPU is bound by kernel launches, not by the GPU: a
25M-parameter Llama ran 3.2 ms per batch-1 step eagerly on an H200, about 200x what its
weight bytes need. Each decode batch size in ``capture_sizes`` is captured once at load
(a forward over static input buffers); a decode step of n requests then copies its inputs
into those buffers, padded to the next captured size, and replays that graph.

Padding rows are harmless by construction: their slot is -1 (the KV write skips it),
their context is one key of block 0 (read, never written) and their hidden states are
never sampled. The block table is as wide as the longest request (max_model_len /
block_size), so one graph serves every context length.

Not used (the step runs eagerly instead) for prefill and mixed steps, batches larger than
the largest captured size, steps that want prompt logprobs, tensor parallelism (the
collectives are not captured) and while a layer signal is attached (its per-layer host
publication is not a graph node).

Owns: the pinned host staging buffers, their device copies, the captured graphs and their
shared memory pool.
"""
from __future__ import annotations

import bisect
import sys
import time

import numpy as np
import torch

from pipeline.layers.attention import AttentionMetadata
from pipeline.models.llama import CausalLM

# vLLM's choice: the small sizes by powers of two, then every 16 (a padded step wastes at
# most 15 rows), up to 512.
MAX_CAPTURE_SIZE = 512


def capture_sizes(max_num_seqs: int) -> list[int]:
    """Batch sizes to capture, ascending; the last one is at least min(max_num_seqs, 512)."""
    cap = min(max_num_seqs, MAX_CAPTURE_SIZE)
    sizes = [s for s in (1, 2, 4, 8) if s < cap]
    sizes += range(16, cap, 16)
    return sorted(set(sizes) | {cap})


class DecodeGraphs:
    """The captured decode forwards of one model runner (CUDA only)."""

    def __init__(self, model: CausalLM, kv_layers: list[tuple[torch.Tensor, torch.Tensor]],
                 max_num_seqs: int, max_blocks_per_seq: int, device: torch.device) -> None:
        self.model, self.kv_layers, self.device = model, kv_layers, device
        self.sizes = capture_sizes(max_num_seqs)
        n, w = self.max_batch, max_blocks_per_seq
        self.width = w
        # int64: input ids, positions, slots; int32: cu_seqlens_q [n+1], seq_lens [n], then
        # the block table [n, w]. One pinned buffer each, so a step is two copies.
        self._h64 = torch.zeros((3, n), dtype=torch.int64, pin_memory=True)
        self._h32 = torch.zeros(2 * n + 1 + n * w, dtype=torch.int32, pin_memory=True)
        self._h64_np, self._h32_np = self._h64.numpy(), self._h32.numpy()
        self._h32_np[:n + 1] = np.arange(n + 1)  # decode: one query token per sequence
        self._h64_np[2] = -1
        self._h32_np[n + 1:2 * n + 1] = 1
        self._d64 = self._h64.to(device)
        self._d32 = self._h32.to(device)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.replays = 0
        self._copied = torch.cuda.Event()  # the last step's staging copies are done

    @property
    def max_batch(self) -> int:
        return self.sizes[-1]

    def _inputs(self, size: int) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        n, w, d32 = self.max_batch, self.width, self._d32
        meta = AttentionMetadata(slot_mapping=self._d64[2, :size], cu_seqlens_q=d32[:size + 1],
                                 seq_lens=d32[n + 1:n + 1 + size],
                                 block_tables=d32[2 * n + 1:2 * n + 1 + size * w].view(size, w))
        return self._d64[0, :size], self._d64[1, :size], meta

    def capture(self) -> None:
        """Capture every size, largest first, into one memory pool (the smaller graphs reuse
        the largest one's activations). Runs once, after the KV cache exists."""
        t0 = time.perf_counter()
        print(f"cuda graphs: capturing {len(self.sizes)} decode batch sizes up to {self.max_batch}",
              file=sys.stderr, flush=True)
        pool = torch.cuda.graph_pool_handle()
        side = torch.cuda.Stream(self.device)
        with torch.inference_mode():
            for size in reversed(self.sizes):
                ids, positions, meta = self._inputs(size)
                # Eager warm-up on a side stream (lazy cuBLAS and allocator set-up must not
                # happen inside the capture), then the capture itself.
                side.wait_stream(torch.cuda.current_stream(self.device))
                with torch.cuda.stream(side):
                    self.model(ids, positions, meta, self.kv_layers)
                torch.cuda.current_stream(self.device).wait_stream(side)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    hidden = self.model(ids, positions, meta, self.kv_layers)
                self.graphs[size] = (graph, hidden)
        torch.cuda.synchronize(self.device)
        print(f"cuda graphs: {len(self.sizes)} decode batch sizes up to {self.max_batch} captured "
              f"in {time.perf_counter() - t0:.1f}s", file=sys.stderr, flush=True)

    def padded_size(self, num_seqs: int) -> int | None:
        """The captured size that serves a decode step of ``num_seqs`` (None: too large)."""
        i = bisect.bisect_left(self.sizes, num_seqs)
        return self.sizes[i] if i < len(self.sizes) else None

    def stage(self, input_ids: np.ndarray, positions: np.ndarray, slots: np.ndarray,
              seq_lens: np.ndarray, block_rows: np.ndarray
              ) -> tuple[int, torch.Tensor, torch.Tensor, AttentionMetadata]:
        """Copy a decode step of n = len(input_ids) sequences (n <= max_batch) into the static
        buffers of the captured size that serves it; returns that size and its inputs (rows
        past n are padding). ``replay(size)`` then runs the step."""
        num = len(input_ids)
        size = self.padded_size(num)
        assert size is not None, f"decode batch {num} exceeds the largest graph {self.max_batch}"
        n, w = self.max_batch, self.width
        h64, h32 = self._h64_np, self._h32_np
        # A step that samples nothing returns without reading tokens back, so the previous
        # copies may still be reading the staging buffers.
        self._copied.synchronize()
        h64[0, :num], h64[0, num:size] = input_ids, 0
        h64[1, :num], h64[1, num:size] = positions, 0
        h64[2, :num], h64[2, num:size] = slots, -1  # padding writes no K/V
        h32[n + 1:n + 1 + num], h32[n + 1 + num:n + 1 + size] = seq_lens, 1
        table = h32[2 * n + 1:2 * n + 1 + size * w].reshape(size, w)
        table[:num, :block_rows.shape[1]] = block_rows
        table[:num, block_rows.shape[1]:] = 0
        table[num:] = 0
        end = 2 * n + 1 + size * w
        # Pinned sources: both copies are queued without a host wait.
        self._d64.copy_(self._h64, non_blocking=True)
        self._d32[:end].copy_(self._h32[:end], non_blocking=True)
        self._copied.record()
        return (size, *self._inputs(size))

    def replay(self, size: int) -> torch.Tensor:
        """Run the staged step: the final hidden states [size, hidden]. The tensor is the
        graph's own output, overwritten by the next replay of that size."""
        graph, hidden = self.graphs[size]
        graph.replay()
        self.replays += 1
        return hidden
