"""Worker stage: device-level settings of the worker process (dtype resolution, the form its
weights take, CPU threads).

Owns no state; the model runner calls these once at start-up.
"""
from __future__ import annotations

import os

import torch

from pipeline.models.quantized import checkpoint_quantization, weight_format
from pipeline.models.weights import WeightPlan

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def cpu_has_fast_bf16() -> bool:
    """bf16 matmuls are only fast with native support (AVX512-BF16 or AMX); elsewhere oneDNN
    emulates them, about 20x slower than float32 on an AVX2-only core."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    flags = set(line.split(":", 1)[1].split())
                    return bool({"avx512_bf16", "amx_bf16"} & flags)
    except OSError:
        pass
    return False


def resolve_dtype(requested: str, checkpoint_dtype: str, device: torch.device,
                  have_ops: bool = False) -> torch.dtype:
    """``--dtype``, or for "auto" the checkpoint's: on a CPU float16 becomes float32 (its ops
    are emulated), and bfloat16 stays where it is fast: native bf16 support, or the C ops
    (``have_ops``), whose packed bf16 weights run float32 FMAs on any AVX2 core at half
    float32's bytes (docs/cpu.md "AVX2 only")."""
    if requested != "auto":
        if requested not in _DTYPES:
            raise ValueError(f"--dtype must be one of auto, {', '.join(_DTYPES)}, got {requested!r}")
        return _DTYPES[requested]
    ckpt = _DTYPES.get(checkpoint_dtype, torch.float32)
    if device.type == "cpu" and ckpt != torch.float32 \
            and not (ckpt == torch.bfloat16 and (have_ops or cpu_has_fast_bf16())):
        return torch.float32  # half types without native CPU support are emulated and slow
    return ckpt


def worker_threads(requested: int = 0) -> int:
    """A fixed CPU team size for the worker: ``--worker-threads`` if given, else
    ``PIPELINE_WORKER_THREADS`` if set, else 0: the team adapts, starting with every usable
    core (``worker.threads.ThreadGovernor``)."""
    if requested < 0:
        raise ValueError(f"worker_threads must be >= 0 (0: automatic), got {requested}")
    if requested:
        return requested
    env = os.environ.get("PIPELINE_WORKER_THREADS", "")
    if env:
        n = int(env)
        if n < 1:
            raise ValueError(f"PIPELINE_WORKER_THREADS must be >= 1, got {env!r}")
        return n
    return 0


def cpu_weight_format(dtype: torch.dtype, quantization: str, device: torch.device,
                      have_ops: bool) -> str | None:
    """How a CPU model packs its weights under float32 activations: "int8" or "int4" for
    ``--quantization int8|int4``, "bf16" for a bfloat16 dtype, None for plain float32 (or on
    CUDA, where bf16 stays the activation dtype too). All need the C ops (``make build``)."""
    if device.type != "cpu":
        if quantization != "none":
            raise ValueError(f"--quantization {quantization} runs on CPU only, not {device}")
        return None
    fmt = quantization if quantization in ("int8", "int4") else "bf16" if dtype == torch.bfloat16 else None
    if fmt is not None and not have_ops:
        if fmt != "bf16":
            raise ValueError(f"--quantization {fmt} needs the C CPU ops (pipeline._ext.cpu_ops); "
                             "build them with `make build`")
        return None  # bf16 falls back to torch's bf16 ops, one at a time
    return fmt


def weight_plan(model_dir: str, dtype: torch.dtype, quantization: str, group_size: int,
                device: torch.device, have_ops: bool) -> WeightPlan:
    """The form the worker gives its weights (``models.weights``): packed bf16/int8/int4 on a
    CPU (``cpu_weight_format``; a GPTQ/AWQ checkpoint is int4 whatever the dtype), float
    projections stored [in, out] on a CPU without packing, ``dtype`` as is elsewhere."""
    fmt = (weight_format(checkpoint_quantization(model_dir), quantization, device.type)
           or cpu_weight_format(dtype, quantization, device, have_ops))
    return WeightPlan(torch.float32 if fmt else dtype, device, fmt,
                      torch.bfloat16 if cpu_has_fast_bf16() else torch.float32,
                      kn=fmt is None and device.type == "cpu", group_size=group_size)


def proc_memory(field: str = "VmHWM") -> int:
    """A memory figure of this process in bytes from /proc/self/status ("VmHWM": peak
    resident, "VmRSS": resident now); 0 where /proc has none."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0
