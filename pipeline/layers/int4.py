"""Layers: CPU projections with group-wise 4-bit weights and float32 activations.

``Int4Weight`` replaces a float32 ``[out, in]`` projection weight (or the embedding table)
of a CPU model under ``--quantization int4``, or holds a GPTQ/AWQ checkpoint's weight
(``models.quantized``). A weight is ``W[n, k] = s[n, g] * (q[n, k] - z[n, g])`` with q in
0..15, g = k // group_size, s fp16 (the checkpoints' own type, so they load exactly) and z
an integer zero point (none: symmetric, z = 8). Quantised here at load (round to nearest):

- symmetric, as llama.cpp's Q4_0: s = m / -8 with m the group's value of largest magnitude,
  so that value lands exactly on -8 and all 16 levels are used;
- with zero points: s = (max - min) / 15 over the group's range widened to hold 0, z =
  round(-min / s), as GPTQ's round-to-nearest.

Packing (``pack_int4``) and the kernel: ``cpu_ops_gemv_q4.h``. ``linear`` runs rows in the C GEMV
(x quantised per token to int8, exact int32 sums per group) where ``cpu_ops.linear_route``
says so (up to 32 rows, any number on a core with AVX2 alone), else as int8 does: the weight
dequantised by all threads into the shared scratch of ``layers.lowp``, then one GEMM.
``perm`` (GPTQ act-order): packed input k is input ``perm[k]``; the GEMV gathers x by it, the
dequantised copy is in the original order.
Owns: the packed tensors of one projection (nibbles, scales, zero points, permutation).
"""
from __future__ import annotations

import torch
from torch import nn

from pipeline.config import INT4_GROUP_SIZES as GROUP_SIZES  # --quantization-group-size
from pipeline.layers.lowp import _DEQUANT_CODE, LowpWeight, _scratch
from pipeline.layers.lowp_pack import _PACK_CODE, _c_packer
from pipeline.layers.ops import backend

BLOCK = 16  # output channels per packed block (checkpoints' groups: any multiple of 8)
__all__ = ["GROUP_SIZES", "Int4Weight", "PACKED", "pack_int4", "quantize_int4", "unpack_int4"]


