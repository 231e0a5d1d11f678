"""`pipeline bench worker --peak`: prefill and batched decode against the machine's compute limit.

The limit is the peak of the instructions a format's products run on, measured in the same
run, best of a few tries (the cores are shared), with no memory traffic. On a CPU
(``cpu_ops.peak_flops``, as many threads as the worker uses): AMX tile products (TDPBF16PS,
TDPBSSD) where the CPU has them, else float32 FMAs for bf16 and float32 on a core with AVX2
alone (bf16 is widened to float32 there); the choice is ``cpu_limits.peak_for``, as ``bench
cpu`` makes it. On a GPU (``cuda_peaks``): a large square matrix product in bf16 (tensor cores)
and in float32 (TF32 off, as the worker's float32 layers run). A step's useful work is its
projections' multiply-adds (2 x the parameters of every projection per token, plus lm_head per
sequence that samples) and, for prefill, causal attention's two products (2 x 2 x q_dim x
L(L+1)/2 per layer for a prompt of L tokens; a decode step's is left out: at these context
lengths it is a few percent). Each decode row also gives the bound that reading the weights
once per step sets (read bandwidth / weight bytes x batch): a batched decode step is limited
by the lower of the two. Owns nothing.
"""
from __future__ import annotations

import torch

from pipeline.bench.report import Report


def instruction_peaks(threads: int) -> dict[str, float]:
    """FLOP/s (int8: ops/s) of the instructions each format's products run on here, for the
    formats that have one measured (``cpu_limits.peak_for``)."""
    from pipeline.bench.cpu_limits import instruction_limits, peak_for
    lim = instruction_limits(threads)
    return {fmt: p for fmt in ("float32", "bf16", "int8") if (p := peak_for(fmt, lim)) is not None}


def cuda_peaks(n: int = 8192, reps: int = 5) -> dict[str, float]:
    """FLOP/s of an n x n x n matrix product on the current GPU per format, best of ``reps``
    timed with CUDA events: bf16 on the tensor cores, float32 as the worker's float32 layers
    run (TF32 off, torch's default)."""
    peaks = {}
    for fmt, dtype in (("float32", torch.float32), ("bf16", torch.bfloat16)):
        a = torch.randn(n, n, device="cuda", dtype=dtype)
        b = torch.randn(n, n, device="cuda", dtype=dtype)
        c = a @ b  # warm-up: cuBLAS picks its kernel
        inner = 2 if dtype == torch.float32 else 10
        best = float("inf")
        for _ in range(reps):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(inner):
                torch.mm(a, b, out=c)
            end.record()
            end.synchronize()
            best = min(best, start.elapsed_time(end) / 1e3 / inner)
        peaks[fmt] = 2.0 * n ** 3 / best
        del a, b, c
    torch.cuda.empty_cache()
    return peaks


def projection_params(model_dir: str) -> tuple[int, int, int]:
    """(parameters of every decoder projection, of lm_head, num_layers x q_dim: the width
    causal attention's products run over) of the checkpoint's config."""
    from pipeline.models.config import load_model_config
    c = load_model_config(model_dir)
    q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    h, inter = c.hidden_size, c.intermediate_size
    layer = h * (q + 2 * kv) + q * h + h * 2 * inter + inter * h
    return c.num_layers * layer, c.vocab_size * h, c.num_layers * q


def add_peak_rows(rep: Report, runs: dict, batches: list[int], prefill_tokens: int, prefill_seqs: int,
                  params: tuple[int, int, int], peaks: dict[str, float], read_bw: float) -> None:
    """Per format with a peak: decode at each batch above 1 and the prefill step (``prefill_seqs``
    prompts of ``prefill_tokens`` in all) as GFLOP/s, and as a fraction of the peak and of the
    weight-read bound (params: from ``projection_params``; peaks: ``instruction_peaks`` or
    ``cuda_peaks``)."""
    for fmt, peak in peaks.items():
        rep.machine[f"peak_gflop_s_{fmt}"] = round(peak / 1e9, 1)
    layer_p, head_p, attn_width = params
    for fmt, (decode, prefill, weight_bytes) in runs.items():
        if fmt not in peaks:
            continue
        peak = peaks[fmt]
        for b in batches:
            if b < 2:
                continue
            decode_flop = 2.0 * (layer_p + head_p)  # per token
            gflop = decode[b] * decode_flop / 1e9
            bound = min(peak / decode_flop, read_bw / weight_bytes * b)
            rep.add(f"decode batch {b} {fmt} vs peak", pipeline_tok_s=decode[b],
                    gflop_s=gflop, peak_fraction=gflop * 1e9 / peak,
                    bound_tok_s=bound, bound_fraction=decode[b] / bound)
        length = prefill_tokens // prefill_seqs  # one lm_head row per prompt
        prefill_flop = (2.0 * layer_p + 2.0 * head_p * prefill_seqs / prefill_tokens
                        + 2.0 * attn_width * (length + 1))  # per token
        gflop = prefill * prefill_flop / 1e9
        rep.add(f"prefill {prefill_tokens} tokens {fmt} vs peak", pipeline_tok_s=prefill,
                gflop_s=gflop, peak_fraction=gflop * 1e9 / peak)
