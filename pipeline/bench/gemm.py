"""`pipeline bench gemm`: the packed-weight products of one decoder layer, per row count, against
BLAS on float32 weights and the instructions' peak, in the same run.

A layer of a `bench cpu` shape (random weights): its four projections (qkv, o, gate_up, down)
as ``LowpWeight`` in each --formats, multiplied by x of each --rows through
``LowpWeight.linear``, i.e. by whichever kernel ``cpu_ops.linear_route`` names (GEMV, AMX
tiles, or dequantise + BLAS); beside it ``torch.mm`` on the same
weights widened to float32 (MKL: what `--dtype float32` runs). Each figure the best of
--repeats windows of wall time (the other load of a shared machine only adds time), as ms
per layer, GFLOP/s, the fraction of the peak ``cpu_ops.peak_flops`` measures for the
instruction that route runs (AMX tiles; float32 FMAs for bf16 on an AVX2-only core), and BLAS's
time over ours. Owns nothing.
"""
from __future__ import annotations

import argparse
import functools
import sys
import time
from collections.abc import Callable

import torch

from pipeline.bench.cpu import SHAPES
from pipeline.bench.cpu_limits import measure_peaks, peak_for
from pipeline.bench.report import Report


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--shape", default="0.5b", choices=list(SHAPES), help="a `bench cpu` shape")
    p.add_argument("--formats", default="bf16,int8", help="comma-separated: bf16, int8, int4 "
                   "(groups of 128, symmetric: `--quantization int4`'s default)")
    p.add_argument("--rows", default="1,4,8,16,32,512,2048", help="comma-separated row counts")
    p.add_argument("--threads", type=int, default=0, help="0: every usable core")
    p.add_argument("--repeats", type=int, default=5, help="timed windows; the best is kept")


def _best(fn: Callable[[], None], repeats: int, reps: int) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        for _ in range(reps):
            fn()
        best = min(best, (time.perf_counter() - t) / reps)
    return best


def _ours(packed: list, xs: list[torch.Tensor], outs: list[torch.Tensor]) -> None:
    for p, x, o in zip(packed, xs, outs):
        p.linear(x, out=o)


def _blas(dense: list[torch.Tensor], xs: list[torch.Tensor], outs: list[torch.Tensor]) -> None:
    for d, x, o in zip(dense, xs, outs):
        torch.mm(x, d.t(), out=o)


def main(args: argparse.Namespace) -> int:
    from pipeline._ext import cpu_ops
    from pipeline.layers.int4 import Int4Weight
    from pipeline.layers.lowp import LowpWeight
    from pipeline.worker.threads import usable_cores
    rows = [int(r) for r in args.rows.split(",") if r]
    formats = [f for f in args.formats.split(",") if f]
    if not rows or min(rows) < 1 or args.repeats < 1 or args.threads < 0:
        print("bench gemm: --rows must be integers >= 1, --repeats >= 1, --threads >= 0")
        return 2
    if any(f not in ("bf16", "int8", "int4") for f in formats):
        print(f"bench gemm: --formats: bf16, int8 and int4 only, got {args.formats!r}")
        return 2
    threads = args.threads or usable_cores()
    torch.set_num_threads(threads)
    s = SHAPES[args.shape]
    h, inter = s["hidden_size"], s["intermediate_size"]
    hd = h // s["num_heads"]
    shapes = [(hd * (s["num_heads"] + 2 * s["num_kv_heads"]), h), (h, hd * s["num_heads"]),
              (2 * inter, h), (h, inter)]
    g = torch.Generator().manual_seed(0)
    floats = [torch.randn(n, k, generator=g) / k ** 0.5 for n, k in shapes]
    rep = Report("gemm")
    peaks = measure_peaks(threads)
    rep.machine.update(threads=threads, shape=args.shape,
                       **{f"peak_{k}_gflop_s": round(v / 1e9, 1) for k, v in peaks.items()})
    lim = {"isa": cpu_ops.lp_isa("bf16", h), **{f"peak_{k}_flops": v for k, v in peaks.items()}}
    for fmt in formats:
        packed = [Int4Weight.from_float(w, 128, torch.float32) if fmt == "int4"
                  else LowpWeight(w.clone(), fmt, torch.float32) for w in floats]
        dense = [p.dense(torch.float32).clone() for p in packed]  # BLAS's operand: the same values
        for m in rows:
            xs = [torch.randn(m, k, generator=g) for _, k in shapes]
            outs = [torch.empty(m, n) for n, _ in shapes]

            reps = max(1, 64 // m)
            t_ours = _best(functools.partial(_ours, packed, xs, outs), args.repeats, reps)
            t_blas = _best(functools.partial(_blas, dense, xs, outs), args.repeats, reps)
            flop = sum(2.0 * m * n * k for n, k in shapes)
            route = cpu_ops.linear_route(fmt, m, h)
            # the peak of the instruction that ran: not AMX's for a GEMV row on an AMX CPU
            peak = peak_for(fmt, lim) if route == "amx" or lim["isa"] == "avx2" else None
            row = rep.add(f"{fmt} rows {m}", route=route, ms=round(t_ours * 1e3, 3),
                          gflop_s=round(flop / t_ours / 1e9, 1), blas_f32_ms=round(t_blas * 1e3, 3),
                          blas_over_ours=round(t_blas / t_ours, 3))
            if peak:
                row["peak_fraction"] = round(flop / t_ours / peak, 3)
    return rep.emit(args.json, sys.stdout)  # the current stdout, not the one at import
