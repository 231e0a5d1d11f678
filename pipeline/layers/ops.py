"""Layers: the KV-cache and attention ops the models call, dispatched by device.

CPU tensors go to ``pipeline._ext.cpu_ops`` (C over OpenMP, GIL released), CUDA tensors to
``pipeline._ext.cuda_ops`` (kernels launched on the current stream). When an extension is
not built the plain-torch versions in ``ops_ref`` run instead, after a one-time warning.
This module owns no state besides the cached extension handles and the last validated
attention metadata; it validates shapes, dtypes, devices and contiguity so the kernels can
trust raw pointers. Index values (slots, block ids, lengths) are checked by the CPU kernels,
which report the first bad one; on CUDA they are not (that would need a device sync): bad
slots are skipped there, other bad values give wrong results.

The CPU kernels run on the OpenMP pool torch uses (one libgomp per process), so
``torch.set_num_threads`` sizes both.

Layouts: ``k_cache``/``v_cache`` are ``[num_blocks, block_size, num_kv_heads, head_dim]``;
``q`` is ``[T, num_heads, head_dim]``, key/value ``[T, num_kv_heads, head_dim]`` (rows may be
strided, e.g. slices of a fused qkv projection; the last two dims must be dense).
"""
from __future__ import annotations

import importlib
import warnings
from types import ModuleType

import torch

from pipeline.layers import ops_ref

CACHE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_DTYPE_CODE = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
_ext: dict[str, ModuleType | None] = {}


def _load(name: str) -> ModuleType | None:
    if name not in _ext:
        try:
            _ext[name] = importlib.import_module(f"pipeline._ext.{name}")
        except ImportError as exc:
            warnings.warn(
                f"pipeline._ext.{name} is not built ({exc}); using the slow torch reference "
                "ops. Build it with `python setup.py build_ext --inplace`.",
                RuntimeWarning, stacklevel=3)
            _ext[name] = None
    return _ext[name]


# Rows up to which the C GEMVs run instead of a GEMM (pipeline._ext.cpu_ops.GEMV_MAX_M; a
# constant here keeps the callers' checks cheap).
GEMV_MAX_M = 8


def backend(device: torch.device) -> ModuleType | None:
    """The extension module serving ``device``, or None when only ops_ref is available."""
    if device.type == "cpu":
        return _load("cpu_ops")
    if device.type == "cuda":
        return _load("cuda_ops")
    raise ValueError(f"device {device}: only cpu and cuda are supported")


def _stream(device: torch.device) -> int:
    return torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else 0


