"""The AMX kernels (cython_ext/cpu_ops_amx.h, cpu_ops_amx_gemm.h) and the one packed bf16 copy (layers/lowp.py):
AMX products against float64 references over shapes that are not multiples of the tiles, the
int8 AMX kernel bit-identical to the int8 GEMV on every ISA path, the bf16 AMX kernel within
bf16 rounding of the vector paths, LowpWeight's routing, its lookups and its memory."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline.layers import ops, ops_fused
from pipeline.layers.lowp import LowpWeight, mlp_bf16
from pipeline.layers.lowp_pack import quantize_int8

cpu_ops = ops.backend(torch.device("cpu"))
pytestmark = pytest.mark.skipif(cpu_ops is None, reason="C CPU ops not built")
AMX = cpu_ops is not None and cpu_ops.amx_ok()
needs_amx = pytest.mark.skipif(not AMX, reason="no AMX on this CPU (or the kernel refused it)")


@pytest.fixture(autouse=True)
def _reset_isa():
    yield
    cpu_ops.set_isa("amx")


def _call(kind: str, x: torch.Tensor, w: LowpWeight, bias: torch.Tensor | None) -> torch.Tensor:
    m, n, k = x.shape[0], w.out_features, w.in_features
    y = torch.full((m, n), float("nan"))
    args = (y.data_ptr(), n, x.data_ptr(), x.stride(0), w.weight.data_ptr())
    b = 0 if bias is None else bias.data_ptr()
    if kind == "amx_bf16":
        assert cpu_ops.amx_bf16(*args, b, m, k, n)
    elif kind == "gemv_bf16":
        cpu_ops.gemv_bf16(*args, b, m, k, n)
    elif kind == "amx_i8":
        assert cpu_ops.amx_i8(*args, w.scale.data_ptr(), b, m, k, n)
    else:
        cpu_ops.gemv_i8(*args, w.scale.data_ptr(), b, m, k, n)
    return y


@needs_amx
@settings(max_examples=40, deadline=None)
@given(m=st.integers(1, 80), n=st.integers(1, 70), k=st.integers(1, 300), bias=st.booleans(),
       seed=st.integers(0, 2**16))
def test_amx_bf16_matches_float64_and_every_vector_path(m, n, k, bias, seed):
    cpu_ops.set_isa("amx")  # hypothesis runs every example inside one call of the test
    g = torch.Generator().manual_seed(seed)
    x, w = torch.randn(m, k, generator=g), torch.randn(n, k, generator=g) * 0.1
    b = torch.randn(n, generator=g) if bias else None
    lw = LowpWeight(w, "bf16", torch.bfloat16)
    wd = lw.dense(torch.float32).double()
    assert torch.equal(wd, w.bfloat16().double())
    bd = 0 if b is None else b.double()
    ref = x.bfloat16().double() @ wd.t() + bd  # AMX rounds x to bf16 once
    y = _call("amx_bf16", x, lw, b)
    # Every path sums in float32: its error scales with the sum of |x w| terms, not with
    # the result, which cancellation can make far smaller (m = n = 1, k = 217: a result
    # of 0.008 from terms ~50x larger missed a bound relative to the result).
    scale = float((x.double().abs() @ wd.abs().t()).max()) + (0 if b is None else float(b.abs().max())) + 1e-6
    assert float((y.double() - ref).abs().max() / scale) < 1e-5
    for isa in ("avx512", "avx2", "portable"):
        cpu_ops.set_isa(isa)
        level = cpu_ops.lp_isa("bf16", k)
        yv = _call("gemv_bf16", x, lw, b).double()
        # VDPBF16PS rounds x to bf16 as AMX does; AVX2/portable multiply float32 x, which
        # bf16 rounding (8 significant bits) moves by at most 2^-8 relative per element
        if level == "avx512":
            assert float((yv - y.double()).abs().max() / scale) < 1e-5, level
        else:
            bound = (2.0 ** -8 + 1e-5) * (x.double().abs() @ wd.abs().t()) + 1e-7
            assert bool(((yv - y.double()).abs() <= bound).all()), level
        ref32 = x.double() @ wd.t() + bd
        if level != "avx512":
            assert float((yv - ref32).abs().max() / scale) < 1e-5, level


@needs_amx
@settings(max_examples=40, deadline=None)
@given(m=st.integers(1, 80), n=st.integers(1, 70), k64=st.integers(1, 5),
       k_tail=st.sampled_from([0, 0, -1, -3]), bias=st.booleans(), seed=st.integers(0, 2**16))
def test_amx_int8_is_bit_identical_to_every_gemv_path(m, n, k64, k_tail, bias, seed):
    k = 64 * k64 + k_tail  # ceil(k / 4) a multiple of 16: what the AMX kernel takes
    assert cpu_ops.amx_i8_fits(k)
    cpu_ops.set_isa("amx")
    g = torch.Generator().manual_seed(seed)
    x, w = torch.randn(m, k, generator=g), torch.randn(n, k, generator=g) * 0.1
    b = torch.randn(n, generator=g) if bias else None
    lw = LowpWeight(w, "int8", torch.bfloat16)
    y = _call("amx_i8", x, lw, b)
    q, scale = quantize_int8(w)
    xs = x.abs().amax(1).double() / 127
    xq = torch.round(x.double() / torch.where(xs > 0, xs, 1)[:, None])
    ref = (xq @ q.double().t()) * xs[:, None] * scale.double()[None] + (0 if b is None else b.double())
    # one quantisation step of an x within a float ulp of a rounding tie (test_lowp.py),
    # relative to the terms' magnitudes (a result whose terms cancel is tiny)
    mag = (x.abs().double() @ w.abs().double().t() + (0 if b is None else b.double().abs())).max()
    assert float((y.double() - ref).abs().max() / (mag + 1e-6)) < 5e-3
    for isa in ("avx512", "avx2", "portable"):
        cpu_ops.set_isa(isa)
        assert torch.equal(_call("gemv_i8", x, lw, b), y), cpu_ops.lp_isa("int8", k)


@needs_amx
def test_an_output_larger_than_the_caches_is_streamed_unchanged():
    """An output of 8 MiB or more is written with non-temporal stores: the same values."""
    torch.manual_seed(3)
    m, k, n = 520, 64, 4112  # 8.2 MiB of float32 out, rows 64-byte aligned
    x, w, b = torch.randn(m, k), torch.randn(n, k) * 0.1, torch.randn(n)
    lb, lq = LowpWeight(w, "bf16", torch.bfloat16), LowpWeight(w, "int8", torch.bfloat16)
    y = _call("amx_bf16", x, lb, b)
    ref = x.bfloat16().double() @ lb.dense(torch.float32).double().t() + b.double()
    assert float((y.double() - ref).abs().max() / ref.abs().max()) < 1e-5
    assert torch.equal(_call("amx_i8", x, lq, b), _call("gemv_i8", x, lq, b))


@needs_amx
def test_amx_int8_refuses_a_depth_that_does_not_fill_its_tiles():
    lw = LowpWeight(torch.randn(20, 100), "int8", torch.bfloat16)
    assert not cpu_ops.amx_i8_fits(100)
    x, y = torch.randn(40, 100), torch.full((40, 20), float("nan"))
    assert not cpu_ops.amx_i8(y.data_ptr(), 20, x.data_ptr(), 100, lw.weight.data_ptr(),
                              lw.scale.data_ptr(), 0, 40, 100, 20)
    assert torch.isnan(y).all()  # nothing written: the caller takes another kernel
    ref = x @ lw.dense(torch.float32).t()
    for rows in (x[:32], x):  # the int8 GEMV, then dequantise + BLAS
        assert float((lw.linear(rows) - ref[:rows.shape[0]]).abs().max() / ref.abs().max()) < 3e-2


@pytest.mark.parametrize("fmt", ["bf16", "int8"])
@pytest.mark.parametrize("cap", ["amx", "avx512", "avx2", "portable"])
def test_linear_agrees_under_every_isa_cap(fmt, cap):
    torch.manual_seed(1)
    w, b = torch.randn(70, 192) * 0.1, torch.randn(70)
    lw = LowpWeight(w, fmt, torch.bfloat16)
    cpu_ops.set_isa(cap)
    assert cpu_ops.amx_ok() == (AMX and cap == "amx")
    for m in (1, 2, 9, 40, 100):
        x = torch.randn(m, 192)
        ref = x @ lw.dense(torch.float32).t() + b
        y = lw.linear(x, b)
        # x rounded to bf16 (AMX, VDPBF16PS, a bf16 BLAS GEMM) or quantised to int8
        assert float((y - ref).abs().max() / ref.abs().max()) < 3e-2, (fmt, cap, m)


def test_a_bf16_weight_holds_one_copy():
    w = torch.randn(1152, 896)
    lw = LowpWeight(w, "bf16", torch.bfloat16)
    assert [n for n, _ in lw.named_buffers()] == ["weight"]
    assert lw.nbytes <= 1.2 * 2 * w.numel()
    assert lw.step_nbytes == lw.nbytes
    odd = LowpWeight(torch.randn(1000, 900), "bf16", torch.bfloat16)  # padded to 1008 x 928
    assert odd.nbytes == 1008 * 928 * 2 <= 1.2 * 2 * 1000 * 900


@settings(max_examples=20, deadline=None)
@given(n=st.integers(1, 90), k=st.integers(1, 100), seed=st.integers(0, 2**16))
def test_embedding_rows_come_out_of_the_packed_blocks(n, k, seed):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g)
    ids = torch.randint(0, n, (7,), generator=g)
    tied = LowpWeight(w, "bf16", torch.bfloat16)
    table = LowpWeight(w, "bf16", torch.bfloat16, table_only=True)
    assert torch.equal(tied.embed(ids), w.bfloat16().float()[ids])
    assert torch.equal(table.embed(ids), w.bfloat16().float()[ids])


@needs_amx
def test_amx_peak_is_measured():
    bf16 = cpu_ops.amx_peak(0, 20000, 1)
    int8 = cpu_ops.amx_peak(1, 20000, 1)
    assert bf16 > 0 and int8 > 0  # 1024 / 2048 ops per cycle per core when unshared (docs/cpu.md)
    cpu_ops.set_isa("avx512")
    assert cpu_ops.amx_peak(0, 10, 1) == 0.0


@needs_amx
@settings(max_examples=30, deadline=None)
@given(m=st.integers(2, 70), blocks=st.integers(1, 5), k64=st.integers(1, 4), fmt=st.sampled_from(["bf16", "int8"]),
       seed=st.integers(0, 2**16))
def test_fused_swiglu_gives_the_floats_of_the_projection_then_silu_and_mul(m, blocks, k64, fmt, seed):
    """gate_up on AMX tiles with SwiGLU in the epilogue: every float as the unfused path's
    (the projection, then silu_and_mul), for gate/up blocks of 16 and row counts that do not
    fill the tiles; the gate_up product is never written."""
    cpu_ops.set_isa("amx")
    g = torch.Generator().manual_seed(seed)
    inter, k = 16 * blocks, 64 * k64
    x, w = torch.randn(m, k, generator=g), torch.randn(2 * inter, k, generator=g) * 0.3
    lw = LowpWeight(w, fmt, torch.bfloat16)
    act = torch.full((m, inter), float("nan"))
    assert lw.swiglu(x, act)
    want = ops_fused.silu_and_mul(lw.linear(x))
    assert torch.equal(act, want)


@needs_amx
def test_swiglu_declines_what_its_kernel_does_not_take():
    """One row (the GEMV's), a gate/up split inside a block of 16, or no AMX: False and
    nothing written, so the caller runs the projection and silu_and_mul."""
    w = torch.randn(2 * 24, 64)
    for lw, m in ((LowpWeight(torch.randn(32, 64), "bf16", torch.bfloat16), 1),
                  (LowpWeight(w, "bf16", torch.bfloat16), 8), (LowpWeight(w, "int8", torch.bfloat16), 8)):
        act = torch.full((m, lw.out_features // 2), float("nan"))
        assert not lw.swiglu(torch.randn(m, 64), act)
        assert act.isnan().all()
    cpu_ops.set_isa("avx512")
    lw = LowpWeight(torch.randn(32, 64), "bf16", torch.bfloat16)
    act = torch.full((8, 16), float("nan"))
    assert not lw.swiglu(torch.randn(8, 64), act) and act.isnan().all()


@needs_amx
@settings(max_examples=25, deadline=None)
@given(m=st.integers(2, 70), blocks=st.integers(1, 5), k=st.integers(1, 100), seed=st.integers(0, 2**16))
def test_the_fused_mlp_gives_the_floats_of_its_three_steps(m, blocks, k, seed):
    """gate_up with SwiGLU writing the down product's bf16 input tiles: every float as the
    projection, silu_and_mul and the down projection one after the other, for an inter of
    16 (a half-filled last tile step) or more and any hidden size."""
    cpu_ops.set_isa("amx")
    g = torch.Generator().manual_seed(seed)
    inter = 16 * blocks
    x = torch.randn(m, k, generator=g)
    gu = LowpWeight(torch.randn(2 * inter, k, generator=g) * 0.3, "bf16", torch.bfloat16)
    dn = LowpWeight(torch.randn(k, inter, generator=g) * 0.3, "bf16", torch.bfloat16)
    out = torch.full((m, k), float("nan"))
    assert mlp_bf16(x, gu, dn, out)
    assert torch.equal(out, dn.linear(ops_fused.silu_and_mul(gu.linear(x))))
    one = torch.full((1, k), float("nan"))  # one row: the GEMVs' (declined, nothing written)
    assert not mlp_bf16(x[:1], gu, dn, one) and one.isnan().all()
