"""`pipeline bench cpu`: the machine's limits, measured in the same run, and the bytes a decode
step must read, so that every figure can be set against physics.

- DRAM read bandwidth: ``bench worker``'s parallel read of 1 GiB (vector loads, all threads).
- Peak FLOP/s of the instructions the kernels use, where the extension measures them
  (``cpu_ops.peak_flops(kind, threads)``: an in-register loop with no memory traffic).
- Step bytes: every projection and the LM head once (the embedding is only looked up, unless
  tied: then it is the LM head), at the format's bytes per weight (int8 and int4 with their
  scales). A batch-1 decode cannot beat bandwidth / step bytes.
Owns nothing.
"""
from __future__ import annotations

from typing import Any

# Bytes per weight, scales included (int8: one float32 per output row of ~1k inputs; int4:
# a 2-byte scale per group of 32-128 with a zero point at most).
_BYTES = {"float32": 4.0, "bf16": 2.0, "int8": 1.0 + 4 / 896, "int4": 0.5 + 4 / 64}


def step_params(model: str) -> int:
    """Weights one decode step reads: the layers' projections and the LM head."""
    from pipeline.models.config import load_model_config
    c = load_model_config(model)
    per_layer = (c.hidden_size * (c.q_size + 2 * c.kv_size) + c.q_size * c.hidden_size
                 + 3 * c.hidden_size * c.intermediate_size)
    return c.num_layers * per_layer + c.vocab_size * c.hidden_size


def weight_bytes(model: str, fmt: str) -> float:
    return step_params(model) * _BYTES[fmt]


def limits(threads: int) -> dict[str, Any]:
    import torch

    from pipeline._ext import cpu_ops
    from pipeline.bench.bandwidth import read_bandwidth
    torch.set_num_threads(threads)
    out: dict[str, Any] = {"threads": threads, "read_bytes_per_s": read_bandwidth()}
    peak = getattr(cpu_ops, "peak_flops", None)
    if peak is not None:
        for kind in ("fp32_fma", "bf16_dp", "amx_bf16", "amx_int8"):
            try:
                out[f"peak_{kind}_flops"] = float(peak(kind, threads))
            except (ValueError, RuntimeError, OSError):  # not on this CPU
                pass
    return out
