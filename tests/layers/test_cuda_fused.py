"""layers/ops_cuda: the fused CUDA kernels give what torch's chain of ops gives (GPU only).

Each kernel rounds where the per-op form rounds, so almost every element is bit-equal; the
rest may differ by the last bit (a float32 sum in another order, a fused multiply-add).
"""
from __future__ import annotations

import pytest
import torch
from conftest import cuda_skip_reason

from pipeline.layers import ops_cuda
from pipeline.layers.norm import RMSNorm
from pipeline.layers.rotary import RotaryEmbedding

pytestmark = pytest.mark.skipif(cuda_skip_reason() is not None, reason=str(cuda_skip_reason()))
DEV = torch.device("cuda")
HALF = [torch.bfloat16, torch.float16]


def same(got: torch.Tensor, want: torch.Tensor) -> None:
    """Within one rounding step of the dtype, and bit-equal almost everywhere."""
    eps = torch.finfo(want.dtype).eps
    torch.testing.assert_close(got.float(), want.float(), rtol=2 * eps, atol=2 * eps)
    assert (got == want).float().mean().item() > 0.98


@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("rows,dim", [(1, 2048), (7, 896), (300, 4096), (2, 8192), (3, 100), (2, 10240)])
def test_add_rms_norm_matches_add_then_norm(dtype, rows, dim):
    g = torch.Generator(device=DEV).manual_seed(rows)
    norm = RMSNorm(dim, 1e-5).to(DEV)
    norm.weight.data = (torch.rand(dim, generator=g, device=DEV) * 2).to(dtype)
    x = torch.randn(rows, dim, generator=g, device=DEV).to(dtype) * 3
    add = torch.randn(rows, dim, generator=g, device=DEV).to(dtype)
    want_x = x + add
    want_h = norm(want_x)
    got_x = x.clone()
    got_h = ops_cuda.add_rms_norm(got_x, add, norm)
    assert torch.equal(got_x, want_x)  # the residual stream: one rounding, bit-equal
    same(got_h, want_h)
    plain = x.clone()  # no add: the norm alone, x untouched
    same(ops_cuda.add_rms_norm(plain, None, norm), norm(x))
    assert torch.equal(plain, x)


@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("rows,inter", [(1, 8192), (5, 4864), (64, 100)])
def test_silu_mul_matches_silu_then_mul(dtype, rows, inter):
    g = torch.Generator(device=DEV).manual_seed(inter)
    gate_up = (torch.randn(rows, 2 * inter, generator=g, device=DEV) * 4).to(dtype)
    want = torch.nn.functional.silu(gate_up[:, :inter]).mul_(gate_up[:, inter:])
    same(ops_cuda.silu_mul(gate_up), want)


@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("head_dim", [64, 128, 80])
def test_rotary_in_place_matches_apply_on_strided_rows(dtype, head_dim):
    """q and k heads as the model holds them: a view of the fused qkv rows (strided)."""
    tokens, heads, kv_heads = 37, 8, 2
    rope = RotaryEmbedding(head_dim, 4096, lambda: 1.0 / (10000 ** (torch.arange(0, head_dim, 2) / head_dim)))
    rope = rope.to(DEV)
    rope.reset()
    g = torch.Generator(device=DEV).manual_seed(head_dim)
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, generator=g, device=DEV).to(dtype)
    positions = torch.randint(0, 4096, (tokens,), generator=g, device=DEV)
    cos, sin = rope.table(positions, dtype)
    qk = qkv[:, :(heads + kv_heads) * head_dim].view(tokens, heads + kv_heads, head_dim)
    want = RotaryEmbedding.apply(qk, cos, sin)
    v_before = qkv[:, (heads + kv_heads) * head_dim:].clone()
    got = ops_cuda.rotary_(qk, cos, sin)
    assert got.data_ptr() == qkv.data_ptr()  # in place
    same(got, want)
    assert torch.equal(qkv[:, (heads + kv_heads) * head_dim:], v_before)  # v untouched


def test_bad_shapes_are_named():
    x = torch.zeros(4, 64, device=DEV, dtype=torch.bfloat16)
    norm = RMSNorm(32, 1e-5).to(DEV).to(torch.bfloat16)
    with pytest.raises(ValueError, match="add_rms_norm"):
        ops_cuda.add_rms_norm(x, None, norm)
    with pytest.raises(ValueError, match="silu_mul"):
        ops_cuda.silu_mul(torch.zeros(4, 7, device=DEV, dtype=torch.bfloat16))
