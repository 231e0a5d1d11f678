"""bf16 and int8 CPU weights (layers/lowp.py, cython_ext/cpu_ops_gemv_lp.h, cpu_ops_amx.h):
every ISA path the CPU has (AMX tiles, AVX-512, AVX2, portable) against float64 references,
int8 paths bit-identical to each other, the batched paths, the embedding lookup out of the
packed blocks, one bf16 copy, and float32 q over a half KV cache."""
from __future__ import annotations

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st
from test_ops import make_batch

from pipeline.layers import ops
from pipeline.layers.lowp import LowpWeight
from pipeline.layers.lowp_pack import pack_bf16, pack_int8, quantize_int8, unpack_int8, unpack_rows

cpu_ops = ops.backend(torch.device("cpu"))
pytestmark = pytest.mark.skipif(cpu_ops is None, reason="C CPU ops not built")
ISAS = ("avx512", "avx2", "portable")
AMX = cpu_ops is not None and cpu_ops.amx_ok()


@pytest.fixture(autouse=True)
def _reset_isa():
    yield
    cpu_ops.set_isa("amx")


def _gemv(fmt: str, x: torch.Tensor, w: LowpWeight, bias: torch.Tensor | None) -> torch.Tensor:
    m, n = x.shape[0], w.out_features
    y = torch.full((m, n), float("nan"))
    b = 0 if bias is None else bias.data_ptr()
    if fmt == "bf16":
        cpu_ops.gemv_bf16(y.data_ptr(), n, x.data_ptr(), x.stride(0), w.weight.data_ptr(), b,
                          m, w.in_features, n)
    else:
        cpu_ops.gemv_i8(y.data_ptr(), n, x.data_ptr(), x.stride(0), w.weight.data_ptr(),
                        w.scale.data_ptr(), b, m, w.in_features, n)
    return y


