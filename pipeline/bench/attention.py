"""`pipeline bench attention`: the CPU paged-attention kernel of one layer of a `bench cpu` shape,
decode and prefill, against the FMA peak and the read bandwidth measured in the same run.

The heads of a shape (num_heads, num_kv_heads, head_dim) over a paged KV cache in --kv-dtype,
its blocks scattered at random as a serving engine leaves them, float32 queries (what the
bf16/int8 CPU models run). Cases: a decode step of --batch sequences at each of --contexts
(one query token each), and a fresh prefill of --prefill-seqs prompts of --prefill-len tokens
(causal). Each the best of --repeats windows of wall time, as ms per layer call, GFLOP/s (4 x
heads x head_dim per query token and visible key: the two products; softmax not counted), the
fraction of the float32 FMA peak (``cpu_ops.peak_flops``), and for decode the cache bytes read
per second against the read bandwidth (``bench/bandwidth.py``): a decode call reads every key
and value of its sequences once. Owns nothing.
"""
from __future__ import annotations

import argparse
import functools
import sys

import torch

from pipeline.bench.cpu import SHAPES
from pipeline.bench.gemm import _best
from pipeline.bench.report import Report

BLOCK_SIZE = 16  # the CPU default (config.block_size = 0)
Call = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, float]
_DTYPES = {"bf16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--shape", default="0.5b", choices=list(SHAPES), help="a `bench cpu` shape")
    p.add_argument("--batch", type=int, default=32, help="decode sequences")
    p.add_argument("--contexts", default="200,1000", help="decode context lengths, comma-separated")
    p.add_argument("--prefill-seqs", type=int, default=16)
    p.add_argument("--prefill-len", type=int, default=128, help="tokens per prompt")
    p.add_argument("--kv-dtype", default="bf16", choices=list(_DTYPES))
    p.add_argument("--threads", type=int, default=0, help="0: every usable core")
    p.add_argument("--repeats", type=int, default=5, help="timed windows; the best is kept")


def _case(heads: int, kv_heads: int, head_dim: int, seqs: int, ctx: int, q_len: int,
          dtype: torch.dtype, g: torch.Generator) -> tuple[Call, float, int]:
    """paged_attention's arguments for ``seqs`` sequences of ``ctx`` keys whose last ``q_len``
    tokens query; the products' FLOPs; the cache bytes a call reads."""
    per = -(-ctx // BLOCK_SIZE)
    blocks = seqs * per + 1
    shape = (blocks, BLOCK_SIZE, kv_heads, head_dim)
    k = torch.randn(shape, generator=g).to(dtype)
    v = torch.randn(shape, generator=g).to(dtype)
    q = torch.randn(seqs * q_len, heads, head_dim, generator=g)
    cu = torch.arange(0, seqs * q_len + 1, q_len, dtype=torch.int32)
    lens = torch.full((seqs,), ctx, dtype=torch.int32)
    tables = torch.randperm(blocks, generator=g)[:seqs * per].view(seqs, per).to(torch.int32)
    visible = q_len * ctx - q_len * (q_len - 1) // 2  # per sequence, causal
    flop = 4.0 * heads * head_dim * seqs * visible
    read = 2 * seqs * ctx * kv_heads * head_dim * k.element_size()
    return (q, k, v, cu, lens, tables, head_dim ** -0.5), flop, read


def main(args: argparse.Namespace) -> int:
    from pipeline.bench.bandwidth import read_bandwidth
    from pipeline.bench.cpu_limits import measure_peaks
    from pipeline.layers import ops
    from pipeline.worker.threads import usable_cores
    try:
        contexts = [int(c) for c in args.contexts.split(",") if c]
    except ValueError:
        contexts = []
    bad = [f"--{k} must be >= {lo}" for k, lo in (("batch", 1), ("prefill-seqs", 0), ("prefill-len", 1),
                                                   ("repeats", 1), ("threads", 0))
           if getattr(args, k.replace("-", "_")) < lo]
    if not contexts or min(contexts) < 1:
        bad.insert(0, f"--contexts must be comma-separated integers >= 1, got {args.contexts!r}")
    if bad:
        print(f"bench attention: {'; '.join(bad)}")
        return 2
    threads = args.threads or usable_cores()
    torch.set_num_threads(threads)
    s = SHAPES[args.shape]
    heads, kv_heads = s["num_heads"], s["num_kv_heads"]
    head_dim = s["hidden_size"] // heads
    dtype = _DTYPES[args.kv_dtype]
    peak = measure_peaks(threads).get("fp32_fma")
    bandwidth = read_bandwidth()
    rep = Report("attention")
    rep.machine.update(threads=threads, shape=args.shape, kv_dtype=args.kv_dtype,
                       heads=heads, kv_heads=kv_heads, head_dim=head_dim,
                       read_gb_s=round(bandwidth / 1e9, 1),
                       peak_fp32_fma_gflop_s=round(peak / 1e9, 1) if peak else None)
    g = torch.Generator().manual_seed(0)
    cases = [(f"decode batch {args.batch} context {c}", args.batch, c, 1) for c in contexts]
    if args.prefill_seqs:
        cases.append((f"prefill {args.prefill_seqs} x {args.prefill_len}", args.prefill_seqs,
                      args.prefill_len, args.prefill_len))
    for name, seqs, ctx, q_len in cases:
        call, flop, read = _case(heads, kv_heads, head_dim, seqs, ctx, q_len, dtype, g)
        out = torch.empty_like(call[0])
        t = _best(functools.partial(ops.paged_attention, *call, out=out), args.repeats,
                  max(1, int(2e8 // flop)))
        row = rep.add(name, ms=round(t * 1e3, 5), gflop_s=round(flop / t / 1e9, 2))
        if peak:
            row["peak_fraction"] = round(flop / t / peak, 3)
        if q_len == 1:
            row["read_gb_s"] = round(read / t / 1e9, 2)
            row["bandwidth_fraction"] = round(read / t / bandwidth, 3)
    return rep.emit(args.json, sys.stdout)
