"""Layers: the fused per-layer CPU ops of the decoder (float32 activations), dispatched
like ``pipeline.layers.ops``: C in ``pipeline._ext.cpu_ops`` (``cpu_ops_fused.h``,
``cpu_ops_gemv.h``; GIL released) on CPU, the plain-torch versions in ``ops_ref`` elsewhere
(CUDA, or the extension not built).

- ``rms_norm``: RMSNorm, optionally with the residual add fused in (vLLM's
  fused_add_rms_norm).
- ``rope_and_cache``: neox RoPE in place on q and k, then k and v into the paged cache.
- ``silu_and_mul``: the SwiGLU of a fused gate/up projection.
- ``argmax``: greedy sampling's ``logits.argmax(dim=-1)``, the same indices.
- ``linear``: ``x @ W^T (+ b)``; at most ``GEMV_MAX_M`` rows go to a C GEMV that streams W.

A decoder calls these several times per layer, so the checks are kept to attribute reads.
Owns no state.
"""
from __future__ import annotations

import torch

from pipeline.layers import ops_ref
from pipeline.layers.int4 import PACKED, Int4Weight
from pipeline.layers.lowp import LowpWeight
from pipeline.layers.ops import _DTYPE_CODE, GEMV_MAX_M, _check_cache, _check_index, _check_rows, backend


def _rows2d(name: str, t: torch.Tensor, width: int) -> None:
    if t.dim() != 2 or t.shape[1] != width or t.stride(1) != 1 or t.dtype != torch.float32:
        raise ValueError(f"{name} must be a float32 [num_tokens, {width}] tensor with dense rows, "
                         f"got {t.dtype} shape {tuple(t.shape)} strides {t.stride()}")


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """``out = rms_norm(x [+ residual]) * weight`` over the last dim of a float32 x [T, H];
    with ``residual`` (same shape) the sum is stored back into it first, as vLLM's
    fused_add_rms_norm. ``out`` may be x itself."""
    hidden = weight.shape[0]
    _rows2d("x", x, hidden)
    if weight.dim() != 1 or not weight.is_contiguous() or weight.dtype != torch.float32:
        raise ValueError(f"weight must be a contiguous float32 [{hidden}] tensor")
    num_tokens = x.shape[0]
    if out is None:
        out = torch.empty((num_tokens, hidden), dtype=torch.float32, device=x.device)
    else:
        _rows2d("out", out, hidden)
    if residual is not None:
        _rows2d("residual", residual, hidden)
    for name, t in (("out", out), ("residual", residual), ("weight", weight)):
        if t is not None and (t.device != x.device or (t is not weight and t.shape[0] != num_tokens)):
            raise ValueError(f"{name} must be on {x.device} with {num_tokens} rows")
    if residual is not None and residual.data_ptr() == out.data_ptr():
        raise ValueError("out must not alias residual")
    ext = backend(x.device) if x.device.type == "cpu" else None
    if ext is None:
        return ops_ref.rms_norm(x, weight, eps, residual, out)
    ext.rms_norm(out.data_ptr(), x.data_ptr(), 0 if residual is None else residual.data_ptr(),
                 weight.data_ptr(), num_tokens, hidden, out.stride(0), x.stride(0),
                 0 if residual is None else residual.stride(0), float(eps))
    return out