def _int8_reference(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """The exact integer product of per-token int8 x and int8 W, then the two scales."""
    q, scale = quantize_int8(w)
    xs = x.abs().amax(1).double() / 127
    xq = torch.round(x.double() / torch.where(xs > 0, xs, 1)[:, None])
    y = (xq @ q.double().t()) * xs[:, None] * scale.double()[None]
    return y if bias is None else y + bias.double()


@settings(max_examples=40, deadline=None)
@given(m=st.integers(1, 40), n=st.integers(1, 70), k_mult=st.integers(1, 6),
       k_tail=st.sampled_from([0, 0, 8, 16, 3]), bias=st.booleans(), seed=st.integers(0, 2**16))
@example(m=1, n=1, k_mult=5, k_tail=0, bias=False, seed=1)  # cancellation: a CI failure
def test_gemv_kernels_match_references_on_every_isa(m, n, k_mult, k_tail, bias, seed):
    g = torch.Generator().manual_seed(seed)
    k = 64 * k_mult + k_tail
    x = torch.randn(m, k, generator=g)
    w = torch.randn(n, k, generator=g) * 0.1
    b = torch.randn(n, generator=g) if bias else None
    wb, wq = LowpWeight(w, "bf16", torch.float32), LowpWeight(w, "int8", torch.float32)
    ref_q = _int8_reference(x, w, b)
    int8_results = {}
    for isa in ISAS:
        cpu_ops.set_isa(isa)
        used = cpu_ops.lp_isa("bf16", k)
        # AVX-512 BF16 rounds x to bf16 once (VDPBF16PS); the others multiply float32 x.
        xr = x.bfloat16().double() if used == "avx512" else x.double()
        wd = wb.dense(torch.float32).double()
        ref_b = xr @ wd.t() + (0 if b is None else b.double())
        y = _gemv("bf16", x, wb, b).double()  # the packed blocks serve any number of rows
        # A float32 sum's error is bounded relative to the sum of its terms' magnitudes, not
        # to the result (terms that cancel leave a tiny result: m = n = 1, k = 320 did).
        bias_mag = 0 if b is None else b.double().abs()
        scale = ((xr.abs() @ wd.abs().t()) + bias_mag).max() + 1e-6
        assert ((y - ref_b).abs().max() / scale) < 1e-5, (isa, used)
        yq = _gemv("int8", x, wq, b)
        # 5e-3: x * (127 / absmax) within a float ulp of a rounding tie may land on either
        # side (the kernel's float product, the reference's double quotient): one step of x
        scale_q = ((x.abs().double() @ w.abs().double().t()) + bias_mag).max() + 1e-6
        assert ((yq.double() - ref_q).abs().max() / scale_q) < 5e-3, isa
        int8_results[cpu_ops.lp_isa("int8", k)] = yq
    # Every int8 path computes the same int32 sums and the same scaling: identical floats.
    first = next(iter(int8_results.values()))
    for isa, yq in int8_results.items():
        assert torch.equal(yq, first), isa


@pytest.mark.parametrize("k", [7, 40, 96, 131])
def test_int8_rows_with_nan_inf_or_zeros_on_every_isa(k):
    """x is quantised per row by one function per ISA: a row with NaN or inf poisons its
    outputs (as float32 would), a zero row gives the bias, the rest are untouched, alike."""
    g = torch.Generator().manual_seed(k)
    x = torch.randn(6, k, generator=g)
    x[1, k // 2] = float("nan")
    x[2, k - 1] = float("inf")  # in the scalar tail where k is not a multiple of 8
    x[3] = 0.0
    x[4] = -0.0
    x[5, 0] = -float("inf")
    w = LowpWeight(torch.randn(20, k, generator=g) * 0.1, "int8", torch.float32)
    b = torch.randn(20, generator=g)
    results = []
    for isa in ISAS:
        cpu_ops.set_isa(isa)
        y = _gemv("int8", x, w, b)
        assert y[[1, 2, 5]].isnan().all(), isa
        assert torch.equal(y[3], b) and torch.equal(y[4], b), isa
        assert y[0].isfinite().all(), isa
        results.append(y)
    for y in results[1:]:
        assert torch.equal(y.nan_to_num(), results[0].nan_to_num())


def test_isa_cap_is_reported_and_checked():
    cpu_ops.set_isa("portable")
    assert cpu_ops.lp_isa("bf16", 384) == "portable" and cpu_ops.lp_isa("int8", 384) == "portable"
    cpu_ops.set_isa("avx2")
    assert cpu_ops.lp_isa("int8", 384) in ("avx2", "portable")
    assert cpu_ops.lp_isa("bf16", 100) in ("avx2", "portable")  # packed: any K
    assert cpu_ops.lp_isa("int8", 100) in ("avx2", "portable")  # packed: any K
    with pytest.raises(ValueError, match="isa must be one of"):
        cpu_ops.set_isa("sse9")


def test_quantize_int8_per_channel():
    w = torch.randn(33, 96) * torch.logspace(-3, 1, 33)[:, None]
    w[5] = 0.0
    q, scale = quantize_int8(w)
    assert q.dtype == torch.int8 and int(q.min()) >= -127 and int(q.max()) <= 127
    assert torch.all(q[5] == 0) and scale[5] == 1.0
    err = (q.float() * scale[:, None] - w).abs()
    assert torch.all(err <= scale[:, None] / 2 + 1e-7)
    assert torch.all(q.abs().amax(1)[torch.arange(33) != 5] == 127)  # each row uses its range


@pytest.mark.parametrize("fmt", ["bf16", "int8"])
@pytest.mark.parametrize("gemm_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m", [1, 8, 9, 40])
def test_linear_small_and_batched_paths(fmt, gemm_dtype, m):
    torch.manual_seed(m)
    w, b = torch.randn(96, 128) * 0.1, torch.randn(96)
    lw = LowpWeight(w, fmt, gemm_dtype)
    x = torch.randn(m, 128)
    dense = lw.dense(torch.float32).clone()
    ref = x @ dense.t() + b
    out = torch.empty(m, 96)
    y = lw.linear(x, b, out)
    assert y.data_ptr() == out.data_ptr()
    # bf16 rounding of x (AVX-512 GEMV, AMX, bf16 GEMM), int8 of x (GEMV, AMX), bf16 of W
    tol = 3e-2 if fmt == "int8" or gemm_dtype == torch.bfloat16 else 1e-2
    assert ((y - ref).abs().max() / ref.abs().max()) < tol
    with pytest.raises(ValueError, match=r"x must be float32 \[num_tokens, 128\]"):
        lw.linear(x[:, :64].contiguous())


@pytest.mark.parametrize("fmt", ["bf16", "int8"])
def test_embed_rows_match_the_dequantised_table(fmt):
    w = torch.randn(50, 70)  # K past the packing's units: bf16 pads to 96, int8 to 72
    lw = LowpWeight(w, fmt, torch.float32)
    ids = torch.tensor([0, 7, 7, 49])
    dense = lw.dense(torch.float32)
    assert torch.equal(lw.embed(ids), dense[ids])
    assert torch.equal(lw.embed(ids.view(2, 2)), dense[ids].view(2, 2, 70))
    assert lw.embed(torch.tensor([], dtype=torch.int64)).shape == (0, 70)
    for bad in (50, -1):  # the C lookup checks every id (a stray read otherwise)
        with pytest.raises(IndexError, match=f"row {bad} is out of range for 50 rows"):
            lw.embed(torch.tensor([1, bad]))
    if fmt == "int8":
        q, scale = quantize_int8(w)
        assert torch.equal(dense, q.float() * scale[:, None])


@settings(max_examples=30, deadline=None)
@given(n=st.integers(1, 50), k=st.integers(1, 70), seed=st.integers(0, 2**16))
def test_int8_packing_round_trips(n, k, seed):
    q = torch.randint(-127, 128, (n, k), generator=torch.Generator().manual_seed(seed)).to(torch.int8)
    packed = pack_int8(q)
    assert packed.shape == (-(-n // 16), -(-k // 4), 16, 4)
    assert torch.equal(unpack_int8(packed, torch.arange(n), k), q)
    assert int(packed.abs().sum()) == int(q.abs().sum())  # the padding is zero
    w = q.to(torch.bfloat16)
    packed = pack_bf16(w)
    assert packed.shape == (-(-n // 16), -(-k // 32) * 16, 16, 2)
    assert torch.equal(unpack_rows(packed, torch.arange(n), k), w)
    assert float(packed.float().abs().sum()) == float(w.float().abs().sum())


def test_float32_q_over_a_bf16_cache_matches_the_float32_computation():
    bt = make_batch([(40, 1), (17, 17), (5, 3)], 4, 2, 64, block_size=16, dtype=torch.bfloat16, seed=3)
    q32 = bt.q.float()
    out = ops.paged_attention(q32, bt.k_cache, bt.v_cache, bt.cu_seqlens_q, bt.seq_lens,
                              bt.block_tables, 0.125)
    assert out.dtype == torch.float32
    ref = ops.paged_attention(q32, bt.k_cache.float(), bt.v_cache.float(), bt.cu_seqlens_q,
                              bt.seq_lens, bt.block_tables, 0.125)
    assert torch.allclose(out, ref, atol=1e-5, rtol=1e-5)
