"""`pipeline bench worker --peak`: prefill and batched decode against the machine's compute limit.

The limit is the peak of the instructions the bf16 and int8 products run on, measured in the
same run: AMX tile products (TDPBF16PS, TDPBSSD) issued back to back on tiles loaded once, with
no memory traffic (``cpu_ops.amx_peak``), by as many threads as the worker uses, best of a few
tries (the cores are shared). A step's useful work is its projections' multiply-adds: 2 x the
parameters of every projection per token, plus lm_head per sequence that samples (attention is
left out: at these context lengths it is a few percent). Each row also gives the bound that
reading the weights once per step sets (read bandwidth / weight bytes x batch): a batched decode
step is limited by the lower of the two. Owns nothing.
"""
from __future__ import annotations

from pipeline.bench.report import Report

PEAK_ITERS = 200_000  # 4 tile products each: ~0.1 s at 1 TFLOP/s per thread


def instruction_peaks(threads: int, tries: int = 5) -> dict[str, float]:
    """FLOP/s (int8: ops/s) of the AMX tile products per format; empty without AMX."""
    from pipeline._ext import cpu_ops
    if not cpu_ops.amx_ok():
        return {}
    return {fmt: max(cpu_ops.amx_peak(kind, PEAK_ITERS, threads) for _ in range(tries))
            for fmt, kind in (("bf16", 0), ("int8", 1))}


def projection_params(model_dir: str) -> tuple[int, int]:
    """(parameters of every decoder projection, of lm_head) of the checkpoint's config."""
    from pipeline.models.config import load_model_config
    c = load_model_config(model_dir)
    q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    h, inter = c.hidden_size, c.intermediate_size
    layer = h * (q + 2 * kv) + q * h + h * 2 * inter + inter * h
    return c.num_layers * layer, c.vocab_size * h


def add_peak_rows(rep: Report, runs: dict, batches: list[int], prefill_tokens: int,
                  params: tuple[int, int], threads: int, read_bw: float) -> None:
    """Per packed format: decode at each batch above 1 and the prefill step as GFLOP/s, and as
    a fraction of the instruction peak and of the weight-read bound (params: from
    ``projection_params``)."""
    peaks = instruction_peaks(threads)
    rep.machine["amx_threads"] = threads
    for fmt, peak in peaks.items():
        rep.machine[f"amx_peak_gflop_s_{fmt}"] = round(peak / 1e9, 1)
    layer_p, head_p = params
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
        seqs = 4  # bench_formats' prefill step: 4 sequences, one lm_head row each
        prefill_flop = 2.0 * layer_p + 2.0 * head_p * seqs / prefill_tokens  # per token
        gflop = prefill * prefill_flop / 1e9
        rep.add(f"prefill {prefill_tokens} tokens {fmt} vs peak", pipeline_tok_s=prefill,
                gflop_s=gflop, peak_fraction=gflop * 1e9 / peak)
