"""Worker CUDA ops on a GPU, against pipeline.layers.ops_ref: the cases a first GPU run must
cover beyond tests/layers/test_cuda_build.py (forced context splits including empty ones, decode,
chunked prefill with context, empty sequences and padding rows, q/k/v sliced from a fused qkv
projection, every head_dim bucket up to 256, block_size 1, work on a non-default stream,
zero-sized launches, error codes, out-of-range ids skipped, cache offsets past 2^31 elements,
and many stream-ordered layer signals). Everything here skips without CUDA."""
from __future__ import annotations

import ctypes
import math

import pytest
import torch
from conftest import cuda_skip_reason
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline.layers import ops, ops_ref

pytestmark = pytest.mark.skipif(cuda_skip_reason() is not None, reason=str(cuda_skip_reason()))
TOL = {torch.float32: 1e-4, torch.bfloat16: 2e-2, torch.float16: 2e-3}
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
DEV = torch.device("cuda")


def _batch(seqs, heads, kv_heads, head_dim, block_size, dtype, pad_tokens=0, seed=0):
    from test_ops import make_batch
    return make_batch(seqs, heads, kv_heads, head_dim, block_size, dtype, seed=seed,
                      pad_tokens=pad_tokens)


def _want(bt, scale):
    return ops_ref.paged_attention(bt.q, bt.k_cache, bt.v_cache, bt.cu_seqlens_q, bt.seq_lens,
                                   bt.block_tables, scale, out=torch.zeros_like(bt.q))


def _close(got, want):
    tol = TOL[want.dtype]
    torch.testing.assert_close(got.cpu().float(), want.float(), atol=tol, rtol=tol)


def _gpu(bt):
    return [t.to(DEV) for t in (bt.q, bt.k_cache, bt.v_cache, bt.cu_seqlens_q, bt.seq_lens,
                                bt.block_tables)]


def _direct(q, k_cache, v_cache, cu, lens, tables, scale, num_splits, out=None):
    """cuda_ops.paged_attention with a forced split count (ops picks one from the SM count)."""
    import pipeline._ext.cuda_ops as cuda_ops
    num_blocks, block_size, kv_heads, head_dim = k_cache.shape
    tokens, heads = q.shape[0], q.shape[1]
    out = torch.full_like(q, float("nan")) if out is None else out
    ws = torch.empty(tokens * heads * num_splits * (head_dim + 2), device=DEV)
    cuda_ops.paged_attention(out.data_ptr(), q.data_ptr(), k_cache.data_ptr(),
                             v_cache.data_ptr(), cu.data_ptr(), lens.data_ptr(),
                             tables.data_ptr(), lens.shape[0], tokens, q.stride(0), heads,
                             kv_heads, head_dim, num_blocks, block_size, tables.shape[1],
                             scale, ops.dtype_code(q.dtype),
                             torch.cuda.current_stream().cuda_stream, num_splits,
                             ws.data_ptr() if num_splits > 1 else 0)
    torch.cuda.synchronize()
    return out


MIXED = [(1, 1), (17, 1), (40, 40), (33, 5), (16, 16), (70, 1), (9, 9), (48, 16), (300, 1)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_splits", [1, 2, 7, 32])
def test_forced_splits_match_reference(dtype, num_splits):
    """32 splits of a 320-key table leave most splits of the short sequences empty."""
    bt = _batch(MIXED, 8, 2, 128, 16, dtype, pad_tokens=3)
    got = _direct(*_gpu(bt), 0.08, num_splits)
    _close(got, _want(bt, 0.08))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [32, 40, 64, 72, 96, 128, 192, 256])
def test_every_head_dim_bucket(dtype, head_dim):
    bt = _batch([(50, 50), (129, 7), (5, 1)], 4, 2, head_dim, 16, dtype, pad_tokens=1)
    scale = 1 / math.sqrt(head_dim)
    _close(ops.paged_attention(*_gpu(bt), scale), _want(bt, scale))
    _close(_direct(*_gpu(bt), scale, 3), _want(bt, scale))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_decode_batch_gqa(dtype):
    seqs = [(n, 1) for n in (1, 2, 15, 16, 17, 63, 64, 65, 255, 1000)]
    bt = _batch(seqs, 16, 4, 128, 16, dtype, pad_tokens=4)
    _close(ops.paged_attention(*_gpu(bt), 0.1), _want(bt, 0.1))