def rope_and_cache(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
                   cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor,
                   v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Rotate float32 q [T, H, D] and k [T, Hkv, D] in place (neox RoPE at ``positions`` [T]
    int64, tables [max_positions, D] float32 as ``[c, c]`` / ``[-s, s]``), then write k and
    v [T, Hkv, D] to the cache slots ``slot_mapping`` (<0: skip), as reshape_and_cache."""
    _check_cache(k_cache, v_cache)
    num_blocks, block_size, num_kv_heads, head_dim = k_cache.shape
    num_tokens = q.shape[0]
    if q.dim() != 3 or q.shape[2] != head_dim or q.dtype != torch.float32 \
            or q.stride(2) != 1 or q.stride(1) != head_dim:
        raise ValueError(f"q must be float32 [num_tokens, num_heads, {head_dim}] with dense "
                         f"heads, got {q.dtype} shape {tuple(q.shape)} strides {q.stride()}")
    for name, t in (("k", k), ("v", v)):
        if t.dtype != torch.float32:
            raise TypeError(f"{name} must be float32, got {t.dtype}")
        _check_rows(name, t, num_kv_heads, head_dim, t)
        if t.shape[0] != num_tokens or t.device != q.device:
            raise ValueError(f"{name} must have {num_tokens} tokens on {q.device}")
    if head_dim % 2 or cos.shape != sin.shape or cos.dim() != 2 or cos.shape[1] != head_dim \
            or cos.dtype != torch.float32 or sin.dtype != torch.float32 \
            or not (cos.is_contiguous() and sin.is_contiguous()):
        raise ValueError(f"cos/sin must be contiguous float32 [max_positions, {head_dim}] tables "
                         f"(head_dim even), got {tuple(cos.shape)} / {tuple(sin.shape)}")
    _check_index("positions", positions, torch.int64, 1, q.device)
    _check_index("slot_mapping", slot_mapping, torch.int64, 1, k_cache.device)
    if positions.shape[0] != num_tokens or slot_mapping.shape[0] != num_tokens:
        raise ValueError(f"q has {num_tokens} tokens, positions {positions.shape[0]}, "
                         f"slot_mapping {slot_mapping.shape[0]}: they must match")
    if num_tokens == 0:
        return
    ext = backend(q.device) if q.device.type == "cpu" else None
    if ext is None:
        return ops_ref.rope_and_cache(q, k, v, positions, cos, sin, k_cache, v_cache, slot_mapping)
    bad = ext.rope_and_cache(
        q.data_ptr(), k.data_ptr(), v.data_ptr(), q.stride(0), k.stride(0), v.stride(0),
        positions.data_ptr(), cos.data_ptr(), sin.data_ptr(), cos.shape[0], k_cache.data_ptr(),
        v_cache.data_ptr(), slot_mapping.data_ptr(), num_tokens, q.shape[1], num_kv_heads,
        head_dim, num_blocks * block_size, _DTYPE_CODE[k_cache.dtype])
    if bad >= 0:
        raise ValueError(f"token {bad}: position {int(positions[bad])} must be in "
                         f"[0, {cos.shape[0]}) and slot {int(slot_mapping[bad])} below "
                         f"{num_blocks * block_size}")


def silu_and_mul(x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """``silu(x[:, :I]) * x[:, I:]`` for a float32 x [T, 2I] with dense rows -> [T, I]."""
    if x.dim() != 2 or x.shape[1] % 2 or x.stride(1) != 1 or x.dtype != torch.float32:
        raise ValueError(f"x must be a float32 [num_tokens, 2 * intermediate] tensor with dense "
                         f"rows, got {x.dtype} shape {tuple(x.shape)} strides {x.stride()}")
    num_tokens, inter = x.shape[0], x.shape[1] // 2
    if out is None:
        out = torch.empty((num_tokens, inter), dtype=torch.float32, device=x.device)
    elif out.shape != (num_tokens, inter) or out.dtype != torch.float32 \
            or not out.is_contiguous() or out.device != x.device:
        raise ValueError(f"out must be a contiguous float32 [{num_tokens}, {inter}] tensor on {x.device}")
    ext = backend(x.device) if x.device.type == "cpu" else None
    if ext is None:
        return ops_ref.silu_and_mul(x, out)
    ext.silu_and_mul(out.data_ptr(), x.data_ptr(), num_tokens, inter, x.stride(0))
    return out


def argmax(logits: torch.Tensor) -> torch.Tensor:
    """``logits.argmax(dim=-1)`` of a 2-D tensor, the same indices (the first maximum, or
    the first NaN); in C for float32 CPU rows, where torch's took 6 ms at batch 32 over a
    151936-token vocabulary (19 MB read at ~3 GB/s)."""
    ext = backend(logits.device) if logits.device.type == "cpu" else None
    if ext is None or logits.dim() != 2 or logits.dtype != torch.float32 or logits.stride(1) != 1 \
            or logits.shape[1] == 0:
        return logits.argmax(dim=-1)
    out = torch.empty(logits.shape[0], dtype=torch.int64)
    ext.argmax(out.data_ptr(), logits.data_ptr(), logits.shape[0], logits.shape[1], logits.stride(0))
    return out


def linear(x: torch.Tensor, weight: torch.Tensor | LowpWeight | Int4Weight, bias: torch.Tensor | None = None,
           kn: bool = False) -> torch.Tensor:
    """``x @ W^T + bias`` with W stored [out, in] (nn.Linear), or [in, out] when ``kn``, or
    packed as a ``LowpWeight`` (bf16/int8) or ``Int4Weight`` (float32 x and result).

    Float32 CPU products of at most ``GEMV_MAX_M`` rows (small-batch decode, where reading W
    is the whole cost) run the C kernel that streams W in memory order; everything else goes
    to torch (BLAS)."""
    if isinstance(weight, PACKED):
        return weight.linear(x, bias)
    m = x.shape[0] if x.dim() == 2 else -1
    if (0 < m <= GEMV_MAX_M and x.dtype == torch.float32 and weight.dtype == torch.float32
            and x.device.type == "cpu" and x.stride(1) == 1 and weight.is_contiguous()
            and weight.dim() == 2 and (bias is None or (bias.is_contiguous() and bias.dtype == torch.float32))):
        ext = backend(x.device)
        k, n = (weight.shape if kn else weight.shape[::-1])
        if ext is not None and x.shape[1] == k and (bias is None or bias.shape == (n,)):
            y = torch.empty((m, n), dtype=torch.float32)
            ext.gemv(y.data_ptr(), n, x.data_ptr(), x.stride(0), weight.data_ptr(),
                     0 if bias is None else bias.data_ptr(), m, k, n, kn)
            return y
    if not kn:
        return torch.nn.functional.linear(x, weight, bias)
    return torch.mm(x, weight) if bias is None else torch.addmm(bias, x, weight)

