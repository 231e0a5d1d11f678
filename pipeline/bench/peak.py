"""`pipeline bench worker --peak`: prefill and batched decode against the machine's compute limit.

The limit is the peak of the instructions a format's products run on, measured in the same
run by as many threads as the worker uses, best of a few tries (the cores are shared), with no
memory traffic (``cpu_ops.peak_flops``): AMX tile products (TDPBF16PS, TDPBSSD) where the CPU
has them, else float32 FMAs for bf16 and float32 on a core with AVX2 alone (bf16 is widened to
float32 there); the choice is ``cpu_limits.peak_for``, as ``bench cpu`` makes it. A step's
useful work is its projections' multiply-adds: 2 x the parameters of every projection per
token, plus lm_head per sequence that samples (attention is left out: at these context lengths
it is a few percent). Each row also gives the bound that reading the weights once per step sets
(read bandwidth / weight bytes x batch): a batched decode step is limited by the lower of the
two. Owns nothing.
"""
from __future__ import annotations

from pipeline.bench.report import Report


def instruction_peaks(threads: int) -> dict[str, float]:
    """FLOP/s (int8: ops/s) of the instructions each format's products run on here, for the
    formats that have one measured (``cpu_limits.peak_for``)."""
    from pipeline.bench.cpu_limits import instruction_limits, peak_for
    lim = instruction_limits(threads)
    return {fmt: p for fmt in ("float32", "bf16", "int8") if (p := peak_for(fmt, lim)) is not None}


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
    rep.machine["peak_threads"] = threads
    for fmt, peak in peaks.items():
        rep.machine[f"peak_gflop_s_{fmt}"] = round(peak / 1e9, 1)
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