@pytest.mark.parametrize("block_size", [1, 8, 32])
def test_chunked_prefill_with_context(block_size):
    seqs = [(100, 37), (64, 64), (513, 128), (200, 1), (33, 32)]
    bt = _batch(seqs, 6, 3, 64, block_size, torch.bfloat16, pad_tokens=2)
    _close(ops.paged_attention(*_gpu(bt), 0.125), _want(bt, 0.125))
    _close(_direct(*_gpu(bt), 0.125, 5), _want(bt, 0.125))


@pytest.mark.parametrize("num_splits", [1, 4])
def test_empty_sequences_and_padding_rows(num_splits):
    """q_len 0 sequences first, in the middle and last; padding rows come back as zeros."""
    seqs = [(12, 0), (20, 3), (7, 0), (31, 1), (9, 9), (40, 0)]
    bt = _batch(seqs, 4, 1, 64, 8, torch.float32, pad_tokens=5)
    got = _direct(*_gpu(bt), 0.2, num_splits)
    _close(got, _want(bt, 0.2))
    assert torch.all(got[-5:] == 0)


@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_qkv_slices(dtype):
    """q, k and v are strided row slices of one [T, (H + 2 Hkv) * D] projection output."""
    heads, kv_heads, head_dim, block_size = 8, 2, 64, 16
    seqs = [(30, 30), (50, 10), (17, 1)]
    bt = _batch(seqs, heads, kv_heads, head_dim, block_size, dtype)
    tokens = bt.q.shape[0]
    g = torch.Generator().manual_seed(5)
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, generator=g).to(dtype)
    q, k, v = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    q = q.view(tokens, heads, head_dim)
    k = k.view(tokens, kv_heads, head_dim)
    v = v.view(tokens, kv_heads, head_dim)
    # Slots of each sequence's new tokens: the last q_len positions of its context.
    slots = []
    for b, (ctx, q_len) in enumerate(seqs):
        for p in range(ctx - q_len, ctx):
            slots.append(int(bt.block_tables[b, p // block_size]) * block_size + p % block_size)
    slots = torch.tensor(slots, dtype=torch.int64)
    k_ref, v_ref = bt.k_cache.clone(), bt.v_cache.clone()
    ops_ref.reshape_and_cache(k, v, k_ref, v_ref, slots)
    want = ops_ref.paged_attention(q, k_ref, v_ref, bt.cu_seqlens_q, bt.seq_lens,
                                   bt.block_tables, 0.125)
    qkv_g = qkv.to(DEV)
    qg, kg, vg = qkv_g.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], -1)
    qg = qg.view(tokens, heads, head_dim)
    k_cache, v_cache = bt.k_cache.to(DEV), bt.v_cache.to(DEV)
    ops.reshape_and_cache(kg.view(tokens, kv_heads, head_dim), vg.view(tokens, kv_heads, head_dim),
                          k_cache, v_cache, slots.to(DEV))
    got = ops.paged_attention(qg, k_cache, v_cache, bt.cu_seqlens_q.to(DEV),
                              bt.seq_lens.to(DEV), bt.block_tables.to(DEV), 0.125)
    torch.cuda.synchronize()
    assert torch.equal(k_cache.cpu(), k_ref) and torch.equal(v_cache.cpu(), v_ref)
    _close(got, want)


def test_ops_run_on_the_current_stream():
    """Inputs produced on a side stream are consumed there without any synchronisation."""
    bt = _batch(MIXED, 8, 2, 128, 16, torch.bfloat16, pad_tokens=1)
    want = _want(bt, 0.1)
    side = torch.cuda.Stream()
    host = [t.pin_memory() for t in (bt.q, bt.k_cache, bt.v_cache, bt.cu_seqlens_q,
                                     bt.seq_lens, bt.block_tables)]
    with torch.cuda.stream(side):
        dev = [t.to(DEV, non_blocking=True) for t in host]
        got = ops.paged_attention(*dev, 0.1)
        res = got.to("cpu", non_blocking=True)
    side.synchronize()
    _close(res, want)


def test_zero_sized_launches_are_no_ops():
    import pipeline._ext.cuda_ops as cuda_ops
    k_cache = torch.zeros(4, 16, 2, 64, device=DEV)
    v_cache = torch.zeros_like(k_cache)
    kv = torch.empty(0, 2, 64, device=DEV)
    ops.reshape_and_cache(kv, kv, k_cache, v_cache, torch.empty(0, dtype=torch.int64, device=DEV))
    ops.copy_blocks([k_cache], [v_cache], torch.empty(0, 2, dtype=torch.int64, device=DEV))
    q = torch.empty(0, 4, 64, device=DEV)
    cu = torch.zeros(1, dtype=torch.int32, device=DEV)
    lens = torch.zeros(0, dtype=torch.int32, device=DEV)
    tables = torch.zeros(0, 2, dtype=torch.int32, device=DEV)
    assert ops.paged_attention(q, k_cache, v_cache, cu, lens, tables, 0.1).shape == (0, 4, 64)
    assert cuda_ops.paged_attention(0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 4, 2, 64, 4, 16, 2, 0.1,
                                    0) == -1
    torch.cuda.synchronize()
    assert not k_cache.any()


def test_bad_arguments_give_named_errors():
    import pipeline._ext.cuda_ops as cuda_ops
    base = dict(num_seqs=1, num_tokens=1, q_stride=256, num_heads=4, num_kv_heads=2,
                head_dim=64, num_blocks=4, block_size=16, max_blocks=2, scale=0.1, dtype=0)

    def call(num_splits=1, **kw):
        a = {**base, **kw}
        return cuda_ops.paged_attention(0, 0, 0, 0, 0, 0, 0, *a.values(),
                                        stream=0, num_splits=num_splits, workspace=0)

    with pytest.raises(RuntimeError, match="workspace"):
        call(num_splits=2)
    with pytest.raises(RuntimeError, match="head_dim"):
        call(head_dim=512)
    with pytest.raises(RuntimeError, match="num_kv_heads"):
        call(num_heads=6, num_kv_heads=4)
    with pytest.raises(RuntimeError, match="dtype"):
        call(dtype=7)


@pytest.mark.parametrize("dtype,head_dim", [(torch.bfloat16, 64), (torch.float16, 5)])
def test_copy_blocks_layers_and_out_of_range_ids(dtype, head_dim):
    """Several layers; ids outside [0, num_blocks) are skipped, not written out of bounds.
    head_dim 5 with fp16 and block_size 1 makes blocks 10 bytes (the unvectorised path)."""
    block_size = 1 if head_dim == 5 else 16
    g = torch.Generator().manual_seed(2)
    shape = (8, block_size, 1, head_dim)
    arena = torch.randn(3 * 2 * 8 + 2, block_size, 1, head_dim, generator=g).to(dtype)
    # Each layer's caches sit between guard blocks of one arena, so a stray write shows up.
    assert all(arena[1 + 16 * i:9 + 16 * i].shape == shape for i in range(3))
    good = torch.tensor([[0, 5], [3, 6], [7, 7]])
    bad = torch.tensor([[-1, 2], [1, 8], [8, 1], [2, -3]])
    ref = arena.clone()
    ops_ref.copy_blocks([ref[1 + 16 * i:9 + 16 * i] for i in range(3)],
                        [ref[9 + 16 * i:17 + 16 * i] for i in range(3)], good)
    garena = arena.to(DEV)
    gk = [garena[1 + 16 * i:9 + 16 * i] for i in range(3)]
    gv = [garena[9 + 16 * i:17 + 16 * i] for i in range(3)]
    ops.copy_blocks(gk, gv, torch.cat([bad[:2], good, bad[2:]]).to(DEV))
    torch.cuda.synchronize()
    assert torch.equal(garena.cpu(), ref)


def test_reshape_and_cache_skips_bad_slots():
    k_cache = torch.zeros(2, 4, 1, 32, device=DEV)
    v_cache = torch.zeros_like(k_cache)
    kv = torch.ones(4, 1, 32, device=DEV)
    ops.reshape_and_cache(kv, kv * 2, k_cache, v_cache,
                          torch.tensor([-1, 8, 1 << 40, 3], device=DEV))
    torch.cuda.synchronize()
    assert k_cache.view(8, 32).sum(-1).tolist() == [0, 0, 0, 32, 0, 0, 0, 0]
    assert v_cache.view(8, 32).sum(-1).tolist() == [0, 0, 0, 64, 0, 0, 0, 0]


def test_cache_offsets_past_int32():
    """Blocks whose element offsets exceed 2^31 (bf16 caches of 4 GiB each)."""
    block_size, kv_heads, head_dim = 16, 1, 128
    per_block = block_size * kv_heads * head_dim
    hi = (1 << 31) // per_block + 8  # first block past 2^31 elements
    free, _ = torch.cuda.mem_get_info()
    bt = _batch([(100, 10), (37, 1), (64, 64)], 4, kv_heads, head_dim, block_size,
                torch.bfloat16)
    nb = bt.k_cache.shape[0]
    total = hi + 2 * nb + 2
    if free < 3 * total * per_block * 2:
        pytest.skip(f"needs {3 * total * per_block * 2 >> 30} GiB free on the GPU")
    k_big = torch.empty(total, block_size, kv_heads, head_dim, dtype=torch.bfloat16, device=DEV)
    v_big = torch.empty_like(k_big)
    k_big[hi:hi + nb] = bt.k_cache.to(DEV)
    v_big[hi:hi + nb] = bt.v_cache.to(DEV)
    tables = torch.where(bt.block_tables >= 0, bt.block_tables + hi, bt.block_tables)
    got = ops.paged_attention(bt.q.to(DEV), k_big, v_big, bt.cu_seqlens_q.to(DEV),
                              bt.seq_lens.to(DEV), tables.to(DEV), 0.1)
    _close(got, _want(bt, 0.1))
    got = _direct(bt.q.to(DEV), k_big, v_big, bt.cu_seqlens_q.to(DEV), bt.seq_lens.to(DEV),
                  tables.to(DEV), 0.1, 4)
    _close(got, _want(bt, 0.1))
    kv = torch.randn(3, kv_heads, head_dim).to(torch.bfloat16)
    slots = torch.tensor([0, 17, nb * block_size - 1])
    k_ref = bt.k_cache.clone()
    ops_ref.reshape_and_cache(kv, kv, k_ref, bt.v_cache.clone(), slots)
    ops.reshape_and_cache(kv.to(DEV), kv.to(DEV), k_big, v_big, (slots + hi * block_size).to(DEV))
    ops.copy_blocks([k_big], [v_big], torch.tensor([[hi + 1, hi + nb + 1]], device=DEV))
    torch.cuda.synchronize()
    assert torch.equal(k_big[hi:hi + nb].cpu(), k_ref)
    assert torch.equal(k_big[hi + nb + 1].cpu(), k_ref[1])


@settings(max_examples=25, deadline=None, derandomize=True)
@given(
    seqs=st.lists(st.tuples(st.integers(1, 300), st.integers(0, 40)), min_size=1, max_size=6),
    kv_heads=st.sampled_from([1, 2, 4]),
    group=st.sampled_from([1, 2, 4]),
    head_dim=st.sampled_from([16, 64, 80, 128, 256]),
    block_size=st.sampled_from([1, 8, 16]),
    dtype=st.sampled_from(DTYPES),
    num_splits=st.sampled_from([1, 3, 9]),
)
def test_random_batches_match_reference(seqs, kv_heads, group, head_dim, block_size, dtype,
                                        num_splits):
    seqs = [(s, min(q, s)) for s, q in seqs]
    bt = _batch(seqs, kv_heads * group, kv_heads, head_dim, block_size, dtype, pad_tokens=1)
    _close(_direct(*_gpu(bt), 0.1, num_splits), _want(bt, 0.1))


def test_many_layer_signals_publish_in_stream_order():
    """Each layer's host function publishes that layer's step; a layer index past the
    segment's num_layers is ignored by pipeline_signal_publish."""
    num_layers = 8
    buf = (ctypes.c_uint64 * (16 + num_layers))()
    ctypes.c_uint32.from_address(ctypes.addressof(buf) + 12).value = num_layers
    side = torch.cuda.Stream()
    cache = torch.zeros(1 << 20, device=DEV)
    for step in range(50):
        for layer in range(num_layers + 1):
            cache.add_(1.0)  # the "KV write" the signal is ordered after
            ops.enqueue_layer_signal(ctypes.addressof(buf), step, layer, side)
    side.synchronize()
    assert [buf[16 + i] for i in range(num_layers)] == [50] * num_layers
    assert float(cache[0]) == 50 * (num_layers + 1)
