"""Layers: CPU projections with bfloat16 or int8 weights and float32 activations.

``LowpWeight`` replaces a float32 ``[out, in]`` projection weight (or the embedding table)
of a CPU model when the worker runs ``--dtype bfloat16`` or ``--quantization int8``:

- ``bf16``: the weight rounded to bfloat16.
- ``int8``: quantised per output channel (symmetric: ``scale = absmax / 127``, values in
  [-127, 127]), with each row's sum kept for the VNNI kernel. Per channel rather than per
  group of 32-128: the GEMV stays one int32 dot product per output (a group scale would cost
  a float conversion and FMA per group per output), and the perplexity tests
  (tests/test_lowp_quality.py) show the per-channel loss is within the issue's bounds.

``linear`` runs ``x @ W^T + b`` into float32: up to ``GEMV_MAX_M`` rows (decode) in the C
GEMVs of ``cpu_ops_gemv_lp.h``, which stream the 2- or 1-byte weights once (int8 also
quantises x per token there); more rows (prefill, large batches) in one GEMM: bf16 weights
multiply a bf16 copy of x through torch (oneDNN, AMX or AVX-512 BF16 where the CPU has them),
int8 weights are first dequantised by all threads into a scratch matrix (bf16 when the CPU
multiplies bf16 natively, float32 otherwise), which a GEMM then reads from cache. ``embed``
looks rows up for the embedding. Owns: the packed weight tensors of one projection; the module
owns the one scratch matrix per GEMM dtype that every LowpWeight dequantises into.
"""
from __future__ import annotations

import torch
from torch import nn

from pipeline.layers.ops import backend

FORMATS = ("bf16", "int8")
GEMV_MAX_M = 8  # pipeline._ext.cpu_ops.GEMV_MAX_M
_DEQUANT_CODE = {torch.float32: 0, torch.bfloat16: 1}


# One dense copy at a time (the worker runs one projection at a time): the largest weight's
# size per dtype, shared by every LowpWeight, so int8 keeps its memory saving and the copy
# stays warm in cache between projections.
_SCRATCH: dict[torch.dtype, torch.Tensor] = {}


def _scratch(dtype: torch.dtype, numel: int) -> torch.Tensor:
    buf = _SCRATCH.get(dtype)
    if buf is None or buf.numel() < numel:
        buf = _SCRATCH[dtype] = torch.empty(numel, dtype=dtype)
    return buf[:numel]


def quantize_int8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-output-channel symmetric int8 of a float ``[out, in]`` weight: (q int8 [out, in]
    in [-127, 127], scale float32 [out], row sums of q int32 [out]). An all-zero row gets
    scale 1 and zeros."""
    w = w.float()
    amax = w.abs().amax(dim=1)
    scale = torch.where(amax > 0, amax / 127.0, torch.ones_like(amax))
    q = torch.round(w / scale[:, None]).clamp_(-127, 127).to(torch.int8)
    return q, scale.contiguous(), q.sum(dim=1, dtype=torch.int32)


class LowpWeight(nn.Module):
    """A projection weight ``[out, in]`` packed as bf16 or int8 (see the module docstring)."""

    def __init__(self, weight: torch.Tensor, fmt: str, gemm_dtype: torch.dtype) -> None:
        super().__init__()
        if fmt not in FORMATS:
            raise ValueError(f"weight format must be one of {', '.join(FORMATS)}, got {fmt!r}")
        if weight.dim() != 2 or weight.device.type != "cpu":
            raise ValueError(f"a low-precision weight must be a 2-D CPU tensor, got "
                             f"{tuple(weight.shape)} on {weight.device}")
        self.fmt = fmt
        self.out_features, self.in_features = weight.shape
        # The dtype x (and a dequantised int8 weight) takes in a GEMM of more than GEMV_MAX_M rows.
        self.gemm_dtype = gemm_dtype
        if fmt == "bf16":
            weight, scale, qsum = weight.to(torch.bfloat16).contiguous(), None, None
        else:
            weight, scale, qsum = quantize_int8(weight)
        self.weight: torch.Tensor
        self.scale: torch.Tensor | None
        self.qsum: torch.Tensor | None
        self.register_buffer("weight", weight)
        self.register_buffer("scale", scale)  # None: not a buffer (bf16)
        self.register_buffer("qsum", qsum)

    def extra_repr(self) -> str:
        return f"{self.fmt}, out={self.out_features}, in={self.in_features}"

    @property
    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self.buffers())

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows ``ids`` as float32 (the embedding lookup of a tied or packed table)."""
        rows = self.weight[ids].float()
        return rows if self.scale is None else rows.mul_(self.scale[ids, None])

    def dense(self, dtype: torch.dtype) -> torch.Tensor:
        """The whole weight ``[out, in]`` in ``dtype`` (float32 or bfloat16): a bf16 weight
        itself, else the shared scratch, valid until the next ``dense`` of any LowpWeight."""
        if self.fmt == "bf16" and dtype == torch.bfloat16:
            return self.weight
        scratch = _scratch(dtype, self.weight.numel()).view(self.weight.shape)
        if self.fmt == "bf16":  # a CPU without native bf16 GEMMs: float32 for BLAS
            return scratch.copy_(self.weight)
        assert self.scale is not None
        ext = backend(self.weight.device)
        if ext is None:
            return scratch.copy_(self.weight.float() * self.scale[:, None])
        ext.dequant_i8(scratch.data_ptr(), _DEQUANT_CODE[dtype], self.weight.data_ptr(),
                       self.scale.data_ptr(), self.out_features, self.in_features)
        return scratch

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None = None,
               out: torch.Tensor | None = None) -> torch.Tensor:
        """float32 ``x [M, in] @ W^T (+ bias)`` -> ``out`` (float32 [M, out], dense rows)."""
        m, n, k = x.shape[0], self.out_features, self.in_features
        if x.dim() != 2 or x.shape[1] != k or x.dtype != torch.float32 or x.stride(1) != 1:
            raise ValueError(f"x must be float32 [num_tokens, {k}] with dense rows, got "
                             f"{x.dtype} {tuple(x.shape)}")
        if bias is not None and (bias.shape != (n,) or bias.dtype != torch.float32
                                 or not bias.is_contiguous()):
            raise ValueError(f"bias must be a contiguous float32 [{n}] tensor")
        if out is None:
            out = torch.empty((m, n), dtype=torch.float32)
        elif out.shape != (m, n) or out.dtype != torch.float32 or out.stride(1) != 1:
            raise ValueError(f"out must be float32 [{m}, {n}] with dense rows")
        ext = backend(x.device)
        if 0 < m <= GEMV_MAX_M and ext is not None:
            b = 0 if bias is None else bias.data_ptr()
            if self.fmt == "bf16":
                ext.gemv_bf16(out.data_ptr(), out.stride(0), x.data_ptr(), x.stride(0),
                              self.weight.data_ptr(), b, m, k, n)
            else:
                assert self.scale is not None and self.qsum is not None
                ext.gemv_i8(out.data_ptr(), out.stride(0), x.data_ptr(), x.stride(0),
                            self.weight.data_ptr(), self.scale.data_ptr(),
                            self.qsum.data_ptr(), b, m, k, n)
            return out
        if m == 0:
            return out
        w = self.dense(self.gemm_dtype)
        y = torch.mm(x.to(w.dtype), w.t())
        if bias is not None:
            y = y.float().add_(bias)
        out.copy_(y)
        return out
