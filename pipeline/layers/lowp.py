"""Layers: CPU projections with bfloat16 or int8 weights and float32 activations.

``LowpWeight`` replaces a float32 ``[out, in]`` projection weight (or the embedding table)
of a CPU model when the worker runs ``--dtype bfloat16`` or ``--quantization int8``:

- ``bf16``: the weight rounded to bfloat16.
- ``int8``: quantised per output channel (symmetric: ``scale = absmax / 127``, values in
  [-127, 127]), packed in blocks of 16 channels (``pack_int8``) for the kernel. Per channel rather than per
  group of 32-128: the GEMV stays one int32 dot product per output (a group scale would cost
  a float conversion and FMA per group per output), and the perplexity tests
  (tests/layers/test_lowp_quality.py) show the per-channel loss is within the issue's bounds.

Both are packed in blocks of 16 output channels, in the VNNI layout of an AMX B tile: bf16
``[N/16][Kp/2][16][2]`` (``pack_bf16``; Kp = K rounded up to 32), int8 ``[N/16][K/4][16][4]``.
Packing (``lowp_pack``) is one C pass over the float weight where the C ops are built
(cpu_ops_pack.h, also in place over a loader's read buffer: ``reuse``), bit-identical to the
torch path kept for other builds (tests/layers/test_pack.py).
That one copy serves every product and the lookups: ``linear`` runs ``x @ W^T + b`` into
float32, one row (batch-1 decode) in the C GEMVs of ``cpu_ops_gemv_lp.h`` /
``cpu_ops_gemv_i8.h``, which stream each 16-channel block once (int8 also quantises x per
token there); more rows (batches, prefill) on AMX tiles (``cpu_ops_amx_gemm.h``: bf16 x rounded
once, int8 x quantised per token, exact int32 sums; the thresholds are measured there).
Without AMX, bf16 keeps the VDPBF16PS kernel for any rows where the CPU has AVX-512 BF16 and
int8 its GEMV up to 32 rows; beyond (or for int8 of a depth the AMX kernel does not take)
the weight is dequantised by all threads into a scratch matrix that a BLAS GEMM then reads
(bf16 when the CPU multiplies bf16 natively, float32 otherwise). ``embed`` gathers rows out
of the blocks for the embedding lookup (an untied table stays row-major). A bf16 weight holds
2 bytes per parameter (plus the padding of N to 16 and K to 32), one copy.
Owns: the packed weight tensors of one projection; the module
owns the one scratch matrix per GEMM dtype that every LowpWeight dequantises into.
"""
from __future__ import annotations

import torch
from torch import nn

from pipeline.layers.lowp_pack import _c_packer, pack_bf16, packed_shape, quantize_int8, quantize_pack_int8, unpack_rows
from pipeline.layers.ops import backend

FORMATS = ("bf16", "int8")
_DEQUANT_CODE = {torch.float32: 0, torch.bfloat16: 1}


# One dense copy at a time (the worker runs one projection at a time): the largest weight's
# size per dtype, shared by every LowpWeight, so int8 keeps its memory saving and the copy
# stays warm in cache between projections.
_SCRATCH: dict[torch.dtype, torch.Tensor] = {}


def _scratch(dtype: torch.dtype, numel: int) -> torch.Tensor:
    buf = _SCRATCH.get(dtype)
    if buf is None or buf.numel() < numel:
        # A normal tensor even when first made inside inference_mode: it is written in and
        # out of it (an inference tensor cannot be written outside).
        with torch.inference_mode(False):
            buf = _SCRATCH[dtype] = torch.empty(numel, dtype=dtype)
    return buf[:numel]


def mlp_bf16(x: torch.Tensor, gate_up: LowpWeight, down: LowpWeight, out: torch.Tensor) -> bool:
    """``out = down(silu(x @ gate^T) * (x @ up^T))`` for bf16 packed weights without biases,
    in one C call whose SwiGLU writes the down product's bf16 input tiles (cpu_ops_amx_gemm.h):
    the same floats as ``swiglu`` then ``down.linear``. False, nothing written, where that
    kernel does not run (few rows, no AMX, another format)."""
    ext = backend(x.device)
    k, inter = gate_up.in_features, gate_up.out_features // 2
    if ext is None or gate_up.fmt != "bf16" or down.fmt != "bf16" or gate_up.table_only \
            or down.table_only or gate_up.out_features % 2 or (down.out_features, down.in_features) != (k, inter):
        return False
    m = x.shape[0]
    if x.dtype != torch.float32 or x.shape != (m, k) or x.stride(1) != 1 \
            or out.dtype != torch.float32 or out.shape != (m, k) or out.stride(1) != 1:
        raise ValueError(f"mlp_bf16: x and out must be float32 [{m}, {k}] with dense rows; got "
                         f"{tuple(x.shape)} and {tuple(out.shape)}")
    return bool(ext.mlp_bf16(out.data_ptr(), out.stride(0), x.data_ptr(), x.stride(0),
                             gate_up.weight.data_ptr(), down.weight.data_ptr(), m, k, inter))


