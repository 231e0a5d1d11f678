"""Which kernel bf16, int8 and int4 weights take by the number of rows (``cpu_ops.linear_route``),
and that it does not change the floats: on a core with AVX2 alone (the ``avx2`` ISA cap on any
x86 CPU with AVX2) the GEMVs take every batch, where before 9 rows (bf16) and 33 (int8, int4)
went to a dequantised float32 copy for BLAS, and each row of a batch equals that row multiplied alone,
bit for bit, through strided x and y, the columns past N untouched (a row alone goes through the
four-block loops, a batch through groups of rows: the same order of sums)."""
from __future__ import annotations

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from pipeline.layers import ops
from pipeline.layers.int4 import Int4Weight
from pipeline.layers.lowp import LowpWeight

cpu_ops = ops.backend(torch.device("cpu"))
pytestmark = pytest.mark.skipif(cpu_ops is None, reason="C CPU ops not built")


def _has_avx2() -> bool:
    cpu_ops.set_isa("avx2")
    try:
        return cpu_ops.lp_isa("bf16", 64) == "avx2"
    finally:
        cpu_ops.set_isa("amx")


@pytest.fixture(autouse=True)
def _avx2_cap():
    if not _has_avx2():
        pytest.skip("the CPU has no AVX2")
    cpu_ops.set_isa("avx2")
    yield
    cpu_ops.set_isa("amx")


def test_avx2_routes_every_batch_to_the_gemvs():
    for kind in ("bf16", "int8", "int4"):
        assert {cpu_ops.linear_route(kind, m, 896) for m in (1, 8, 9, 32, 33, 2048)} == {"gemv"}
    cpu_ops.set_isa("portable")  # no vector body: past the small-row GEMV, BLAS
    assert cpu_ops.linear_route("bf16", 9, 896) == "blas" and cpu_ops.linear_route("int8", 33, 896) == "blas"
    assert cpu_ops.linear_route("int4", cpu_ops.INT4_GEMV_MAX_M + 1, 896) == "blas"
    assert cpu_ops.linear_route("int4", cpu_ops.INT4_GEMV_MAX_M, 896) == "gemv"
    with pytest.raises(ValueError, match="kind must be bf16, int8 or int4"):
        cpu_ops.linear_route("int2", 9, 64)


def test_int4_batch_on_avx2_is_its_rows_alone():
    """Past 32 rows an int4 weight stays in its GEMV (no dequantised copy): each row of a
    batch equals that row alone, bit for bit (exact int32 sums per group, one scaling)."""
    g = torch.Generator().manual_seed(3)
    w = Int4Weight.from_float(torch.randn(70, 200, generator=g) * 0.1, 64, torch.float32)
    x = torch.randn(cpu_ops.INT4_GEMV_MAX_M + 9, 200, generator=g)
    b = torch.randn(70, generator=g)
    batch = w.linear(x, b)
    assert torch.equal(batch, torch.cat([w.linear(x[i:i + 1], b) for i in range(x.shape[0])]))
    cpu_ops.set_isa("portable")  # the dequantised product: not the GEMV's floats
    assert not torch.equal(w.linear(x, b), batch)


def test_int4_prefill_in_panels_is_its_rows_alone():
    """Past 256 KB of quantised x (70 rows x 4160 inputs: panels of 64 and 6 rows) the int4
    rows go in panels: each still equals that row alone, bit for bit."""
    g = torch.Generator().manual_seed(5)
    w = Int4Weight.from_float(torch.randn(40, 4160, generator=g) * 0.05, 128, torch.float32)
    x = torch.randn(70, 4160, generator=g)
    b = torch.randn(40, generator=g)
    batch = w.linear(x, b)
    assert torch.equal(batch, torch.cat([w.linear(x[i:i + 1], b) for i in range(x.shape[0])]))


@settings(max_examples=8, deadline=None)
@given(fmt=st.sampled_from(["bf16", "int8"]), m=st.integers(64, 150), n=st.integers(1, 40),
       k=st.integers(4100, 4700), pad_x=st.integers(0, 3), pad_y=st.integers(0, 5), bias=st.booleans(),
       seed=st.integers(0, 2**16))
@example(fmt="bf16", m=131, n=37, k=4101, pad_x=1, pad_y=3, bias=True, seed=2)  # odd K, N cuts a block, 6-row rest
@example(fmt="int8", m=131, n=37, k=4101, pad_x=1, pad_y=3, bias=True, seed=2)  # panels of 64, 64 and 3 rows
def test_a_prefill_in_panels_is_its_rows_alone(fmt, m, n, k, pad_x, pad_y, bias, seed):
    """From 64 rows and 1 MB of x the bf16 product goes through panels of 120 rows and chunks of
    256 inputs, the weights widened once per chunk (a block cut by N keeps its sums aside between
    chunks); int8 rows go in panels of 256 KB of quantised x. Each row still equals that row
    alone, bit for bit, nothing past N is written, and it agrees with the float64 product."""
    _a_batch_is_its_rows_alone(fmt, m, n, k, pad_x, pad_y, bias, seed)


@settings(max_examples=30, deadline=None)
@given(fmt=st.sampled_from(["bf16", "int8"]), m=st.integers(9, 90), n=st.integers(1, 80),
       k=st.integers(1, 300), pad_x=st.integers(0, 5), pad_y=st.integers(0, 20),
       bias=st.booleans(), seed=st.integers(0, 2**16))
@example(fmt="int8", m=9, n=2, k=3, pad_x=0, pad_y=0, bias=False, seed=0)  # CI: one large x, one small w
@example(fmt="bf16", m=9, n=70, k=45, pad_x=1, pad_y=3, bias=True, seed=1)  # rows alone: 4 blocks at once, odd K
@example(fmt="int8", m=9, n=70, k=45, pad_x=1, pad_y=3, bias=True, seed=1)  # the same for int8
def test_a_batch_is_its_rows_alone(fmt, m, n, k, pad_x, pad_y, bias, seed):
    _a_batch_is_its_rows_alone(fmt, m, n, k, pad_x, pad_y, bias, seed)


def _a_batch_is_its_rows_alone(fmt, m, n, k, pad_x, pad_y, bias, seed):
    g = torch.Generator().manual_seed(seed)
    lw = LowpWeight(torch.randn(n, k, generator=g) * 0.1, fmt, torch.float32)
    x = torch.randn(m, k + pad_x, generator=g)[:, :k]  # rows k + pad_x apart
    b = torch.randn(n, generator=g) if bias else None
    out_full = torch.full((m, n + pad_y), float("nan"))
    lw.linear(x, b, out_full[:, :n])
    rows = torch.cat([lw.linear(x[i:i + 1].contiguous(), b) for i in range(m)])
    assert torch.equal(out_full[:, :n], rows)
    assert torch.isnan(out_full[:, n:]).all()  # nothing past the N columns was written
    wd = lw.dense(torch.float32).double()
    ref = x.double() @ wd.t() + (0 if b is None else b.double())
    err = (out_full[:, :n].double() - ref).abs()
    # bf16 sums float32 products: a float32 rounding of the magnitude sum
    mag = x.double().abs() @ wd.abs().t() + (0 if b is None else b.double().abs())
    slack = 1e-5 * mag + 1e-6
    if fmt == "int8":  # x quantised per token: each element off by half a step, amax / 254
        slack = slack + x.double().abs().amax(1, keepdim=True) / 254 * wd.abs().sum(1)
    assert (err <= slack).all(), (err / slack).max()
