"""The AVX2 panel GEMM (cython_ext/cpu_ops_gemm_avx2.h): bf16 and int8 weights at batch on a
core without AVX-512 BF16 or AMX (run under the ``avx2`` ISA cap on any x86 CPU with AVX2).
Its products against float64 references of the widened weights, over row counts that leave
every tile remainder, column counts that leave partial blocks, depths that cross and end
inside its depth chunks, strided x and y; the columns past N of y untouched."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline.layers import ops
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


def test_routes_past_the_gemvs():
    assert [cpu_ops.linear_route("bf16", m, 896) for m in (1, 8, 9, 32, 2048)] == \
        ["gemv", "gemv", "gemm_avx2", "gemm_avx2", "gemm_avx2"]
    assert [cpu_ops.linear_route("int8", m, 896) for m in (1, 32, 33, 2048)] == \
        ["gemv", "gemv", "gemm_avx2", "gemm_avx2"]
    with pytest.raises(ValueError, match="kind must be bf16 or int8"):
        cpu_ops.linear_route("int4", 9, 64)


@settings(max_examples=40, deadline=None)
@given(fmt=st.sampled_from(["bf16", "int8"]), m=st.integers(9, 80), n=st.integers(1, 300),
       k=st.integers(1, 700), pad_x=st.integers(0, 5), pad_y=st.integers(0, 20),
       bias=st.booleans(), seed=st.integers(0, 2**16))
def test_panel_gemm_matches_the_widened_weights(fmt, m, n, k, pad_x, pad_y, bias, seed):
    if fmt == "int8":
        m += 24  # past the int8 GEMV's 32 rows
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * 0.1
    lw = LowpWeight(w, fmt, torch.float32)
    assert cpu_ops.linear_route(fmt, m, k) == "gemm_avx2"
    x = torch.randn(m, k + pad_x, generator=g)[:, :k]  # rows k + pad_x apart
    b = torch.randn(n, generator=g) if bias else None
    out_full = torch.full((m, n + pad_y), float("nan"))
    out = out_full[:, :n]
    lw.linear(x, b, out)
    wd = lw.dense(torch.float32).double()  # exactly the widened weights (bf16, or q * scale)
    ref = x.double() @ wd.t() + (0 if b is None else b.double())
    mag = x.double().abs() @ wd.abs().t() + (0 if b is None else b.double().abs())
    assert ((out.double() - ref).abs() / (mag + 1e-6)).max() < 1e-5
    assert torch.isnan(out_full[:, n:]).all()  # nothing past the N columns was written
