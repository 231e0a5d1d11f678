"""`pipeline bench cpu`: the machine's limits, measured in the same run, and the bytes a decode
step must read, so that every figure can be set against physics.

- DRAM read bandwidth: ``bench worker``'s parallel read of 1 GiB (vector loads, all threads).
- Peak FLOP/s of the instructions the kernels use, where the CPU has them
  (``cpu_ops.peak_flops(kind, threads)``: an in-register loop with no memory traffic): AMX
  tiles, or AVX2 float32 FMAs (float32, and bf16 on a core with AVX2 alone).
- Step bytes: every projection and the LM head once (the embedding is only looked up, unless
  tied: then it is the LM head), at the format's bytes per weight (int8 and int4 with their
  scales). A batch-1 decode cannot beat bandwidth / step bytes.
Owns nothing.
"""
from __future__ import annotations

import functools
from typing import Any

# Bytes per weight, scales included (int8: one float32 per output row of ~1k inputs; int4:
# a 2-byte scale per group of 32-128 with a zero point at most).
_BYTES = {"float32": 4.0, "bf16": 2.0, "int8": 1.0 + 4 / 896, "int4": 0.5 + 4 / 64}


@functools.lru_cache(maxsize=8)
def _params(model: str) -> tuple[int, int]:
    """(the layers' projection weights, the LM head's) of the checkpoint's config (read once:
    the HTTP figures ask per request)."""
    from pipeline.models.config import load_model_config
    c = load_model_config(model)
    per_layer = (c.hidden_size * (c.q_size + 2 * c.kv_size) + c.q_size * c.hidden_size
                 + 3 * c.hidden_size * c.intermediate_size)
    return c.num_layers * per_layer, c.vocab_size * c.hidden_size


def step_params(model: str) -> int:
    """Weights one decode step reads: the layers' projections and the LM head."""
    return sum(_params(model))


def weight_bytes(model: str, fmt: str) -> float:
    return step_params(model) * _BYTES[fmt]


def prefill_flops(model: str, seqs: int, tokens: int) -> float:
    """Multiply-adds x 2 of a prefill of ``seqs`` prompts of ``tokens``: every projection
    per token, the LM head once per prompt (attention left out: a few percent at 128)."""
    layers, head = _params(model)
    return 2.0 * layers * seqs * tokens + 2.0 * head * seqs


def served_flops(model: str, prompt_tokens: int, output_tokens: int) -> float:
    """Multiply-adds x 2 of serving one request: its prompt's prefill (whose LM head gives the
    first token) and a decode step per later token, LM head included (attention left out)."""
    layers, head = _params(model)
    return prefill_flops(model, 1, prompt_tokens) + 2.0 * (layers + head) * max(output_tokens - 1, 0)


def peak_for(fmt: str, lim: dict[str, Any]) -> float | None:
    """The peak of the instructions a format's products at batch run on here: AMX tiles for
    bf16/int8 where the CPU has them; float32 FMAs for bf16 and float32 on a core with AVX2
    alone; None where it was not measured (int8's VPMADDUBSW, AVX-512 without AMX)."""
    amx = {"bf16": "peak_amx_bf16_flops", "int8": "peak_amx_int8_flops"}.get(fmt, "")
    if amx in lim:
        return float(lim[amx])
    if fmt in ("bf16", "float32") and lim.get("isa") == "avx2" and "peak_fp32_fma_flops" in lim:
        return float(lim["peak_fp32_fma_flops"])
    return None


def limits(threads: int) -> dict[str, Any]:
    import torch

    from pipeline.bench.bandwidth import read_bandwidth
    torch.set_num_threads(threads)
    return {"threads": threads, "read_bytes_per_s": read_bandwidth()} | instruction_limits(threads)


def instruction_limits(threads: int) -> dict[str, Any]:
    """The bf16 kernels' vector body here ("isa") and the peaks ``peak_for`` chooses from."""
    from pipeline._ext import cpu_ops
    out: dict[str, Any] = {"isa": cpu_ops.lp_isa("bf16", 896)}
    return out | {f"peak_{kind}_flops": v for kind, v in measure_peaks(threads).items()}


def measure_peaks(threads: int) -> dict[str, float]:
    """FLOP/s per ``cpu_ops.PEAK_KINDS`` entry this CPU has (``cpu_ops.peak_flops``)."""
    from pipeline._ext import cpu_ops
    out: dict[str, float] = {}
    for kind in cpu_ops.PEAK_KINDS:
        try:
            out[kind] = cpu_ops.peak_flops(kind, threads)
        except ValueError:  # not on this CPU
            pass
    return out
