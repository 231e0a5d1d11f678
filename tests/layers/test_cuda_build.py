"""Worker CUDA ops: every cuda_ops/*.cu compiles with nvcc, the C API header compiles as C
and C++, and (where a GPU is present) each CUDA op matches the torch reference."""
from __future__ import annotations

import ctypes
import math
import os
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
from conftest import cuda_skip_reason

from pipeline.layers import ops, ops_ref

ROOT = Path(__file__).resolve().parents[2]
CU_SOURCES = sorted((ROOT / "cuda_ops").glob("*.cu"))


def find_nvcc() -> str | None:
    home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    for cand in ([os.path.join(home, "bin", "nvcc")] if home else []) + [
            shutil.which("nvcc") or "", "/usr/local/cuda/bin/nvcc"]:
        if cand and os.path.exists(cand):
            return cand
    return None


NVCC = find_nvcc()


@pytest.mark.skipif(NVCC is None, reason="nvcc not found (set CUDA_HOME)")
@pytest.mark.parametrize("source", CU_SOURCES, ids=lambda p: p.name)
def test_nvcc_compiles(source: Path, tmp_path: Path):
    # One architecture keeps this quick; setup.py builds sm_80 and sm_90.
    cmd = [NVCC, "-c", "-O3", "-std=c++17", "-Xcompiler", "-fPIC", "-Werror", "all-warnings",
           "-gencode", "arch=compute_80,code=sm_80", f"-I{ROOT / 'cuda_ops'}",
           f"-I{ROOT / 'cython_ext'}", str(source), "-o", str(tmp_path / "out.o")]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    assert (tmp_path / "out.o").stat().st_size > 0


def test_cuda_sources_present():
    names = {p.name for p in CU_SOURCES}
    assert {"kernels.cu", "attention.cu", "layer_signal.cu"} <= names


@pytest.mark.parametrize("lang", ["c", "c++"])
def test_c_api_header_compiles(lang: str, tmp_path: Path):
    cc = shutil.which("gcc")
    if cc is None:
        pytest.skip("gcc not found")
    src = tmp_path / "use.c"
    src.write_text('#include "pipeline_cuda.h"\n'
                   "int main(void) { return PIPELINE_CUDA_OK + PIPELINE_CUDA_MAX_HEAD_DIM * 0; }\n")
    res = subprocess.run([cc, "-x", lang, "-fsyntax-only", "-Wall", "-Werror",
                          f"-I{ROOT / 'cuda_ops'}", str(src)], capture_output=True, text=True)
    assert res.returncode == 0, res.stderr


# ---- on a GPU ------------------------------------------------------------------------------

gpu = pytest.mark.skipif(cuda_skip_reason() is not None, reason=str(cuda_skip_reason()))
TOL = {torch.float32: 2e-5, torch.bfloat16: 2e-2, torch.float16: 2e-3}


@gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("heads,kv_heads,head_dim,block_size",
                         [(4, 4, 64, 16), (8, 2, 128, 64), (6, 1, 80, 16), (4, 2, 256, 8)])
def test_paged_attention_cuda_matches_reference(dtype, heads, kv_heads, head_dim, block_size):
    from test_ops import MIXED, make_batch
    bt = make_batch(MIXED + [(300, 1)], heads, kv_heads, head_dim, block_size, dtype,
                    pad_tokens=3)
    scale = 1 / math.sqrt(head_dim)
    want = ops_ref.paged_attention(bt.q, bt.k_cache, bt.v_cache, bt.cu_seqlens_q, bt.seq_lens,
                                   bt.block_tables, scale, out=torch.zeros_like(bt.q))
    dev = torch.device("cuda")
    got = ops.paged_attention(bt.q.to(dev), bt.k_cache.to(dev), bt.v_cache.to(dev),
                              bt.cu_seqlens_q.to(dev), bt.seq_lens.to(dev),
                              bt.block_tables.to(dev), scale)
    torch.cuda.synchronize()
    tol = TOL[dtype]
    torch.testing.assert_close(got.cpu().float(), want.float(), atol=tol, rtol=tol)


@gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("seqs", [[(2000, 1)], [(1000, 1), (777, 1)], [(1200, 5)]])
def test_paged_attention_cuda_split_context(dtype, seqs):
    """Few (token, head) pairs: the context is split across blocks and merged."""
    from test_ops import make_batch

    import pipeline._ext.cuda_ops as cuda_ops
    bt = make_batch(seqs, 4, 2, 128, 16, dtype, pad_tokens=2)
    tokens = bt.q.shape[0]
    assert cuda_ops.attention_splits(tokens, 4, bt.block_tables.shape[1] * 16) > 1
    want = ops_ref.paged_attention(bt.q, bt.k_cache, bt.v_cache, bt.cu_seqlens_q, bt.seq_lens,
                                   bt.block_tables, 0.09, out=torch.zeros_like(bt.q))
    dev = torch.device("cuda")
    got = ops.paged_attention(bt.q.to(dev), bt.k_cache.to(dev), bt.v_cache.to(dev),
                              bt.cu_seqlens_q.to(dev), bt.seq_lens.to(dev),
                              bt.block_tables.to(dev), 0.09)
    torch.cuda.synchronize()
    tol = TOL[dtype]
    torch.testing.assert_close(got.cpu().float(), want.float(), atol=tol, rtol=tol)


@gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_reshape_and_copy_blocks_cuda_match_reference(dtype):
    g = torch.Generator().manual_seed(3)
    shape = (9, 16, 2, 80)
    k_cache = torch.randn(shape, generator=g).to(dtype)
    v_cache = torch.randn(shape, generator=g).to(dtype)
    kv = torch.randn(37, 4, 80, generator=g).to(dtype)
    slots = torch.randperm(9 * 16, generator=g)[:37]
    slots[[1, 36]] = -1
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    ops_ref.reshape_and_cache(kv[:, :2], kv[:, 2:], k_ref, v_ref, slots)
    pairs = torch.tensor([[0, 4], [2, 8], [5, 5]])
    ops_ref.copy_blocks([k_ref], [v_ref], pairs)
    dev = torch.device("cuda")
    k_gpu, v_gpu, kv_gpu = k_cache.to(dev), v_cache.to(dev), kv.to(dev)
    ops.reshape_and_cache(kv_gpu[:, :2], kv_gpu[:, 2:], k_gpu, v_gpu, slots.to(dev))
    ops.copy_blocks([k_gpu], [v_gpu], pairs.to(dev))
    torch.cuda.synchronize()
    assert torch.equal(k_gpu.cpu(), k_ref) and torch.equal(v_gpu.cpu(), v_ref)


@gpu
def test_layer_signal_is_published_after_the_stream_work():
    # A layer-signal segment as cython_ext/shm_atomic.h lays it out: num_layers at byte 12,
    # the parker at 64 (waiting = 0, so no semaphore post), seq[] from byte 128.
    num_layers = 4
    buf = (ctypes.c_uint64 * (16 + num_layers))()
    ctypes.c_uint32.from_address(ctypes.addressof(buf) + 12).value = num_layers
    side = torch.cuda.Stream()
    x = torch.ones(1 << 20, device="cuda")
    for _ in range(20):  # work the signal must wait for
        x = x * 1.0001
    ops.enqueue_layer_signal(ctypes.addressof(buf), 41, 2, side)
    side.synchronize()
    assert buf[16 + 2] == 42  # seq = step + 1
    assert buf[16 + 1] == 0 and buf[16 + 3] == 0
