"""What every group of the engine configuration (``pipeline.config``) checks the same way: the
values a flag may take, its name as a flag, ranges and choices (ValueError naming the flag and
its limit). Owns no state.
"""
from __future__ import annotations

import msgspec

# The parsers' names (pipeline.tool_parsers / pipeline.reasoning register them; a test checks
# these agree).
TOOL_CALL_PARSERS = ("hermes", "llama3_json", "mistral", "pythonic")
REASONING_PARSERS = ("qwen3", "deepseek_r1")
CHOICES = {"device": ("auto", "cpu", "cuda"), "dtype": ("auto", "float32", "bfloat16", "float16"),
           "quantization": ("none", "int8", "int4"),
           "preemption_policy": ("newest", "lowest_priority"), "role": ("mixed", "prefill", "decode"),
           "kv_transfer": ("auto", "ipc", "tcp"), "pd_fallback": ("none", "local"),
           "distributed_backend": ("auto", "nccl", "gloo"), "pooling": ("last", "mean")}


def flag(field: str) -> str:
    return "--" + field.replace("_", "-")


def check_ranges(cfg: msgspec.Struct, ranges: tuple[tuple[str, int, int | None], ...]) -> None:
    for name, lo, hi in ranges:
        v = getattr(cfg, name)
        if v < lo or (hi is not None and v > hi):
            limit = f">= {lo}" if hi is None else f"in [{lo}, {hi}]"
            raise ValueError(f"{flag(name)} must be {limit}, got {v}")


def check_choices(cfg: msgspec.Struct) -> None:
    for name in cfg.__struct_fields__:
        choices = CHOICES.get(name)
        if choices is not None and getattr(cfg, name) not in choices:
            raise ValueError(f"{flag(name)} must be one of {', '.join(choices)}, got "
                             f"{getattr(cfg, name)!r}")