def _check_cache(k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    if k_cache.dim() != 4:
        raise ValueError(f"k_cache must be [num_blocks, block_size, num_kv_heads, head_dim], "
                         f"got shape {tuple(k_cache.shape)}")
    if v_cache.shape != k_cache.shape:
        raise ValueError(f"v_cache shape {tuple(v_cache.shape)} != k_cache shape "
                         f"{tuple(k_cache.shape)}")
    if k_cache.dtype not in CACHE_DTYPES or v_cache.dtype != k_cache.dtype:
        raise TypeError(f"k_cache/v_cache dtype must be one of {CACHE_DTYPES} and equal, "
                        f"got {k_cache.dtype}/{v_cache.dtype}")
    if k_cache.device != v_cache.device:
        raise ValueError(f"k_cache on {k_cache.device} but v_cache on {v_cache.device}")
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("k_cache and v_cache must be contiguous")


def _check_rows(name: str, t: torch.Tensor, heads: int, head_dim: int,
                like: torch.Tensor) -> None:
    """``t`` is [T, heads, head_dim] on like's device/dtype with dense (heads, head_dim)."""
    if t.dim() != 3 or t.shape[1] != heads or t.shape[2] != head_dim:
        raise ValueError(f"{name} must be [num_tokens, {heads}, {head_dim}], "
                         f"got shape {tuple(t.shape)}")
    if t.dtype != like.dtype:
        raise TypeError(f"{name} dtype {t.dtype} must equal the cache dtype {like.dtype}")
    if t.device != like.device:
        raise ValueError(f"{name} is on {t.device} but the cache is on {like.device}")
    if t.stride(2) != 1 or t.stride(1) != head_dim or (t.shape[0] > 1 and t.stride(0) < 1):
        raise ValueError(f"{name} must have dense heads/head_dim (strides {t.stride()})")


def _check_index(name: str, t: torch.Tensor, dtype: torch.dtype, dims: int,
                 device: torch.device) -> None:
    if t.dtype != dtype or t.dim() != dims:
        raise TypeError(f"{name} must be a {dims}-d {dtype} tensor, "
                        f"got {t.dim()}-d {t.dtype}")
    if t.device != device:
        raise ValueError(f"{name} is on {t.device} but the cache is on {device}")
    if not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous")


# The last metadata triple that passed _check_metadata, with the tensors' version counters
# and device: every layer of a forward passes the same three tensors, so the checks run once
# per step. An in-place update bumps a version counter and forces a re-check.
_checked_meta: list = [None] * 7


def _check_metadata(cu_seqlens_q: torch.Tensor, seq_lens: torch.Tensor,
                    block_tables: torch.Tensor, device: torch.device) -> None:
    c = _checked_meta
    if (c[0] is cu_seqlens_q and c[1] is seq_lens and c[2] is block_tables
            and c[3] == cu_seqlens_q._version and c[4] == seq_lens._version
            and c[5] == block_tables._version and c[6] == device):
        return
    _check_index("cu_seqlens_q", cu_seqlens_q, torch.int32, 1, device)
    _check_index("seq_lens", seq_lens, torch.int32, 1, device)
    _check_index("block_tables", block_tables, torch.int32, 2, device)
    num_seqs = seq_lens.shape[0]
    if cu_seqlens_q.shape[0] != num_seqs + 1 or block_tables.shape[0] != num_seqs:
        raise ValueError(f"seq_lens has {num_seqs} sequences: cu_seqlens_q needs "
                         f"{num_seqs + 1} entries (got {cu_seqlens_q.shape[0]}) and "
                         f"block_tables {num_seqs} rows (got {block_tables.shape[0]})")
    c[:] = [cu_seqlens_q, seq_lens, block_tables, cu_seqlens_q._version,
            seq_lens._version, block_tables._version, device]


def reshape_and_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write key/value [T, Hkv, D] to cache slots ``slot_mapping`` [T] int64 (<0: skip)."""
    _check_cache(k_cache, v_cache)
    num_blocks, block_size, num_kv_heads, head_dim = k_cache.shape
    _check_rows("key", key, num_kv_heads, head_dim, k_cache)
    _check_rows("value", value, num_kv_heads, head_dim, k_cache)
    _check_index("slot_mapping", slot_mapping, torch.int64, 1, k_cache.device)
    num_tokens = key.shape[0]
    if value.shape[0] != num_tokens or slot_mapping.shape[0] != num_tokens:
        raise ValueError(f"key has {num_tokens} tokens, value {value.shape[0]}, "
                         f"slot_mapping {slot_mapping.shape[0]}: they must match")
    if num_tokens == 0:
        return
    ext = backend(k_cache.device)
    if ext is None:
        return ops_ref.reshape_and_cache(key, value, k_cache, v_cache, slot_mapping)
    bad = ext.reshape_and_cache(
        key.data_ptr(), value.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(),
        slot_mapping.data_ptr(), num_tokens, key.stride(0), value.stride(0),
        num_blocks, block_size, num_kv_heads, head_dim, _DTYPE_CODE[k_cache.dtype],
        _stream(k_cache.device))
    if bad >= 0:
        raise ValueError(f"slot_mapping[{bad}] = {int(slot_mapping[bad])} is out of range: "
                         f"the cache has {num_blocks * block_size} slots")


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
    """Causal attention of q [T, H, D] over paged contexts; returns out [T, H, D].

    Serves prefill with cached context, chunked prefill and decode in one batch. Softmax is
    online and accumulated in float32 whatever the cache dtype.
    """
    _check_cache(k_cache, v_cache)
    num_blocks, block_size, num_kv_heads, head_dim = k_cache.shape
    if q.dim() != 3 or q.shape[2] != head_dim or q.shape[1] % num_kv_heads != 0:
        raise ValueError(f"q must be [num_tokens, num_heads, {head_dim}] with num_heads a "
                         f"multiple of num_kv_heads={num_kv_heads}, got {tuple(q.shape)}")
    num_tokens, num_heads = q.shape[0], q.shape[1]
    device = k_cache.device
    # A float32 q over a half cache: CPU models with bf16/int8 weights keep float32 activations.
    q_f32 = q.dtype == torch.float32 and device.type == "cpu"
    _check_rows("q", q, num_heads, head_dim, q if q_f32 else k_cache)
    if q.device != device:
        raise ValueError(f"q is on {q.device} but the cache is on {device}")
    num_seqs = seq_lens.shape[0]
    _check_metadata(cu_seqlens_q, seq_lens, block_tables, device)
    if out is None:
        out = torch.empty((num_tokens, num_heads, head_dim), dtype=q.dtype, device=device)
    elif (out.shape != (num_tokens, num_heads, head_dim) or out.dtype != q.dtype
          or out.device != device or not out.is_contiguous()):
        raise ValueError(f"out must be a contiguous {q.dtype} tensor of shape "
                         f"{(num_tokens, num_heads, head_dim)} on {device}")
    if num_tokens == 0 or num_seqs == 0:
        return out
    ext = backend(device)
    if ext is None:
        return ops_ref.paged_attention(q, k_cache, v_cache, cu_seqlens_q, seq_lens,
                                       block_tables, scale, out)
    args = (out.data_ptr(), q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(),
            cu_seqlens_q.data_ptr(), seq_lens.data_ptr(), block_tables.data_ptr(),
            num_seqs, num_tokens, q.stride(0), num_heads, num_kv_heads, head_dim,
            num_blocks, block_size, block_tables.shape[1], float(scale),
            _DTYPE_CODE[k_cache.dtype])
    if device.type == "cuda":
        # Small decode batches split the context across thread blocks; the partial softmax
        # states live in a stream-ordered workspace from torch's caching allocator.
        splits = ext.attention_splits(num_tokens, num_heads, block_tables.shape[1] * block_size)
        workspace = (torch.empty(num_tokens * num_heads * splits * (head_dim + 2),
                                 dtype=torch.float32, device=device) if splits > 1 else None)
        ext.paged_attention(*args, _stream(device), splits,
                            workspace.data_ptr() if workspace is not None else 0)
        return out
    bad = ext.paged_attention(*args, 0, _DTYPE_CODE[q.dtype])
    if bad == -2:
        raise MemoryError("paged_attention: no memory for the per-call scratch buffers")
    if bad >= 0:
        raise ValueError(
            f"sequence {bad}: needs 0 <= q_len <= seq_len <= block_tables.shape[1] * "
            f"block_size = {block_tables.shape[1] * block_size}, cu_seqlens_q within "
            f"[0, {num_tokens}] and block ids below num_blocks = {num_blocks} "
            f"(q_len {int(cu_seqlens_q[bad + 1] - cu_seqlens_q[bad])}, "
            f"seq_len {int(seq_lens[bad])})")
    return out


def copy_blocks(
    k_caches: list[torch.Tensor], v_caches: list[torch.Tensor], pairs: torch.Tensor
) -> None:
    """In every layer copy block ``pairs[i, 0]`` to ``pairs[i, 1]`` (K and V)."""
    if len(k_caches) != len(v_caches) or not k_caches:
        raise ValueError(f"need one v_cache per k_cache and at least one layer, got "
                         f"{len(k_caches)} k_caches and {len(v_caches)} v_caches")
    for k_cache, v_cache in zip(k_caches, v_caches):
        _check_cache(k_cache, v_cache)
        if k_cache.shape != k_caches[0].shape or k_cache.dtype != k_caches[0].dtype \
                or k_cache.device != k_caches[0].device:
            raise ValueError("every layer's cache must share shape, dtype and device")
    device = k_caches[0].device
    _check_index("pairs", pairs, torch.int64, 2, device)
    if pairs.shape[1] != 2:
        raise ValueError(f"pairs must be [N, 2] (src, dst), got {tuple(pairs.shape)}")
    if pairs.shape[0] == 0:
        return
    ext = backend(device)
    if ext is None:
        return ops_ref.copy_blocks(k_caches, v_caches, pairs)
    num_blocks = k_caches[0].shape[0]
    block_bytes = k_caches[0][0].numel() * k_caches[0].element_size()
    ptrs = [t.data_ptr() for t in k_caches] + [t.data_ptr() for t in v_caches]
    bad = ext.copy_blocks(ptrs, pairs.data_ptr(), pairs.shape[0], num_blocks, block_bytes,
                          _stream(device))
    if bad >= 0:
        raise ValueError(f"pairs[{bad}] = {pairs[bad].tolist()}: block ids must be in "
                         f"[0, {num_blocks})")


def enqueue_layer_signal(signal_base: int, step: int, layer: int,
                         side_stream: torch.cuda.Stream) -> None:
    """CUDA: publish (step, layer) into the layer-signal segment mapped at ``signal_base``
    once everything enqueued so far on the current stream (the layer's KV write) is done.

    ``side_stream`` waits for the current stream, then a host function on it calls
    ``pipeline_signal_publish`` (no Python, no GIL). On CPU the worker publishes directly
    after the write instead.
    """
    if side_stream.device.type != "cuda":
        raise ValueError(f"side_stream must be a CUDA stream, got {side_stream.device}")
    ext = backend(side_stream.device)
    if ext is None:
        raise RuntimeError("the per-layer CUDA signal needs pipeline._ext.cuda_ops; "
                           "build it with nvcc present (python setup.py build_ext --inplace)")
    side_stream.wait_stream(torch.cuda.current_stream(side_stream.device))
    ext.enqueue_layer_signal(side_stream.cuda_stream, signal_base, step, layer)



def dtype_code(dtype: torch.dtype) -> int:
    """The kernels' element-type code of a cache dtype."""
    if dtype not in _DTYPE_CODE:
        raise TypeError(f"cache dtype must be one of {CACHE_DTYPES}, got {dtype}")
    return _DTYPE_CODE[dtype]
