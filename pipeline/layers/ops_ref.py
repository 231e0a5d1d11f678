"""Layers: plain-torch reference versions of the KV-cache and attention ops.

These are the ground truth the C/C++ (``cython_ext/cpu_ops``) and CUDA (``cuda_ops/``)
kernels are tested against, and the fallback ``pipeline.layers.ops`` uses when an
extension is not built. They own no state: every tensor is the caller's.

Layouts (shared by every implementation):

- ``k_cache``/``v_cache``: ``[num_blocks, block_size, num_kv_heads, head_dim]``, contiguous.
- A flattened varlen batch of ``T`` query tokens from ``B`` sequences: sequence ``b``'s new
  tokens are ``q[cu_seqlens_q[b]:cu_seqlens_q[b+1]]``, the last ``q_len_b`` positions of its
  context of ``seq_lens[b]`` tokens, whose K/V are already in the cache.
- ``block_tables[b, p // block_size]`` is the block holding position ``p`` of sequence ``b``.
"""
from __future__ import annotations

import torch


def reshape_and_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write ``key``/``value`` [T, Hkv, D] into the paged cache at ``slot_mapping`` [T].

    A slot is ``block * block_size + offset``; a negative slot marks a padding token and is
    skipped.
    """
    num_blocks, block_size, num_kv_heads, head_dim = k_cache.shape
    valid = slot_mapping >= 0
    slots = slot_mapping[valid].to(torch.long)
    k_flat = k_cache.view(num_blocks * block_size, num_kv_heads, head_dim)
    v_flat = v_cache.view(num_blocks * block_size, num_kv_heads, head_dim)
    k_flat[slots] = key[valid].to(k_cache.dtype)
    v_flat[slots] = value[valid].to(v_cache.dtype)


def gather_context(
    cache: torch.Tensor, block_table: torch.Tensor, seq_len: int
) -> torch.Tensor:
    """Return positions ``0..seq_len-1`` of one sequence as ``[seq_len, Hkv, D]``."""
    block_size = cache.shape[1]
    num_used = (seq_len + block_size - 1) // block_size
    blocks = block_table[:num_used].to(torch.long)
    flat = cache[blocks].reshape(num_used * block_size, cache.shape[2], cache.shape[3])
    return flat[:seq_len]


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of ``q`` [T, H, D] over each sequence's paged context.

    Query ``i`` of sequence ``b`` sits at absolute position ``seq_lens[b] - q_len_b + i``
    and attends to cache positions ``0..`` that position. Computed in float32.
    """
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    group = num_heads // num_kv_heads
    if out is None:
        out = torch.empty_like(q)
    cu = cu_seqlens_q.tolist()
    lens = seq_lens.tolist()
    for b in range(len(lens)):
        start, end = cu[b], cu[b + 1]
        q_len, ctx = end - start, lens[b]
        if q_len == 0:
            continue
        k = gather_context(k_cache, block_tables[b], ctx).float()
        v = gather_context(v_cache, block_tables[b], ctx).float()
        # [Hkv, ctx, D] -> [H, ctx, D]: each kv head serves `group` consecutive q heads.
        k = k.transpose(0, 1).repeat_interleave(group, dim=0)
        v = v.transpose(0, 1).repeat_interleave(group, dim=0)
        qb = q[start:end].float().transpose(0, 1)  # [H, q_len, D]
        scores = torch.matmul(qb, k.transpose(1, 2)) * scale  # [H, q_len, ctx]
        q_pos = torch.arange(ctx - q_len, ctx).unsqueeze(1)
        k_pos = torch.arange(ctx).unsqueeze(0)
        scores = scores.masked_fill(k_pos > q_pos, float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        out[start:end] = torch.matmul(probs, v).transpose(0, 1).to(out.dtype)
    return out


def copy_blocks(
    k_caches: list[torch.Tensor], v_caches: list[torch.Tensor], pairs: torch.Tensor
) -> None:
    """For every layer, copy block ``pairs[i, 0]`` onto block ``pairs[i, 1]`` in K and V."""
    if pairs.numel() == 0:
        return
    src = pairs[:, 0].to(torch.long)
    dst = pairs[:, 1].to(torch.long)
    for k_cache, v_cache in zip(k_caches, v_caches):
        k_cache[dst] = k_cache[src]
        v_cache[dst] = v_cache[src]


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """``out = rms_norm(x + residual) * weight``; with a residual the sum is written back to
    it first (the decoder's residual stream). Computed in float32."""
    if residual is not None:
        residual.add_(x)
        x = residual
    y = torch.nn.functional.rms_norm(x.float(), (x.shape[-1],), weight.float(), eps).to(x.dtype)
    if out is None:
        return y
    out.copy_(y)
    return out


def rope_and_cache(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    positions: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Neox (rotate-half) RoPE on q [T, H, D] and k [T, Hkv, D] in place, then k and v into
    the paged cache. ``cos``/``sin`` are [max_positions, D] tables stored full width as
    ``[c, c]`` and ``[-s, s]``."""
    c = cos.index_select(0, positions).unsqueeze(1)
    s = sin.index_select(0, positions).unsqueeze(1)
    half = q.shape[-1] // 2
    for x in (q, k):
        rotated = torch.roll(x, half, dims=-1)
        x.copy_(torch.addcmul(x * c, rotated, s))
    reshape_and_cache(k, v, k_cache, v_cache, slot_mapping)


def silu_and_mul(x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """``silu(x[:, :I]) * x[:, I:]`` for x [T, 2I]."""
    inter = x.shape[-1] // 2
    y = torch.nn.functional.silu(x[:, :inter]) * x[:, inter:]
    if out is None:
        return y
    out.copy_(y)
    return out