def quantize_int4(w: torch.Tensor, group_size: int, sym: bool
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Round-to-nearest 4-bit of a float ``[out, in]`` weight in groups of ``group_size``
    inputs (in padded with zeros to whole groups): (q uint8 [out, G * gs] in 0..15, scale
    fp16 [out, G], zero uint8 [out, G] or None when ``sym``)."""
    n, k = w.shape
    g = -(-k // group_size)
    wg = torch.zeros((n, g * group_size), dtype=torch.float32)
    wg[:, :k] = w.float()
    wg = wg.view(n, g, group_size)
    if sym:
        idx = wg.abs().argmax(dim=2, keepdim=True)
        scale = (wg.gather(2, idx) / -8.0).squeeze(2)
        zero = None
        z = torch.full_like(scale, 8.0)
    else:
        lo, hi = wg.amin(dim=2).clamp(max=0.0), wg.amax(dim=2).clamp(min=0.0)
        scale = (hi - lo) / 15.0
    scale = scale.to(torch.float16)
    s = scale.float()
    s = torch.where(s == 0, torch.ones_like(s), s)  # an all-zero group: q = z, W = 0
    if not sym:
        z = torch.round(-lo / s).clamp_(0, 15)
        zero = z.to(torch.uint8)
    q = torch.round(wg / s[:, :, None]).add_(z[:, :, None]).clamp_(0, 15).to(torch.uint8)
    return q.view(n, -1), scale, zero


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """uint8 ``[out, Kp]`` (0..15, Kp a multiple of 8) -> the kernel's blocks
    ``[ceil(out/16), Kp/8, 64]``: byte 4j + t of row i holds q[16b + j, 8i + t] (low nibble)
    and q[16b + j, 8i + 4 + t] (high), out padded with zeros."""
    n, kp = q.shape
    nb = -(-n // BLOCK)
    padded = torch.zeros((nb * BLOCK, kp), dtype=torch.uint8)
    padded[:n] = q
    v = padded.view(nb, BLOCK, kp // 8, 2, 4).permute(0, 2, 1, 3, 4)
    return (v[:, :, :, 0] | (v[:, :, :, 1] << 4)).reshape(nb, kp // 8, 64).contiguous()


def unpack_int4(packed: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """Rows ``rows`` of the q that ``pack_int4`` packed, as uint8 [len, Kp]."""
    b = packed.view(packed.shape[0], packed.shape[1], BLOCK, 4)[rows // BLOCK, :, rows % BLOCK]
    return torch.stack((b & 15, b >> 4), dim=2).reshape(rows.shape[0], -1)


def _blocks(t: torch.Tensor) -> torch.Tensor:
    """Per-group values ``[out, G]`` -> ``[ceil(out/16), G, 16]`` (zero-padded)."""
    n, g = t.shape
    nb = -(-n // BLOCK)
    padded = t.new_zeros((nb * BLOCK, g))
    padded[:n] = t
    return padded.view(nb, BLOCK, g).transpose(1, 2).contiguous()


def _unblock(t: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    return t[rows // BLOCK, :, rows % BLOCK]


class Int4Weight(nn.Module):
    """A projection weight ``[out, in]`` in group-wise 4 bits (see the module docstring)."""

    fmt = "int4"
    table_only = False

    def __init__(self, q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None,
                 group_size: int, in_features: int, gemm_dtype: torch.dtype,
                 perm: torch.Tensor | None = None) -> None:
        """q uint8 [out, G * group_size] (0..15), scale [out, G] (rounded to fp16), zero
        [out, G] or None (8), in packed input order: packed input k is input ``perm[k]``."""
        super().__init__()
        n, kp = q.shape
        if group_size <= 0 or group_size % 8 or kp % group_size or scale.shape != (n, kp // group_size) \
                or kp < in_features or kp - in_features >= group_size:
            raise ValueError(f"int4 weight: q {tuple(q.shape)}, scale {tuple(scale.shape)} do not fit "
                             f"{in_features} inputs in groups of {group_size} (a multiple of 8)")
        if perm is not None and perm.shape != (in_features,):
            raise ValueError(f"int4 weight: perm must have {in_features} entries, got {tuple(perm.shape)}")
        self._hold(pack_int4(q), _blocks(scale.to(torch.float16)),
                   None if zero is None else _blocks(zero.to(torch.uint8)),
                   None if perm is None else perm.to(torch.int32).contiguous(), n, in_features,
                   group_size, gemm_dtype)

    def _hold(self, packed: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None,
              perm: torch.Tensor | None, out_features: int, in_features: int, group_size: int,
              gemm_dtype: torch.dtype) -> None:
        """Keep the kernel's blocks (``pack_int4``, ``_blocks``) as the module's buffers."""
        self.out_features, self.in_features, self.group_size = out_features, in_features, group_size
        self.gemm_dtype = gemm_dtype
        self.weight: torch.Tensor
        self.scale: torch.Tensor
        self.zero: torch.Tensor | None
        self.perm: torch.Tensor | None
        self.register_buffer("weight", packed)
        self.register_buffer("scale", scale)
        self.register_buffer("zero", zero)
        self.register_buffer("perm", perm)

    @classmethod
    def from_float(cls, weight: torch.Tensor, group_size: int, gemm_dtype: torch.dtype,
                   sym: bool = True) -> Int4Weight:
        if weight.dim() != 2 or weight.device.type != "cpu":
            raise ValueError(f"an int4 weight must be a 2-D CPU tensor, got "
                             f"{tuple(weight.shape)} on {weight.device}")
        # No group wider than a row (rounded up to 8): padding would only cost bytes.
        group_size = min(group_size, -(-weight.shape[1] // 8) * 8)
        # One pass where the C ops are built, straight into the blocks (cpu_ops_pack_q4.h).
        packed_now = cls.from_parts([(0, weight)], weight.shape[0], group_size, gemm_dtype, sym)
        if packed_now is not None:
            return packed_now
        # In chunks of rows (~4 MB of float32 each; rows are independent, so the same q):
        # whole, a 151936 x 896 embedding's float32 temporaries peaked at 2.6 GB during load.
        rows = max(16, (1 << 20) // max(weight.shape[1], 1))
        parts = [quantize_int4(weight[i:i + rows], group_size, sym) for i in range(0, weight.shape[0], rows)]
        q = torch.cat([p[0] for p in parts])
        scale = torch.cat([p[1] for p in parts])
        zero = None if sym else torch.cat([p[2] for p in parts if p[2] is not None])
        del parts
        return cls(q, scale, zero, group_size, weight.shape[1], gemm_dtype)

    @classmethod
    def from_parts(cls, parts: list[tuple[int, torch.Tensor]], n: int, group_size: int,
                   gemm_dtype: torch.dtype, sym: bool = True) -> Int4Weight | None:
        """``from_float`` of an ``[n, k]`` weight given as row parts ``(lo, rows)`` (each ``lo``
        a multiple of 16, together every row once), each quantised straight to its blocks: no
        copy of the whole. None where the C packer is not built (the caller concatenates)."""
        k = parts[0][1].shape[1]
        ext = _c_packer(parts[0][1])
        if ext is None or any(_c_packer(t) is None or lo % BLOCK or t.shape[1] != k for lo, t in parts):
            return None
        group_size = min(group_size, -(-k // 8) * 8)  # as from_float
        nb, g = -(-n // BLOCK), -(-k // group_size)
        packed = torch.empty((nb, g * group_size // 8, 64), dtype=torch.uint8)
        scale = torch.empty((nb, g, BLOCK), dtype=torch.float16)
        zero = None if sym else torch.empty((nb, g, BLOCK), dtype=torch.uint8)
        for lo, t in parts:
            b = lo // BLOCK
            ext.pack_q4(packed[b].data_ptr(), scale[b].data_ptr(), 0 if zero is None else zero[b].data_ptr(),
                        t.data_ptr(), _PACK_CODE[t.dtype], t.shape[0], k, t.stride(0), group_size)
        self = cls.__new__(cls)
        nn.Module.__init__(self)
        self._hold(packed, scale, zero, None, n, k, group_size, gemm_dtype)
        return self

    def extra_repr(self) -> str:
        return (f"int4, out={self.out_features}, in={self.in_features}, group={self.group_size}, "
                f"{'sym' if self.zero is None else 'zero points'}{', act-order' if self.perm is not None else ''}")

    @property
    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self.buffers())

    @property
    def step_nbytes(self) -> int:
        """Bytes a GEMV step reads: all of it."""
        return self.nbytes

    def dequantize(self, rows: torch.Tensor) -> torch.Tensor:
        """Rows ``rows`` of W as float32 [len, in] (torch; the reference of the kernels)."""
        q = unpack_int4(self.weight, rows).float()
        s = _unblock(self.scale, rows).float().repeat_interleave(self.group_size, dim=1)
        z = 8.0 if self.zero is None else \
            _unblock(self.zero, rows).float().repeat_interleave(self.group_size, dim=1)
        w = ((q - z) * s)[:, :self.in_features]
        if self.perm is None:
            return w
        out = torch.empty_like(w)
        out[:, self.perm.long()] = w
        return out

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows ``ids`` as float32 (the embedding lookup of a tied or untied int4 table): in
        one C call where built (a dozen torch ops took ~0.35 ms of a 10-ms batch-1 token)."""
        flat = ids.reshape(-1)
        ext = backend(self.weight.device)
        if ext is None:
            return self.dequantize(flat).view(*ids.shape, self.in_features)
        flat = flat.to(torch.int64).contiguous()
        out = torch.empty((flat.shape[0], self.in_features), dtype=torch.float32)
        ext.dequant_q4(out.data_ptr(), _DEQUANT_CODE[torch.float32], *self._ptrs(), self.out_features,
                       self.in_features, self.group_size, flat.data_ptr(), flat.shape[0])
        return out.view(*ids.shape, self.in_features)

    def _ptrs(self) -> tuple[int, int, int, int]:
        return (self.weight.data_ptr(), self.scale.data_ptr(),
                0 if self.zero is None else self.zero.data_ptr(),
                0 if self.perm is None else self.perm.data_ptr())

    def dense(self, dtype: torch.dtype) -> torch.Tensor:
        """The whole weight ``[out, in]`` in ``dtype`` (float32 or bfloat16) in the shared
        scratch of ``layers.lowp``, valid until the next ``dense`` of any packed weight."""
        shape = (self.out_features, self.in_features)
        scratch = _scratch(dtype, shape[0] * shape[1]).view(shape)
        ext = backend(self.weight.device)
        if ext is None:
            return scratch.copy_(self.dequantize(torch.arange(self.out_features)))
        ext.dequant_q4(scratch.data_ptr(), _DEQUANT_CODE[dtype], *self._ptrs(),
                       self.out_features, self.in_features, self.group_size)
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
        if m > 0 and ext is not None and ext.linear_route("int4", m, k) == "gemv":
            ext.gemv_q4(out.data_ptr(), out.stride(0), x.data_ptr(), x.stride(0), *self._ptrs(),
                        0 if bias is None else bias.data_ptr(), m, k, n, self.group_size)
            return out
        if m == 0:
            return out
        w = self.dense(self.gemm_dtype)
        y = torch.mm(x.to(w.dtype), w.t())
        if bias is not None:
            y = y.float().add_(bias)
        out.copy_(y)
        return out


# The packed weight classes a CPU model may hold in place of a float32 projection.
PACKED = (LowpWeight, Int4Weight)
