"""Worker ops: the CPU kernels (pipeline._ext.cpu_ops via pipeline.layers.ops) against the
plain-torch references in pipeline.layers.ops_ref, on random paged caches and varlen batches."""
from __future__ import annotations

import math
import warnings
from dataclasses import dataclass

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline.layers import ops, ops_ref

pytest.importorskip("pipeline._ext.cpu_ops", reason="CPU ops extension not built")

TOL = {torch.float32: (1e-5, 1e-5), torch.bfloat16: (2e-2, 2e-2), torch.float16: (2e-3, 2e-3)}


@dataclass(slots=True)
class Batch:
    q: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    cu_seqlens_q: torch.Tensor
    seq_lens: torch.Tensor
    block_tables: torch.Tensor


def make_batch(seqs: list[tuple[int, int]], num_heads: int, num_kv_heads: int, head_dim: int,
               block_size: int, dtype: torch.dtype, seed: int = 0, spare_blocks: int = 3,
               pad_tokens: int = 0) -> Batch:
    """seqs: (seq_len, q_len) pairs. Blocks are scattered at random over a cache whose
    unused blocks hold garbage too, so reading a wrong block shows up."""
    g = torch.Generator().manual_seed(seed)
    need = [math.ceil(s / block_size) for s, _ in seqs]
    num_blocks = sum(need) + spare_blocks
    max_blocks = max(need + [1]) + 1  # padded rows, as the worker sends them
    perm = torch.randperm(num_blocks, generator=g).to(torch.int32)
    tables = torch.full((len(seqs), max_blocks), -1, dtype=torch.int32)
    used = 0
    for b, n in enumerate(need):
        tables[b, :n] = perm[used:used + n]
        used += n
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=g).to(dtype)
    v_cache = torch.randn(shape, generator=g).to(dtype)
    q_lens = [q for _, q in seqs]
    total = sum(q_lens) + pad_tokens
    q = torch.randn(total, num_heads, head_dim, generator=g).to(dtype)
    cu = torch.tensor([0] + list(torch.tensor(q_lens).cumsum(0).tolist()), dtype=torch.int32)
    lens = torch.tensor([s for s, _ in seqs], dtype=torch.int32)
    return Batch(q, k_cache, v_cache, cu, lens, tables)


