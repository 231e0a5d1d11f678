"""layers/flash_prefill: the split of a step between FlashAttention-2 and the paged kernel.

On any machine the split itself (rows, cumulative lengths, gathered context slots, the paged
share) is checked with a plain-torch stand-in for the flash kernel against ops_ref, over random
batches of decodes, short verifies, prompts and chunks with cached context. Where CUDA is
present the real kernel runs the same batches in fp16 and bf16.
"""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from conftest import cuda_skip_reason
from hypothesis import given, settings
from hypothesis import strategies as st
from test_ops import make_batch

from pipeline.layers import flash_prefill, ops_ref
from pipeline.layers.flash_prefill import MIN_Q, plan


def reference_varlen(q, k, v, cu_q, cu_k, max_q, max_k, scale):
    """Causal attention aligned to the end of each context, one sequence at a time."""
    out = torch.empty_like(q)
    group = q.shape[1] // k.shape[1]
    for i in range(len(cu_q) - 1):
        qs, qe, ks, ke = int(cu_q[i]), int(cu_q[i + 1]), int(cu_k[i]), int(cu_k[i + 1])
        n, m = qe - qs, ke - ks
        assert n <= max_q and m <= max_k
        qq = q[qs:qe].float().transpose(0, 1)  # [H, n, D]
        kk = k[ks:ke].float().repeat_interleave(group, 1).transpose(0, 1)
        vv = v[ks:ke].float().repeat_interleave(group, 1).transpose(0, 1)
        s = qq @ kk.transpose(1, 2) * scale
        seen = torch.arange(m)[None, :] <= (m - n + torch.arange(n))[:, None]
        s = s.masked_fill(~seen, float("-inf"))
        out[qs:qe] = (s.softmax(-1) @ vv).transpose(0, 1).to(q.dtype)
    return out


def split_and_run(bt, scale, device):
    n = np.diff(bt.cu_seqlens_q.numpy()).astype(np.int64)
    p = plan(n, bt.seq_lens.numpy().astype(np.int64), bt.block_tables.numpy(), bt.k_cache.shape[1],
             lambda a: torch.from_numpy(a).to(device))
    assert (p is None) == bool((n < MIN_Q).all())
    if p is None:
        return None
    q, kc, vc = (t.to(device) for t in (bt.q, bt.k_cache, bt.v_cache))
    return flash_prefill.attention(q, kc, vc, p, scale).cpu()


def want(bt, scale):
    return ops_ref.paged_attention(bt.q, bt.k_cache, bt.v_cache, bt.cu_seqlens_q, bt.seq_lens,
                                   bt.block_tables, scale, out=torch.zeros_like(bt.q))


seq = st.one_of(st.integers(1, 4), st.integers(MIN_Q, 70)).flatmap(
    lambda q: st.tuples(st.integers(q, q + 90), st.just(q)))


@settings(max_examples=60, deadline=None)
@given(seqs=st.lists(seq, min_size=1, max_size=6), block_size=st.sampled_from([1, 8, 16]),
       group=st.sampled_from([1, 3]))
def test_split_matches_the_paged_reference(seqs, block_size, group):
    """A wrong row, slot or paged share shows up as a mismatch against ops_ref."""
    bt = make_batch(seqs, 2 * group, 2, 16, block_size, torch.float32)
    with pytest.MonkeyPatch.context() as mp:  # this test only: the GPU test runs the real kernel
        mp.setattr(flash_prefill, "varlen_causal", reference_varlen)
        got = split_and_run(bt, 0.3, torch.device("cpu"))
    if got is not None:
        torch.testing.assert_close(got, want(bt, 0.3), atol=1e-4, rtol=1e-4)


def test_only_decodes_and_verifies_stay_paged():
    bt = make_batch([(40, 1), (33, 5), (70, MIN_Q - 1)], 4, 2, 16, 8, torch.float32)
    assert split_and_run(bt, 0.3, torch.device("cpu")) is None


@pytest.mark.skipif(cuda_skip_reason() is not None, reason=str(cuda_skip_reason()))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_flash_kernel_on_the_gpu(dtype, head_dim):
    """The real FlashAttention-2: prompts, chunks over cached context (causal aligned to the
    end), decodes and verifies in one step, grouped K/V heads."""
    assert flash_prefill.supported(torch.device("cuda"), dtype, head_dim)
    assert flash_prefill.varlen_causal is not reference_varlen
    seqs = [(100, 37), (64, 64), (513, 128), (200, 1), (33, 32), (90, 4), (2048, 2048)]
    bt = make_batch(seqs, 16, 4, head_dim, 16, dtype)
    scale = 1 / math.sqrt(head_dim)
    got = split_and_run(bt, scale, torch.device("cuda"))
    tol = 2e-2 if dtype == torch.bfloat16 else 2e-3
    torch.testing.assert_close(got.float(), want(bt, scale).float(), atol=tol, rtol=tol)
    only_prompts = make_batch([(300, 300), (17, 17)], 8, 8, head_dim, 16, dtype, seed=1)
    got = split_and_run(only_prompts, scale, torch.device("cuda"))
    torch.testing.assert_close(got.float(), want(only_prompts, scale).float(), atol=tol, rtol=tol)
