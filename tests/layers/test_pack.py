"""The C packers of load time (cython_ext/cpu_ops_pack.h via layers/lowp.py ``pack_bf16`` and
``quantize_pack_int8``) against the torch path they replace: bit-identical blocks and
scales over shapes off the 16/32/4 multiples, float32/bfloat16/float16 sources, rows at a
stride, NaN, infinities, -0.0, denormals and values at rounding ties; and the in-place bf16
pack (``reuse``) the loader uses."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline.layers import ops
from pipeline.layers.lowp import LowpWeight
from pipeline.layers.lowp_pack import pack_bf16, pack_int8, quantize_int8, quantize_pack_int8

cpu_ops = ops.backend(torch.device("cpu"))
pytestmark = pytest.mark.skipif(cpu_ops is None or not hasattr(cpu_ops, "pack_bf16"),
                                reason="C CPU ops not built")
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# float32 bit patterns at the edges of bf16 rounding: exact ties (low half 0x8000) with an
# even and an odd kept part, one below / above a tie, the largest finite (rounds to inf),
# denormals, and the specials.
EDGES = [0x3F808000, 0x3F818000, 0x3F807FFF, 0x3F808001, 0x7F7FFFFF, 0x00000001, 0x807F8000,
         0x00018000, 0x7F800000, 0xFF800000, 0x80000000, 0x7FC00000, 0xFFC00001, 0x7F800001]


def _bf16_reference(w: torch.Tensor) -> torch.Tensor:
    """The torch packing: rounded by ``to``, zero-padded, 16-row blocks of 2-column pairs."""
    n, k = w.shape
    nb, kp = -(-n // 16), -(-k // 32) * 32
    padded = torch.zeros((nb * 16, kp), dtype=torch.bfloat16)
    padded[:n, :k] = w.to(torch.bfloat16)
    return padded.view(nb, 16, kp // 2, 2).permute(0, 2, 1, 3).contiguous()


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal bit for bit, except that a NaN only has to stay a NaN (torch's own NaN pattern
    differs between its vector and scalar conversions)."""
    ia, ib = a.view(torch.int16), b.view(torch.int16)
    return bool(((ia == ib) | (a.isnan() & b.isnan())).all())


def _weights(data: st.DataObject, n: int, k: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """[n, k] of ``dtype``, its rows at a stride when drawn so (every other row of a wider
    matrix), with edge values and whole special rows dropped in."""
    g = torch.Generator().manual_seed(seed)
    step, extra = data.draw(st.sampled_from([1, 2])), data.draw(st.sampled_from([0, 3]))
    base = torch.randn(n * step, k + extra, generator=g) * data.draw(st.sampled_from([1e-3, 1.0, 300.0]))
    edges = torch.tensor(EDGES, dtype=torch.int64).to(torch.int32).view(torch.float32)
    picks = data.draw(st.lists(st.tuples(st.integers(0, n * step - 1), st.integers(0, k - 1),
                                         st.integers(0, len(EDGES) - 1)), max_size=12))
    for r, c, e in picks:
        base[r, c] = edges[e]
    row = data.draw(st.integers(0, n * step - 1))
    base[row] = data.draw(st.sampled_from([0.0, -0.0, 1.0, float("nan")]))
    w = base.to(dtype)[::step, :k]
    assert w.shape == (n, k)
    return w


@settings(max_examples=150, deadline=None)
@given(n=st.integers(1, 50), k=st.integers(1, 140), dtype=st.sampled_from(DTYPES),
       seed=st.integers(0, 2**16), data=st.data())
def test_pack_bf16_is_the_torch_packing(n, k, dtype, seed, data):
    w = _weights(data, n, k, dtype, seed)
    assert _same_bits(pack_bf16(w), _bf16_reference(w))


@settings(max_examples=150, deadline=None)
@given(n=st.integers(1, 50), k=st.integers(1, 200), dtype=st.sampled_from(DTYPES),
       seed=st.integers(0, 2**16), data=st.data())
def test_quantize_pack_int8_is_the_torch_quantisation(n, k, dtype, seed, data):
    w = _weights(data, n, k, dtype, seed)
    q, scale = quantize_int8(w)
    packed, padded = quantize_pack_int8(w)
    assert torch.equal(packed, pack_int8(q))
    nb = -(-n // 16)
    assert padded.shape == (nb * 16,) and torch.equal(padded[n:], torch.ones(nb * 16 - n))
    assert torch.equal(padded[:n].view(torch.int32), scale.view(torch.int32))


def test_int8_ties_round_half_to_even():
    # amax 127 gives scale 1 exactly: x.5 values are ties, which torch.round sends to even.
    w = torch.tensor([[127.0, 2.5, -2.5, 3.5, -3.5, 0.5, -0.5, 126.5, -0.0]])
    packed, scale = quantize_pack_int8(w)
    assert scale[0] == 1.0
    assert packed[0, :, 0, :].reshape(-1)[:9].tolist() == [127, 2, -2, 4, -4, 0, 0, 126, 0]


@pytest.mark.parametrize("shape", [(16, 32), (48, 96), (4864, 896)])
def test_pack_bf16_in_place(shape):
    w = torch.randn(shape, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    w[3, 5] = float("nan")
    ref = _bf16_reference(w)
    buf = w.clone()
    packed = pack_bf16(buf, reuse=True)
    assert packed.data_ptr() == buf.data_ptr() and _same_bits(packed, ref)
    lw = LowpWeight(w.clone(), "bf16", torch.float32, reuse=True)
    assert _same_bits(lw.weight, ref)


def test_reuse_falls_back_to_a_new_buffer_where_blocks_do_not_fit():
    # 17 rows pad to 32: the packed copy is larger than w, so it cannot be w's memory.
    w = torch.randn(17, 40).to(torch.bfloat16)
    keep = w.clone()
    packed = pack_bf16(w, reuse=True)
    assert packed.data_ptr() != w.data_ptr() and torch.equal(w, keep)
    assert _same_bits(packed, _bf16_reference(keep))


def test_in_place_pack_rejects_what_does_not_fit():
    w = torch.zeros(17, 32, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="a multiple of 16 of them"):
        cpu_ops.pack_bf16(w.data_ptr(), w.data_ptr(), 1, 17, 32, 32)
    scale = torch.empty(32)
    with pytest.raises(ValueError, match="pack_i8 in place.*of 4 columns"):
        cpu_ops.pack_i8(w.data_ptr(), scale.data_ptr(), w.data_ptr(), 1, 16, 30, 32)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(16, 4), (64, 100), (4864, 896)])
def test_quantize_pack_int8_in_place(shape, dtype):
    # Waves of blocks (1, 1, 2, 4, ... over bf16) never write input a later block still reads.
    w = (torch.randn(shape, generator=torch.Generator().manual_seed(2)) * 3).to(dtype)
    q, scale = quantize_int8(w)
    buf = w.clone()
    packed, padded = quantize_pack_int8(buf, reuse=True)
    assert packed.data_ptr() == buf.data_ptr()
    assert torch.equal(packed, pack_int8(q)) and torch.equal(padded, scale)
    lw = LowpWeight(w.clone(), "int8", torch.float32, reuse=True)
    assert torch.equal(lw.weight, pack_int8(q)) and lw.nbytes == packed.numel() + 4 * shape[0]
