"""Worker ops: the fused per-layer CPU kernels (RMSNorm with residual add, RoPE + KV write,
SiLU-and-mul, small-M GEMV) against the plain-torch references in pipeline.layers.ops_ref."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline.layers import ops_fused as ops
from pipeline.layers import ops_ref

pytest.importorskip("pipeline._ext.cpu_ops", reason="CPU ops extension not built")


def _tables(max_pos: int, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    inv = 1.0 / (10000.0 ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    f = torch.arange(max_pos, dtype=torch.float32)[:, None] * inv[None, :]
    return torch.cat((f.cos(), f.cos()), -1), torch.cat((-f.sin(), f.sin()), -1)


@settings(max_examples=25, deadline=None)
@given(tokens=st.integers(1, 40), hidden=st.sampled_from([8, 36, 256]), pad=st.integers(0, 5),
       with_residual=st.booleans(), seed=st.integers(0, 2**16))
def test_rms_norm_matches_reference(tokens, hidden, pad, with_residual, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden + pad, generator=g)[:, :hidden]  # strided rows
    w = torch.randn(hidden, generator=g)
    res = torch.randn(tokens, hidden, generator=g) if with_residual else None
    res_ref = res.clone() if with_residual else None
    got = ops.rms_norm(x, w, 1e-5, residual=res)
    want = ops_ref.rms_norm(x.clone(), w, 1e-5, residual=res_ref)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    if with_residual:
        torch.testing.assert_close(res, res_ref, rtol=0, atol=0)


def test_rms_norm_in_place_and_errors():
    x = torch.randn(3, 16)
    w = torch.rand(16)
    want = ops_ref.rms_norm(x.clone(), w, 1e-6)
    assert ops.rms_norm(x, w, 1e-6, out=x) is x
    torch.testing.assert_close(x, want, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="x must be a float32"):
        ops.rms_norm(torch.randn(3, 16, dtype=torch.float64), w, 1e-6)
    with pytest.raises(ValueError, match="out must not alias residual"):
        r = torch.randn(3, 16)
        ops.rms_norm(x, w, 1e-6, residual=r, out=r)
    with pytest.raises(ValueError, match="residual must be on cpu with 3 rows"):
        ops.rms_norm(x, w, 1e-6, residual=torch.randn(2, 16))


@settings(max_examples=25, deadline=None)
@given(tokens=st.integers(1, 33), heads=st.sampled_from([(4, 2), (2, 2), (8, 1)]),
       head_dim=st.sampled_from([8, 64]), block_size=st.sampled_from([1, 4, 16]),
       cache_dtype=st.sampled_from([torch.float32, torch.bfloat16]), seed=st.integers(0, 2**16))
def test_rope_and_cache_matches_reference(tokens, heads, head_dim, block_size, cache_dtype, seed):
    nh, nkv = heads
    g = torch.Generator().manual_seed(seed)
    num_blocks = tokens // block_size + 3
    qkv = torch.randn(tokens, (nh + 2 * nkv) * head_dim, generator=g)
    max_pos = 64
    cos, sin = _tables(max_pos, head_dim)
    positions = torch.randint(0, max_pos, (tokens,), generator=g)
    slots = torch.randperm(num_blocks * block_size, generator=g)[:tokens]
    slots[torch.rand(tokens, generator=g) < 0.2] = -1  # padding tokens are rotated, not cached
    kc = torch.randn(num_blocks, block_size, nkv, head_dim, generator=g).to(cache_dtype)
    vc = torch.randn(num_blocks, block_size, nkv, head_dim, generator=g).to(cache_dtype)

    def views(t):
        q = t[:, :nh * head_dim].view(tokens, nh, head_dim)
        k = t[:, nh * head_dim:(nh + nkv) * head_dim].view(tokens, nkv, head_dim)
        v = t[:, (nh + nkv) * head_dim:].view(tokens, nkv, head_dim)
        return q, k, v

    ref_qkv, ref_kc, ref_vc = qkv.clone(), kc.clone(), vc.clone()
    ops.rope_and_cache(*views(qkv), positions, cos, sin, kc, vc, slots)
    ops_ref.rope_and_cache(*views(ref_qkv), positions, cos, sin, ref_kc, ref_vc, slots)
    torch.testing.assert_close(qkv, ref_qkv, rtol=1e-5, atol=1e-5)
    tol = 0 if cache_dtype == torch.float32 else 1e-2
    torch.testing.assert_close(kc.float(), ref_kc.float(), rtol=tol, atol=max(tol, 1e-5))
    torch.testing.assert_close(vc, ref_vc, rtol=0, atol=0)


def test_rope_and_cache_rejects_bad_position_and_slot():
    cos, sin = _tables(8, 8)
    q, k, v = torch.randn(2, 2, 8), torch.randn(2, 1, 8), torch.randn(2, 1, 8)
    kc, vc = torch.zeros(2, 4, 1, 8), torch.zeros(2, 4, 1, 8)
    before = q.clone()
    with pytest.raises(ValueError, match=r"token 1: position 8 must be in \[0, 8\)"):
        ops.rope_and_cache(q, k, v, torch.tensor([0, 8]), cos, sin, kc, vc, torch.tensor([0, 1]))
    with pytest.raises(ValueError, match="slot 8 below 8"):
        ops.rope_and_cache(q, k, v, torch.tensor([0, 1]), cos, sin, kc, vc, torch.tensor([0, 8]))
    assert torch.equal(q, before) and not kc.any()  # nothing written before the check


@settings(max_examples=20, deadline=None)
@given(tokens=st.integers(1, 40), inter=st.sampled_from([1, 7, 8, 688]),
       scale=st.sampled_from([1.0, 30.0]), seed=st.integers(0, 2**16))
def test_silu_and_mul_matches_reference(tokens, inter, scale, seed):
    """Odd widths take the scalar tail; large inputs reach the vector exp's clamped ends."""
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(tokens, 2 * inter + 3, generator=g) * scale)[:, :2 * inter]
    torch.testing.assert_close(ops.silu_and_mul(x), ops_ref.silu_and_mul(x), rtol=1e-5, atol=1e-6)