class LowpWeight(nn.Module):
    """A projection weight ``[out, in]`` packed as bf16 or int8 (see the module docstring)."""

    def __init__(self, weight: torch.Tensor, fmt: str, gemm_dtype: torch.dtype,
                 table_only: bool = False, reuse: bool = False, out: torch.Tensor | None = None) -> None:
        """``reuse``: ``weight``'s memory may hold the packed copy (``pack_bf16``): the
        loader passes the buffer it read, which nothing else holds. ``out``: memory for the
        packed copy instead (``packed_shape``; not with ``table_only``)."""
        super().__init__()
        if fmt not in FORMATS:
            raise ValueError(f"weight format must be one of {', '.join(FORMATS)}, got {fmt!r}")
        if weight.dim() != 2 or weight.device.type != "cpu":
            raise ValueError(f"a low-precision weight must be a 2-D CPU tensor, got "
                             f"{tuple(weight.shape)} on {weight.device}")
        n, k = weight.shape
        scale: torch.Tensor | None = None
        if fmt == "bf16":  # rounded to bf16 by the packing itself (no bf16 copy first)
            weight = weight.to(torch.bfloat16).contiguous() if table_only else pack_bf16(weight, reuse, out)
        elif table_only:
            weight, scale = quantize_int8(weight)
        else:  # packed in blocks of 16 channels; scale padded to match
            weight, scale = quantize_pack_int8(weight, reuse, out)
        self._hold(weight, scale, fmt, n, k, gemm_dtype, table_only)

    def _hold(self, weight: torch.Tensor, scale: torch.Tensor | None, fmt: str, n: int, k: int,
              gemm_dtype: torch.dtype, table_only: bool) -> None:
        self.fmt = fmt
        # An untied embedding is only looked up: its rows stay [out, in], not in kernel blocks.
        self.table_only = table_only
        self.out_features, self.in_features = n, k
        # The dtype x (and a dequantised int8 weight) takes in a GEMM of more than GEMV_MAX_M rows.
        self.gemm_dtype = gemm_dtype
        self.weight: torch.Tensor
        self.scale: torch.Tensor | None
        self.register_buffer("weight", weight)
        self.register_buffer("scale", scale)  # None: not a buffer (bf16)

    @classmethod
    def from_parts(cls, parts: list[tuple[int, torch.Tensor]], n: int, fmt: str, gemm_dtype: torch.dtype,
                   out: torch.Tensor | None = None) -> LowpWeight | None:
        """An ``[n, k]`` weight given as row parts ``(lo, rows)`` (each ``lo`` a multiple of 16,
        together every row once: a fused q/k/v or gate/up read as its checkpoint tensors), each
        packed straight to its blocks of ``out`` (``packed_shape``, or new memory): no copy of
        the whole. None where the C packer is not built (the caller concatenates)."""
        k = parts[0][1].shape[1]
        if fmt not in FORMATS or any(_c_packer(t) is None or lo % 16 or t.shape[1] != k for lo, t in parts):
            return None
        shape, dtype = packed_shape(fmt, n, k)
        out = torch.empty(shape, dtype=dtype) if out is None else out
        scale = torch.empty(shape[0] * 16, dtype=torch.float32) if fmt == "int8" else None
        for lo, t in parts:
            blocks = out[lo // 16:lo // 16 + -(-t.shape[0] // 16)]
            if scale is None:
                pack_bf16(t, out=blocks)
            else:
                _, s = quantize_pack_int8(t, out=blocks)
                scale[lo:lo + s.shape[0]] = s
        self = cls.__new__(cls)
        nn.Module.__init__(self)
        self._hold(out, scale, fmt, n, k, gemm_dtype, False)
        return self

    def extra_repr(self) -> str:
        return f"{self.fmt}, out={self.out_features}, in={self.in_features}"

    @property
    def nbytes(self) -> int:
        """Memory held: the packed weight and its scales."""
        return sum(b.numel() * b.element_size() for b in self.buffers())

    @property
    def step_nbytes(self) -> int:
        """Bytes a small-batch (GEMV) step reads: the weight and its scales."""
        return self.nbytes

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows ``ids`` as float32 (the embedding lookup of a tied or packed table); a packed
        table's in one C call where built (the torch ops took 0.1-0.2 ms of a batch-1 token)."""
        ext = backend(self.weight.device)
        if ext is None or self.table_only:
            rows = self.weight[ids] if self.table_only else unpack_rows(self.weight, ids, self.in_features)
            return rows.float() if self.scale is None else rows.float().mul_(self.scale[ids, None])
        flat = ids.reshape(-1).to(torch.int64).contiguous()
        out = torch.empty((flat.shape[0], self.in_features), dtype=torch.float32)
        ext.unpack_rows(out.data_ptr(), self.weight.data_ptr(), 0 if self.scale is None else self.scale.data_ptr(),
                        self.out_features, self.in_features, self.weight.shape[1], flat.data_ptr(), flat.shape[0])
        return out.view(*ids.shape, self.in_features)

    def dense(self, dtype: torch.dtype) -> torch.Tensor:
        """The whole weight ``[out, in]`` in ``dtype`` (float32 or bfloat16) in the shared
        scratch, valid until the next ``dense`` of any LowpWeight."""
        shape = (self.out_features, self.in_features)
        scratch = _scratch(dtype, shape[0] * shape[1]).view(shape)
        rows = torch.arange(self.out_features)
        if self.fmt == "bf16":  # a CPU without AVX-512 BF16: unpacked for BLAS
            return scratch.copy_(self.weight if self.table_only else
                                 unpack_rows(self.weight, rows, self.in_features))
        assert self.scale is not None
        ext = backend(self.weight.device)
        if ext is None:
            return scratch.copy_(unpack_rows(self.weight, rows, self.in_features).float()
                                 * self.scale[:self.out_features, None])
        ext.dequant_i8(scratch.data_ptr(), _DEQUANT_CODE[dtype], self.weight.data_ptr(),
                       self.scale.data_ptr(), self.out_features, self.in_features)
        return scratch

    def swiglu(self, x: torch.Tensor, out: torch.Tensor) -> bool:
        """For a gate_up weight (``inter`` gate rows, then ``inter`` up rows): ``out [M,
        inter] = silu(x @ gate^T) * (x @ up^T)`` in one C call that never writes gate_up
        (cpu_ops_amx_gemm.h). False, nothing written, where that kernel does not run (few rows, no
        AMX): the caller runs ``linear`` and ``silu_and_mul``, which give the same floats."""
        ext = backend(x.device)
        if ext is None or self.table_only or self.out_features % 2:
            return False
        m, k, inter = x.shape[0], self.in_features, self.out_features // 2
        if x.dtype != torch.float32 or x.shape != (m, k) or x.stride(1) != 1 \
                or out.dtype != torch.float32 or out.shape != (m, inter) or out.stride(1) != 1:
            raise ValueError(f"swiglu: x must be float32 [{m}, {k}] and out float32 [{m}, {inter}], "
                             f"both with dense rows; got {tuple(x.shape)} and {tuple(out.shape)}")
        scale = 0 if self.scale is None else self.scale.data_ptr()
        return bool(ext.swiglu(out.data_ptr(), out.stride(0), x.data_ptr(), x.stride(0),
                               self.weight.data_ptr(), scale, m, k, inter))

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None = None,
               out: torch.Tensor | None = None) -> torch.Tensor:
        """float32 ``x [M, in] @ W^T (+ bias)`` -> ``out`` (float32 [M, out], dense rows)."""
        m, n, k = x.shape[0], self.out_features, self.in_features
        if self.table_only:
            raise ValueError("an embedding packed for lookups only has no linear()")
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
        if m == 0:
            return out
        ext = backend(x.device)
        if ext is not None:  # the GEMV or AMX tiles by the number of rows (cpu_ops_amx_gemm.h)
            args = (out.data_ptr(), out.stride(0), x.data_ptr(), x.stride(0), self.weight.data_ptr())
            b = 0 if bias is None else bias.data_ptr()
            if self.fmt == "bf16" and ext.linear_bf16(*args, b, m, k, n):
                return out
            if self.scale is not None and ext.linear_i8(*args, self.scale.data_ptr(), b, m, k, n):
                return out
        w = self.dense(self.gemm_dtype)
        y = torch.mm(x.to(w.dtype), w.t())
        if bias is not None:
            y = y.float().add_(bias)
        out.copy_(y)
        return out
