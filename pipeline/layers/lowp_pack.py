"""Layers: packing a float ``[out, in]`` weight into the blocks of 16 output channels that the
bf16 and int8 CPU kernels read (``lowp.LowpWeight`` holds the result; layout in its module
docstring): bf16 ``[N/16][Kp/2][16][2]``, int8 ``[N/16][K/4][16][4]`` with per-channel
scales. One C pass where the C ops are built (``cpu_ops_pack.h``), in place over a buffer
the caller gives up (``reuse``) or into memory it provides (``out``); the torch path beside it
for other builds is the reference, bit for bit (tests/layers/test_pack.py). Owns no state.
"""
from __future__ import annotations

from types import ModuleType

import torch

from pipeline.layers.ops import backend

_PACK_CODE = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}  # cpu_ops_dtype.h


def quantize_int8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-output-channel symmetric int8 of a float ``[out, in]`` weight: (q int8 [out, in]
    in [-127, 127], scale float32 [out]). An all-zero row gets scale 1 and zeros."""
    # Rows in chunks of ~4 MB of float32, so every pass stays in cache (whole-matrix
    # temporaries made loading 3x slower); the same float32 max, division and rounding.
    n, k = w.shape
    rows = max(1, (1 << 20) // max(k, 1))
    q = torch.empty((n, k), dtype=torch.int8)
    scale = torch.empty(n, dtype=torch.float32)
    tmp = torch.empty((min(rows, n), k), dtype=torch.float32)
    for r in range(0, n, rows):
        t = tmp[:min(n, r + rows) - r].copy_(w[r:r + rows])
        amax = torch.maximum(t.amax(dim=1), t.amin(dim=1).neg())
        s = scale[r:r + rows].copy_(torch.where(amax > 0, amax / 127.0, torch.ones_like(amax)))
        t.div_(s[:, None]).round_().clamp_(-127, 127)
        q[r:r + rows].copy_(t)
    return q, scale.contiguous()


def pack_int8(q: torch.Tensor) -> torch.Tensor:
    """int8 ``[out, in]`` -> the kernels' blocks ``[ceil(out/16), ceil(in/4), 16, 4]``
    (cpu_ops_gemv_i8.h: 4 inputs of 16 outputs per 64 bytes), zero-padded."""
    n, k = q.shape
    nb, k4 = -(-n // 16), -(-k // 4)
    if (n, k) != (nb * 16, k4 * 4) or not q.is_contiguous():
        padded = torch.zeros((nb * 16, k4 * 4), dtype=torch.int8)
        padded[:n, :k] = q
        q = padded
    # Moved as int32 (4 inputs at once): a byte-wise permute took a third of an int8 load.
    return (q.view(torch.int32).view(nb, 16, k4).permute(0, 2, 1).contiguous()
            .view(torch.int8).view(nb, k4, 16, 4))


def _pad(t: torch.Tensor, n: int, value: float | int) -> torch.Tensor:
    return torch.cat([t, t.new_full((n - t.shape[0],), value)]) if n > t.shape[0] else t


def _c_packer(w: torch.Tensor) -> ModuleType | None:
    """The C ops when they can pack ``w`` in one pass (cpu_ops_pack.h), else None."""
    if w.device.type != "cpu" or w.dtype not in _PACK_CODE or w.dim() != 2 \
            or (w.stride(1) != 1 and w.shape[1] > 1):
        return None
    return backend(w.device)


def packed_shape(fmt: str, n: int, k: int) -> tuple[tuple[int, ...], torch.dtype]:
    """Shape and dtype of an ``[n, k]`` weight packed as ``fmt`` ("bf16" / "int8"): what ``out``
    of ``pack_bf16`` / ``quantize_pack_int8`` must be."""
    nb = -(-n // 16)
    if fmt == "bf16":
        return (nb, -(-k // 32) * 16, 16, 2), torch.bfloat16
    return (nb, -(-k // 4), 16, 4), torch.int8


def quantize_pack_int8(w: torch.Tensor, reuse: bool = False,
                       out: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``pack_int8(quantize_int8(w)[0])`` and the scale padded with 1 to its rows, in one pass
    over ``w`` where the C ops are built (no int8 or float32 copy of the matrix). ``reuse``:
    ``w``'s memory may hold the result (``w`` is then overwritten, the bytes past the result
    given back to the system), which a dense ``w`` of 16-row blocks and 4-column rows allows."""
    n, k = w.shape
    nb, k4 = -(-n // 16), -(-k // 4)
    ext = _c_packer(w)
    if ext is None:
        q, scale = quantize_int8(w)
        return pack_int8(q), _pad(scale, nb * 16, 1.0).contiguous()
    inplace = out is None and reuse and (n, k) == (nb * 16, k4 * 4) and w.is_contiguous()
    if out is None:
        out = (w.view(-1).view(torch.int8)[:n * k] if inplace
               else torch.empty(nb * k4 * 64, dtype=torch.int8))
    scale = torch.empty(nb * 16, dtype=torch.float32)
    ext.pack_i8(out.data_ptr(), scale.data_ptr(), w.data_ptr(), _PACK_CODE[w.dtype], n, k, w.stride(0))
    return out.view(nb, k4, 16, 4), scale


def pack_bf16(w: torch.Tensor, reuse: bool = False, out: torch.Tensor | None = None) -> torch.Tensor:
    """float ``[out, in]`` rounded to bf16 (as ``w.to(torch.bfloat16)``) -> the kernels'
    blocks ``[ceil(out/16), kp/2, 16, 2]`` (kp: in rounded up to 32; cpu_ops_gemv_lp.h: 2
    inputs of 16 outputs per 64 bytes), zero-padded; one pass in C where it is built.
    ``reuse``: ``w``'s memory may become the result (``w`` is then overwritten), which a dense
    bf16 ``w`` of 16-row blocks and 32-column rows allows: no new memory to fault in. ``out``:
    memory for the result (``packed_shape``), given by a loader that faulted it in already."""
    n, k = w.shape
    nb, kp = -(-n // 16), -(-k // 32) * 32
    ext = _c_packer(w)
    if ext is not None:
        inplace = out is None and reuse and w.dtype == torch.bfloat16 and (n, k) == (nb * 16, kp) \
            and w.is_contiguous()
        if out is None:
            out = w if inplace else torch.empty((nb, kp // 2, 16, 2), dtype=torch.bfloat16)
        ext.pack_bf16(out.data_ptr(), w.data_ptr(), _PACK_CODE[w.dtype], n, k, w.stride(0))
        return out.view(nb, kp // 2, 16, 2)
    padded = torch.zeros((nb * 16, kp), dtype=torch.bfloat16)
    padded[:n, :k] = w
    return padded.view(nb, 16, kp // 2, 2).permute(0, 2, 1, 3).contiguous()


def unpack_rows(packed: torch.Tensor, rows: torch.Tensor, k: int) -> torch.Tensor:
    """Rows ``rows`` of the ``[out, in]`` matrix that ``pack_int8`` or ``pack_bf16`` packed,
    in its dtype, [len, k]."""
    return packed[rows // 16, :, rows % 16, :].reshape(rows.shape[0], -1)[:, :k]


unpack_int8 = unpack_rows
