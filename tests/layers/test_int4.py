"""Group-wise 4-bit CPU weights (layers/int4.py, cython_ext/cpu_ops_gemv_q4.h): the GEMV on
every ISA path the CPU has against an exact float64 reference of its integer arithmetic,
the paths bit-identical to each other, the quantiser's round trip, packing, the dequantised
copy and the embedding lookup, act-order permutations, and the GEMM path for large batches."""
from __future__ import annotations

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from pipeline.layers import ops
from pipeline.layers.int4 import Int4Weight, pack_int4, quantize_int4, unpack_int4

cpu_ops = ops.backend(torch.device("cpu"))
pytestmark = pytest.mark.skipif(cpu_ops is None, reason="C CPU ops not built")
ISAS = ("avx512", "avx2", "portable")


@pytest.fixture(autouse=True)
def _reset_isa():
    yield
    cpu_ops.set_isa("avx512")


def _gemv(x: torch.Tensor, w: Int4Weight, bias: torch.Tensor | None) -> torch.Tensor:
    m, n = x.shape[0], w.out_features
    y = torch.full((m, n), float("nan"))
    cpu_ops.gemv_q4(y.data_ptr(), n, x.data_ptr(), x.stride(0), *w._ptrs(),
                    0 if bias is None else bias.data_ptr(), m, w.in_features, n, w.group_size)
    return y


def _reference(x: torch.Tensor, w: Int4Weight, bias: torch.Tensor | None) -> torch.Tensor:
    """x quantised per token to int8 as the kernel does, times the dequantised W, in float64."""
    amax = x.abs().amax(dim=1, keepdim=True)  # float32 steps as the kernel's: x * (127 / amax)
    xs = torch.where(amax > 0, amax / 127, torch.ones_like(amax))
    xq = torch.round(x * torch.where(amax > 0, 127 / amax, torch.ones_like(amax))).clamp(-127, 127).double()
    y = (xq @ w.dequantize(torch.arange(w.out_features)).double().t()) * xs.double()
    return y if bias is None else y + bias.double()


def _weight(n: int, k: int, gs: int, sym: bool, seed: int, act_order: bool = False) -> Int4Weight:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g)
    if not act_order:
        return Int4Weight.from_float(w, gs, torch.float32, sym=sym)
    perm = torch.randperm(k, generator=g)
    q, s, z = quantize_int4(w[:, perm], gs, sym)
    return Int4Weight(q, s, z, gs, k, torch.float32, perm)


@settings(max_examples=60, deadline=None)
@given(n=st.integers(1, 40), k=st.integers(1, 300), gs=st.sampled_from([8, 32, 64, 128]),
       sym=st.booleans(), dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]),
       pad=st.integers(0, 3), ties=st.booleans(), seed=st.integers(0, 2**16))