def run_both(bt: Batch, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    got = ops.paged_attention(bt.q, bt.k_cache, bt.v_cache, bt.cu_seqlens_q, bt.seq_lens,
                              bt.block_tables, scale)
    want = ops_ref.paged_attention(bt.q, bt.k_cache, bt.v_cache, bt.cu_seqlens_q, bt.seq_lens,
                                   bt.block_tables, scale, out=torch.zeros_like(bt.q))
    return got, want


def assert_close(got: torch.Tensor, want: torch.Tensor) -> None:
    atol, rtol = TOL[want.dtype]
    torch.testing.assert_close(got.float(), want.float(), atol=atol, rtol=rtol)


MIXED = [(1, 1), (17, 1), (40, 40), (33, 5), (16, 16), (70, 1), (9, 9), (48, 16)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(4, 4, 64), (8, 2, 128), (6, 1, 80)])
def test_paged_attention_mixed_batch(dtype, heads, kv_heads, head_dim):
    """Decode, prefill with context and fresh prefill in one batch; MHA, GQA and MQA."""
    bt = make_batch(MIXED, heads, kv_heads, head_dim, block_size=16, dtype=dtype, seed=heads)
    got, want = run_both(bt, 1 / math.sqrt(head_dim))
    assert_close(got, want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("seq_len,kv_heads", [(700, 1), (1025, 2), (300, 4)])
def test_paged_attention_long_decode_split_context(dtype, seq_len, kv_heads):
    """Batch-1 decode splits the context over threads; the merge must be exact."""
    bt = make_batch([(seq_len, 1)], 8, kv_heads, 64, block_size=16, dtype=dtype)
    got, want = run_both(bt, 0.125)
    assert_close(got, want)


def test_paged_attention_long_chunked_prefill_split():
    """One sequence's prefill chunk with a long cached context (splits cross the chunk)."""
    bt = make_batch([(600, 37)], 4, 1, 64, block_size=8, dtype=torch.float32)
    got, want = run_both(bt, 0.125)
    assert_close(got, want)


def test_paged_attention_strided_q_and_padding():
    """q may be a slice of a fused qkv tensor; rows past cu_seqlens_q[-1] come back zero."""
    bt = make_batch([(20, 3), (5, 1)], 4, 2, 64, block_size=4, dtype=torch.float32,
                    pad_tokens=2)
    qkv = torch.randn(bt.q.shape[0], 8, 64)
    q = qkv[:, :4]
    assert not q.is_contiguous()
    out = torch.full_like(bt.q, float("nan"))
    got = ops.paged_attention(q, bt.k_cache, bt.v_cache, bt.cu_seqlens_q, bt.seq_lens,
                              bt.block_tables, 0.3, out=out)
    assert got is out
    want = ops_ref.paged_attention(q.contiguous(), bt.k_cache, bt.v_cache, bt.cu_seqlens_q,
                                   bt.seq_lens, bt.block_tables, 0.3)
    assert_close(got[:4], want[:4])
    assert torch.equal(got[4:], torch.zeros_like(got[4:]))


@settings(max_examples=25, deadline=None)
@given(
    seqs=st.lists(st.tuples(st.integers(1, 90), st.integers(0, 90)), min_size=1, max_size=5),
    kv_heads=st.sampled_from([1, 2, 3]),
    group=st.sampled_from([1, 2, 4, 7]),
    head_dim=st.sampled_from([8, 20, 24, 64, 80, 136]),
    block_size=st.sampled_from([1, 4, 16, 32]),
    seed=st.integers(0, 1000),
)
def test_paged_attention_matches_reference(seqs, kv_heads, group, head_dim, block_size, seed):
    seqs = [(s, min(q, s)) for s, q in seqs]  # a sequence's queries are within its context
    bt = make_batch(seqs, kv_heads * group, kv_heads, head_dim, block_size, torch.float32, seed)
    got, want = run_both(bt, 1 / math.sqrt(head_dim))
    assert_close(got, want)


@settings(max_examples=20, deadline=None)
@given(
    seqs=st.lists(st.tuples(st.integers(200, 700), st.integers(0, 40)), min_size=1, max_size=3),
    kv_heads=st.sampled_from([1, 2]),
    group=st.sampled_from([1, 3, 7]),
    head_dim=st.sampled_from([24, 64]),
    block_size=st.sampled_from([1, 16, 32]),
    dtype=st.sampled_from([torch.float32, torch.bfloat16]),
    seed=st.integers(0, 1000),
)
def test_paged_attention_long_contexts_match_reference(seqs, kv_heads, group, head_dim, block_size,
                                                       dtype, seed):
    """Contexts past the kernel's 256-key pass: several passes per item (rescaled between
    them), causal limits inside a pass, a lone row read from the cache in place (group 1
    decode) one block at a time, down to blocks of one key."""
    seqs = [(s, min(q, s)) for s, q in seqs]
    bt = make_batch(seqs, kv_heads * group, kv_heads, head_dim, block_size, dtype, seed)
    got, want = run_both(bt, 1 / math.sqrt(head_dim))
    assert_close(got, want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_reshape_and_cache_matches_reference(dtype):
    g = torch.Generator().manual_seed(1)
    num_blocks, block_size, kv_heads, head_dim, tokens = 7, 5, 2, 80, 23
    k_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=g).to(dtype)
    v_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=g).to(dtype)
    kv = torch.randn(tokens, 2 * kv_heads, head_dim, generator=g).to(dtype)
    key, value = kv[:, :kv_heads], kv[:, kv_heads:]  # strided rows, like a fused projection
    slots = torch.randperm(num_blocks * block_size, generator=g)[:tokens]
    slots[[0, 7, 22]] = -1  # padding tokens
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    ops_ref.reshape_and_cache(key, value, k_ref, v_ref, slots)
    ops.reshape_and_cache(key, value, k_cache, v_cache, slots)
    assert torch.equal(k_cache, k_ref) and torch.equal(v_cache, v_ref)


def test_reshape_and_cache_large_parallel_path():
    k_cache = torch.zeros(64, 16, 8, 128)
    v_cache = torch.zeros_like(k_cache)
    key, value = torch.randn(2, 1000, 8, 128)
    slots = torch.randperm(64 * 16)[:1000]
    ops.reshape_and_cache(key, value, k_cache, v_cache, slots)
    assert torch.equal(k_cache.view(-1, 8, 128)[slots], key)
    assert torch.equal(v_cache.view(-1, 8, 128)[slots], value)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_copy_blocks_matches_reference(dtype):
    shape = (10, 4, 2, 64)
    k_caches = [torch.randn(shape).to(dtype) for _ in range(3)]
    v_caches = [torch.randn(shape).to(dtype) for _ in range(3)]
    pairs = torch.tensor([[0, 5], [3, 9], [7, 7], [2, 1]], dtype=torch.int64)
    k_ref = [t.clone() for t in k_caches]
    v_ref = [t.clone() for t in v_caches]
    ops_ref.copy_blocks(k_ref, v_ref, pairs)
    ops.copy_blocks(k_caches, v_caches, pairs)
    for got, want in zip(k_caches + v_caches, k_ref + v_ref):
        assert torch.equal(got, want)


