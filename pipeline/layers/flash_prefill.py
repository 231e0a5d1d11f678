"""Layers: prefill attention on tensor cores (CUDA, a half-precision KV cache).

The paged kernel (``ops.paged_attention``) computes every query row with CUDA-core dot
products: right for decode, where a step reads each context once for one row, and for short
speculative verifies; a long prompt is a matrix product, which it leaves to the CUDA cores
(bf16 prefill ran at 0.85x float32 on an H200). So a step's sequences that bring at least
``MIN_Q`` query tokens (a prompt, or a chunk of one) go to FlashAttention-2 (torch's own copy,
``aten._flash_attention_forward``, varlen, causal aligned to the end of each context, grouped
K/V heads native) over their contexts gathered contiguous from the paged cache; the rest of the
step stays on the paged kernel. The gather copies each flash sequence's K/V once per layer: a
few MB for an 8k-token prompt, against ~T^2 tensor-core work on it.

Owns nothing: ``FlashPrefill`` is one step's split, planned on the host by worker/step_inputs
(``plan``) and read by every layer's attention (models/llama.py).
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from pipeline.layers import ops

MIN_Q = 16  # a sequence with fewer query tokens stays on the paged kernel (decode, verify)


@dataclass(slots=True)
class FlashPrefill:
    """One step's split between the flash kernel and the paged one (tensors on the device)."""
    rows: torch.Tensor | None  # [Tf] int64 the step's token rows of the flash sequences; None: all
    cu_q: torch.Tensor  # [F+1] int32 cumulative query tokens of the flash sequences
    cu_k: torch.Tensor  # [F+1] int32 cumulative context lengths (their gathered K/V)
    max_q: int
    max_k: int
    kv_slots: torch.Tensor  # [cu_k[-1]] int64 cache slot of each context token, sequence by sequence
    # The paged kernel's share of the step (None when every sequence is a flash one):
    paged_rows: torch.Tensor | None = None  # [Tp] int64
    paged_cu: torch.Tensor | None = None  # [P+1] int32
    paged_seq_lens: torch.Tensor | None = None  # [P] int32
    paged_block_tables: torch.Tensor | None = None  # [P, M] int32


def supported(device: torch.device, dtype: torch.dtype, head_dim: int) -> bool:
    """FlashAttention-2's reach: CUDA sm_80+, fp16/bf16, head_dim a multiple of 8 up to 256."""
    return (device.type == "cuda" and dtype in (torch.float16, torch.bfloat16)
            and head_dim % 8 == 0 and head_dim <= 256
            and torch.cuda.get_device_capability(device)[0] >= 8)


def _ranges(starts: np.ndarray, lens: np.ndarray) -> np.ndarray:
    """The concatenation of arange(s, s + n) for each (s, n), as int64."""
    total = int(lens.sum())
    first = np.zeros(len(lens), dtype=np.int64)
    np.cumsum(lens[:-1], out=first[1:])
    return np.repeat(starts.astype(np.int64) - first, lens) + np.arange(total, dtype=np.int64)


def _cumsum32(a: np.ndarray) -> np.ndarray:
    cu = np.zeros(len(a) + 1, dtype=np.int32)
    np.cumsum(a, out=cu[1:])
    return cu


def plan(num_scheduled: np.ndarray, seq_lens: np.ndarray, block_tables: np.ndarray, block_size: int,
         to_device: Callable[[np.ndarray], torch.Tensor]) -> FlashPrefill | None:
    """The split of one step (sequences in batch order: query tokens, context lengths, block
    table rows), or None when no sequence brings ``MIN_Q`` query tokens."""
    flash = num_scheduled >= MIN_Q
    if not flash.any():
        return None
    cu = _cumsum32(num_scheduled)
    fi = np.nonzero(flash)[0]
    fq, fk = num_scheduled[fi], seq_lens[fi]
    cu_k = _cumsum32(fk)
    # Context position p of flash sequence j lives in slot table[j, p // bs] * bs + p % bs.
    seq_of = np.repeat(np.arange(len(fi)), fk)
    pos = _ranges(np.zeros(len(fi), dtype=np.int64), fk)
    kv_slots = block_tables[fi][seq_of, pos // block_size].astype(np.int64) * block_size + pos % block_size
    p = FlashPrefill(rows=None if flash.all() else to_device(_ranges(cu[fi], fq)),
                     cu_q=to_device(_cumsum32(fq)), cu_k=to_device(cu_k),
                     max_q=int(fq.max()), max_k=int(fk.max()), kv_slots=to_device(kv_slots))
    if p.rows is not None:
        di = np.nonzero(~flash)[0]
        dq = num_scheduled[di]
        p.paged_rows = to_device(_ranges(cu[di], dq))
        p.paged_cu = to_device(_cumsum32(dq))
        p.paged_seq_lens = to_device(seq_lens[di].astype(np.int32))
        p.paged_block_tables = to_device(np.ascontiguousarray(block_tables[di]))
    return p


def varlen_causal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_q: torch.Tensor,
                  cu_k: torch.Tensor, max_q: int, max_k: int, scale: float) -> torch.Tensor:
    """FlashAttention-2 over packed sequences: query j of a sequence with n queries and m keys
    sees keys 0 .. m - n + j (causal, aligned to the end). The one call into the kernel."""
    return torch.ops.aten._flash_attention_forward(q, k, v, cu_q, cu_k, max_q, max_k, 0.0, True, False,
                                                   scale=scale)[0]


def attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, p: FlashPrefill,
              scale: float) -> torch.Tensor:
    """Causal attention of the step's q [T, H, D] (K/V of this step already in the cache), as
    ``ops.paged_attention`` computes it; returns a contiguous [T, H, D]."""
    kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    k = k_cache.view(-1, kv_heads, head_dim).index_select(0, p.kv_slots)
    v = v_cache.view(-1, kv_heads, head_dim).index_select(0, p.kv_slots)
    qf = q.contiguous() if p.rows is None else q.index_select(0, p.rows)
    of = varlen_causal(qf, k, v, p.cu_q, p.cu_k, p.max_q, p.max_k, scale)
    if p.rows is None:
        return of
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    out.index_copy_(0, p.rows, of)
    assert p.paged_rows is not None and p.paged_cu is not None  # planned with the flash rows
    assert p.paged_seq_lens is not None and p.paged_block_tables is not None
    od = ops.paged_attention(q.index_select(0, p.paged_rows), k_cache, v_cache, p.paged_cu,
                             p.paged_seq_lens, p.paged_block_tables, scale)
    out.index_copy_(0, p.paged_rows, od)
    return out
