"""Layers: a decoder layer's elementwise steps as one CUDA kernel each (half types).

Residual add + RMSNorm, SiLU(gate) * up and rotary embedding in place
(``pipeline._ext.cuda_ops``, cuda_ops/fused.cu), each rounding where torch's chain of ops
rounds, so a layer gives what its per-op form gives. Used by models/llama.py where
``enabled`` says so: a CUDA tensor in bf16/fp16 with the CUDA ops built; float32 and the CPU
keep their own paths. Owns nothing.
"""
from __future__ import annotations

import torch

from pipeline.layers import ops
from pipeline.layers.norm import RMSNorm

_HALF = (torch.bfloat16, torch.float16)


def enabled(x: torch.Tensor) -> bool:
    return x.device.type == "cuda" and x.dtype in _HALF and ops.backend(x.device) is not None


def _ext(x: torch.Tensor):
    ext = ops.backend(x.device)
    assert ext is not None, "enabled() first"
    return ext, torch.cuda.current_stream(x.device).cuda_stream


def add_rms_norm(x: torch.Tensor, add: torch.Tensor | None, norm: RMSNorm) -> torch.Tensor:
    """x += add (in place; none when add is None), then norm(x) as RMSNorm.forward gives it.
    x and add: contiguous [rows, dim] of one half dtype, as norm's weight."""
    ext, stream = _ext(x)
    dim = x.shape[-1]
    if (not x.is_contiguous() or norm.weight.dtype != x.dtype or norm.weight.shape != (dim,)
            or (add is not None and (add.shape != x.shape or add.dtype != x.dtype or not add.is_contiguous()))):
        raise ValueError(f"add_rms_norm: x {tuple(x.shape)} {x.dtype}, add "
                         f"{None if add is None else (tuple(add.shape), add.dtype)}, weight "
                         f"{tuple(norm.weight.shape)} {norm.weight.dtype}: contiguous, one dtype, weight [dim]")
    h = torch.empty_like(x)
    ext.add_rms_norm(x.data_ptr(), add.data_ptr() if add is not None else 0, h.data_ptr(),
                     norm.weight.data_ptr(), x.numel() // dim, dim, norm.eps, ops.dtype_code(x.dtype), stream)
    return h


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate_up[:, :I]) * gate_up[:, I:] for a contiguous [rows, 2I]."""
    ext, stream = _ext(gate_up)
    rows, two_i = gate_up.shape
    if not gate_up.is_contiguous() or two_i % 2:
        raise ValueError(f"silu_mul: gate_up must be a contiguous [rows, 2 * inter], got {tuple(gate_up.shape)}")
    out = torch.empty((rows, two_i // 2), dtype=gate_up.dtype, device=gate_up.device)
    ext.silu_mul(out.data_ptr(), gate_up.data_ptr(), rows, two_i // 2, ops.dtype_code(gate_up.dtype), stream)
    return out


def rotary_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RotaryEmbedding.apply in place on x [tokens, heads, head_dim] (rows may be strided, the
    last two dims packed), with the tables of RotaryEmbedding.table ([tokens, 1, head_dim])."""
    ext, stream = _ext(x)
    t, heads, d = x.shape
    if (x.stride(2) != 1 or x.stride(1) != d or cos.dtype != x.dtype or sin.dtype != x.dtype
            or cos.shape != (t, 1, d) or sin.shape != (t, 1, d) or not cos.is_contiguous() or not sin.is_contiguous()):
        raise ValueError(f"rotary_: x {tuple(x.shape)} strides {x.stride()}, tables "
                         f"{tuple(cos.shape)} {cos.dtype}: need packed heads and contiguous [tokens, 1, head_dim]")
    ext.rotary(x.data_ptr(), cos.data_ptr(), sin.data_ptr(), t, heads, d, x.stride(0),
               ops.dtype_code(x.dtype), stream)
    return x