def test_bad_indices_raise_naming_the_field():
    bt = make_batch([(10, 2)], 2, 1, 8, block_size=4, dtype=torch.float32)
    with pytest.raises(ValueError, match="slot_mapping\\[1\\]"):
        ops.reshape_and_cache(torch.zeros(2, 1, 8), torch.zeros(2, 1, 8), bt.k_cache,
                              bt.v_cache, torch.tensor([0, 10_000]))
    tables = bt.block_tables.clone()
    tables[0, 1] = 999
    with pytest.raises(ValueError, match="sequence 0"):
        ops.paged_attention(bt.q, bt.k_cache, bt.v_cache, bt.cu_seqlens_q, bt.seq_lens,
                            tables, 1.0)
    with pytest.raises(ValueError, match="sequence 0"):
        ops.paged_attention(bt.q, bt.k_cache, bt.v_cache, bt.cu_seqlens_q,
                            torch.tensor([1000], dtype=torch.int32), bt.block_tables, 1.0)
    with pytest.raises(ValueError, match="sequence 0"):  # more queries than context
        ops.paged_attention(bt.q, bt.k_cache, bt.v_cache, bt.cu_seqlens_q,
                            torch.tensor([1], dtype=torch.int32), bt.block_tables, 1.0)
    with pytest.raises(ValueError, match="pairs\\[0\\]"):
        ops.copy_blocks([bt.k_cache], [bt.v_cache], torch.tensor([[0, 99]]))


def test_bad_layouts_raise_naming_the_field():
    bt = make_batch([(10, 2)], 2, 1, 8, block_size=4, dtype=torch.float32)
    args = (bt.cu_seqlens_q, bt.seq_lens, bt.block_tables, 1.0)
    with pytest.raises(TypeError, match="q dtype"):
        ops.paged_attention(bt.q.double(), bt.k_cache, bt.v_cache, *args)
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        ops.paged_attention(torch.zeros(2, 3, 16), bt.k_cache, bt.v_cache, *args)
    with pytest.raises(ValueError, match="contiguous"):
        ops.paged_attention(bt.q, bt.k_cache.transpose(0, 1), bt.v_cache.transpose(0, 1),
                            *args)
    with pytest.raises(TypeError, match="seq_lens"):
        ops.paged_attention(bt.q, bt.k_cache, bt.v_cache, bt.cu_seqlens_q,
                            bt.seq_lens.long(), bt.block_tables, 1.0)
    with pytest.raises(ValueError, match="cu_seqlens_q needs 2"):
        ops.paged_attention(bt.q, bt.k_cache, bt.v_cache, bt.cu_seqlens_q[:1], *args[1:])
    with pytest.raises(TypeError, match="slot_mapping"):
        ops.reshape_and_cache(torch.zeros(2, 1, 8), torch.zeros(2, 1, 8), bt.k_cache,
                              bt.v_cache, torch.tensor([0, 1], dtype=torch.int32))


@pytest.mark.parametrize("threads", [1, 3])
def test_paged_attention_any_thread_count(threads):
    """torch.set_num_threads sets the OpenMP pool the kernel shares: 1 thread takes the
    serial path, 3 threads split a batch-1 context three ways."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        bt = make_batch([(900, 1)], 4, 1, 128, block_size=16, dtype=torch.bfloat16)
        got, want = run_both(bt, 0.1)
    finally:
        torch.set_num_threads(before)
    assert_close(got, want)


def test_missing_extension_falls_back_to_reference_with_one_warning(monkeypatch):
    monkeypatch.setattr(ops, "_ext", {})
    monkeypatch.setattr(ops.importlib, "import_module",
                        lambda name: (_ for _ in ()).throw(ImportError(f"no {name}")))
    bt = make_batch([(20, 4)], 2, 1, 16, block_size=4, dtype=torch.float32)
    with pytest.warns(RuntimeWarning, match="cpu_ops is not built"):
        got, want = run_both(bt, 0.25)
    assert torch.equal(got, want)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the second call must not warn again
        ops.paged_attention(bt.q, bt.k_cache, bt.v_cache, bt.cu_seqlens_q, bt.seq_lens,
                            bt.block_tables, 0.25)


@pytest.mark.parametrize("n", [0, 1, 63, 64, 65, 1000, 4099])
@pytest.mark.parametrize("threads", [1, 2, 3])
def test_read_sum_is_the_sum_whatever_the_split(n, threads):
    """`bench worker`'s read-bandwidth probe must read every element once (a slice lost or
    read twice would make the bandwidth figure wrong)."""
    import numpy as np

    from pipeline._ext import cpu_ops
    x = np.random.default_rng(n).integers(0, 8, n).astype(np.float32)  # exact in float32
    assert cpu_ops.read_sum(x.ctypes.data, n, threads) == float(x.sum(dtype=np.float64))