@settings(max_examples=30, deadline=None)
@given(m=st.integers(1, 12), k=st.integers(1, 70), n=st.integers(1, 70), kn=st.booleans(),
       with_bias=st.booleans(), seed=st.integers(0, 2**16))
def test_linear_matches_torch(m, k, n, kn, with_bias, seed):
    """Rows up to GEMV_MAX_M take the C kernel (odd K and N exercise its tails), more take BLAS."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g)
    w = torch.randn(n, k, generator=g)
    b = torch.randn(n, generator=g) if with_bias else None
    got = ops.linear(x, w.t().contiguous() if kn else w, b, kn=kn)
    want = torch.nn.functional.linear(x.double(), w.double(), None if b is None else b.double())
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-4)


def test_linear_gemv_bound_matches_extension():
    from pipeline._ext import cpu_ops
    assert ops.GEMV_MAX_M == cpu_ops.GEMV_MAX_M


@pytest.mark.parametrize("m,k,n", [(1, 256, 2048), (3, 64, 37), (8, 688, 256), (2, 8, 5)])
def test_linear_vector_paths(m, k, n):
    """K a multiple of 8 takes the AVX2 dot-product kernel for [out, in] weights (with its
    prefetch of the next row group); N not a multiple of 4 leaves a scalar tail."""
    g = torch.Generator().manual_seed(m * k + n)
    x, w, b = torch.randn(m, k, generator=g), torch.randn(n, k, generator=g), torch.randn(n, generator=g)
    want = torch.nn.functional.linear(x.double(), w.double(), b.double())
    torch.testing.assert_close(ops.linear(x, w, b).double(), want, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(ops.linear(x, w.t().contiguous(), b, kn=True).double(), want,
                               rtol=1e-5, atol=1e-4)


@settings(max_examples=60, deadline=None)
@given(rows=st.integers(1, 5), n=st.integers(1, 300), ties=st.booleans(), nans=st.integers(0, 3),
       seed=st.integers(0, 2**16))
def test_argmax_answers_as_torch(rows, n, ties, nans, seed):
    """Greedy sampling's argmax: torch's index for every row (the first of tied maxima, the
    first NaN where a row has one), over rows of a wider (strided) tensor."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, n + 3, generator=g)
    if ties:  # a few values of a tiny range: the maximum repeats
        x = torch.randint(0, 3, (rows, n + 3), generator=g).float()
    for _ in range(nans):
        x[int(torch.randint(0, rows, (1,), generator=g)), int(torch.randint(0, n, (1,), generator=g))] = float("nan")
    view = x[:, :n]
    assert torch.equal(ops.argmax(view), view.argmax(dim=-1))