@example(n=17, k=130, gs=64, sym=False, dtype=torch.bfloat16, pad=2, ties=True, seed=0)
def test_c_packer_is_the_torch_quantiser(n, k, gs, sym, dtype, pad, ties, seed):
    """from_float's one C pass (cpu_ops_pack_q4.h) gives the buffers quantize_int4 +
    pack_int4 + _blocks give, bit for bit: ties of rint (values on half steps), all-zero
    groups, padding rows and inputs, strided rows, every source dtype."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k + pad, generator=g)
    if ties:  # quarter steps: many values land exactly half way between levels
        w = torch.randint(-16, 17, (n, k + pad), generator=g).float() / 4
        w[0, :min(k, gs)] = 0  # an all-zero group: scale 0, q = z
    w = w.to(dtype)[:, :k]  # rows k + pad apart
    c = Int4Weight.from_float(w, gs, torch.float32, sym=sym)
    gs = c.group_size  # from_float narrows a group wider than the row
    q, sc, z = quantize_int4(w, gs, sym)
    ref = Int4Weight(q, sc, z, gs, k, torch.float32)
    assert torch.equal(c.weight, ref.weight) and torch.equal(c.scale.view(torch.int16), ref.scale.view(torch.int16))
    assert (c.zero is None) == sym and (sym or torch.equal(c.zero, ref.zero))


@settings(max_examples=40, deadline=None)
@given(m=st.integers(1, 40), k=st.integers(1, 300), n=st.integers(1, 70),
       gs=st.sampled_from([8, 32, 40, 64, 128]), sym=st.booleans(), act_order=st.booleans(),
       bias=st.booleans(), seed=st.integers(0, 2**16))
def test_gemv_matches_the_reference_on_every_isa_path(m, k, n, gs, sym, act_order, bias, seed):
    w = _weight(n, k, gs, sym, seed, act_order)
    g = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(m, k, generator=g)
    b = torch.randn(n, generator=g) if bias else None
    ref = _reference(x, w, b)
    outs = []
    for isa in ISAS:
        cpu_ops.set_isa(isa)
        outs.append(_gemv(x, w, b))
    for y in outs:
        assert torch.equal(y, outs[0])  # exact int32 sums, the same float steps on every path
    # Float rounding, plus one x value quantised to its neighbour: the kernel's 127 / amax may
    # differ from torch's by an ulp (-ffast-math's reciprocal), which moves a near-.5 tie.
    one_step = x.abs().amax(dim=1, keepdim=True).double() / 127 * w.dequantize(torch.arange(n)).abs().max()
    scale = ref.abs().max().item() + 1.0
    assert ((outs[0].double() - ref).abs() <= 1e-5 * scale + 1.01 * one_step).all()


@pytest.mark.parametrize("m", [1, 5])  # batch 1 (four blocks at once) and the row groups
@pytest.mark.parametrize("gs", [8, 40, 128])  # 1, 5 (4 + 1) and 16 lines a group
@pytest.mark.parametrize("q_val,x_sign", [(15, 1.0), (15, -1.0), (0, 1.0)])
def test_gemv_exact_at_the_int16_bound(m, gs, q_val, x_sign):
    """Every nibble at its extreme and every x at +-127: the AVX2 path's int16 pair sums are at
    their largest (VPMADDUBSW saturates); a saturation or a lost line breaks the equality."""
    n, k = 80, 2 * gs  # five blocks: one quad and one alone at batch 1
    q = torch.full((n, k), q_val, dtype=torch.uint8)
    scale = torch.full((n, k // gs), 0.5)
    zero = torch.zeros((n, k // gs), dtype=torch.uint8)  # W = 0.5 * q: no offset to hide a loss
    w = Int4Weight(q, scale, zero, gs, k, torch.float32)
    x = torch.full((m, k), x_sign)
    expect = torch.full((m, n), x_sign * 0.5 * q_val * k)
    for isa in ISAS:
        cpu_ops.set_isa(isa)
        assert torch.equal(_gemv(x, w, None), expect), isa


def test_isa_paths_exist():
    assert cpu_ops.lp_isa("int4", 64) in ISAS


@pytest.mark.parametrize("sym", [True, False])
@pytest.mark.parametrize("gs", [32, 64, 128])
@pytest.mark.parametrize("seed", [0, 18])  # 18: a symmetric group at 1.0011 steps (gs 32)
def test_quantise_round_trip_within_a_step(gs, sym, seed):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(37, 200, generator=g) * torch.linspace(0.1, 3, 200)
    q, s, z = quantize_int4(w, gs, sym)
    assert q.dtype == torch.uint8 and int(q.max()) <= 15 and s.dtype == torch.float16
    assert (z is None) == sym
    deq = Int4Weight(q, s, z, gs, 200, torch.float32).dequantize(torch.arange(37))
    step = s.float().abs().repeat_interleave(gs, dim=1)[:, :200]
    # Half a step of rounding, plus at the ends: symmetric clips the positive side at +7 of
    # 8 steps, an integer zero point shifts the grid by up to half a step. The grid is the
    # fp16 scale's, the group's range was the float32 one's: up to 15 steps of fp16 rounding
    # (2**-11 each) more (unseeded, 1.001 failed ~0.6 % of groups' draws: 1.0011-1.0032).
    assert ((deq - w).abs() <= step * (1 + 16 * 2**-11)).all()
    assert (deq - w).abs().mean() <= 0.3 * step.mean()  # mostly rounding: s / 4 on average


def test_pack_unpack_round_trip():
    q = torch.randint(0, 16, (45, 96), dtype=torch.uint8)
    packed = pack_int4(q)
    assert packed.shape == (3, 12, 64)
    rows = torch.tensor([0, 15, 16, 44, 7])
    assert torch.equal(unpack_int4(packed, rows), q[rows])


@pytest.mark.parametrize("act_order", [False, True])
def test_dense_and_embed_match_the_reference(act_order):
    w = _weight(50, 100, 32, False, 3, act_order)
    ref = w.dequantize(torch.arange(50))
    assert torch.equal(w.dense(torch.float32), ref)
    assert torch.equal(w.dense(torch.bfloat16), ref.to(torch.bfloat16))
    ids = torch.tensor([[3, 49], [0, 3]])
    assert torch.equal(w.embed(ids), ref[ids])
    assert w.embed(torch.tensor([], dtype=torch.int64)).shape == (0, 100)
    for bad in (50, -1):  # the C lookup checks every id (a stray read otherwise)
        with pytest.raises(IndexError, match=f"row {bad} is out of range for 50 rows"):
            w.embed(torch.tensor([1, bad]))


@pytest.mark.parametrize("act_order", [False, True])
def test_linear_gemm_path_is_the_dequantised_product(act_order):
    w = _weight(40, 96, 32, True, 4, act_order)
    cpu_ops.set_isa("portable")  # on AVX2 alone the GEMV takes every number of rows
    x = torch.randn(cpu_ops.INT4_GEMV_MAX_M + 5, 96)
    assert cpu_ops.linear_route("int4", x.shape[0], 96) == "blas"
    b = torch.randn(40)
    y = w.linear(x, b)
    ref = x.double() @ w.dequantize(torch.arange(40)).double().t() + b.double()
    assert torch.allclose(y.double(), ref, atol=1e-4, rtol=1e-4)
    small = w.linear(x[:3], b)  # GEMV: x quantised per token
    assert torch.allclose(small.double(), ref[:3], atol=0.05 * ref.abs().max().item())


def test_bad_input_names_the_limit():
    w = _weight(16, 64, 32, True, 0)
    with pytest.raises(ValueError, match=r"x must be float32 \[num_tokens, 64\]"):
        w.linear(torch.randn(2, 63))
    with pytest.raises(ValueError, match="group"):
        Int4Weight(torch.zeros(16, 64, dtype=torch.uint8), torch.ones(16, 2), None, 24, 64, torch.float32)
    with pytest.raises(ValueError, match="group_size must be a positive multiple of 8"):
        cpu_ops.gemv_q4(0, 1, 0, 1, 0, 0, 0, 0, 0, 1, 8, 1, 12)


def test_nan_row_poisons_only_its_outputs():
    w = _weight(20, 64, 32, True, 1)
    x = torch.randn(3, 64)
    x[1, 5] = float("nan")
    y = _gemv(x, w, None)
    assert torch.isnan(y[1]).all() and torch.isfinite(y[[0, 2]]).all()
