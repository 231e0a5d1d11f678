"""Test helper: write GPTQ and AWQ 4-bit checkpoints of a float checkpoint, packed from the
formats' descriptions (models/quantized.py docstring), and the float checkpoint of exactly
the weights they hold (dequantised), for the loading tests. GPTQ's scales here are its
symmetric 2 * absmax / 15 (not the load-time quantiser's), its zero points stored minus one
(the v1 "gptq" format), and act-order a random permutation of the inputs into groups."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, save_file

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
PROJ = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
SHARED_INPUT = {"q_proj": "qkv", "k_proj": "qkv", "v_proj": "qkv", "o_proj": "o", "gate_proj": "gate_up",
                "up_proj": "gate_up", "down_proj": "down"}


def _quantise(w: torch.Tensor, g_idx: torch.Tensor, groups: int, sym: bool, min_zero: int):
    """w [N, K] -> q [K, N] (0..15), scale fp16 [G, N], zero [G, N]."""
    n, k = w.shape
    q = torch.zeros((k, n), dtype=torch.int64)
    scale = torch.zeros((groups, n), dtype=torch.float16)
    zero = torch.zeros((groups, n), dtype=torch.int64)
    for g in range(groups):
        cols = (g_idx == g).nonzero().flatten()
        wg = w[:, cols].double()
        if sym:
            s = (wg.abs().amax(dim=1) * 2 / 15).to(torch.float16)
            z = torch.full((n,), 8, dtype=torch.int64)
        else:
            lo, hi = wg.amin(dim=1).clamp(max=0), wg.amax(dim=1).clamp(min=0)
            s = ((hi - lo) / 15).to(torch.float16)
            z = torch.round(-lo / s.double()).long().clamp(min_zero, 15)
        q[cols] = (torch.round(wg / s.double()[:, None]).long() + z[:, None]).clamp(0, 15).t()
        scale[g], zero[g] = s, z
    return q, scale, zero


def _pack_rows(v: torch.Tensor) -> torch.Tensor:
    """int [8R, C] -> int32 [R, C]: row 8i + b in bits 4b of row i (GPTQ's qweight)."""
    v = v.view(-1, 8, v.shape[1])
    acc = sum(v[:, b].numpy().astype(np.uint64) << np.uint64(4 * b) for b in range(8))
    return torch.from_numpy(acc.astype(np.uint32).view(np.int32))


def _pack_cols(v: torch.Tensor, order=tuple(range(8))) -> torch.Tensor:
    """int [R, 8C] -> int32 [R, C]: column 8j + order[b] in bits 4b of column j."""
    v = v.view(v.shape[0], -1, 8)
    acc = sum(v[:, :, order[b]].numpy().astype(np.uint64) << np.uint64(4 * b) for b in range(8))
    return torch.from_numpy(acc.astype(np.uint32).view(np.int32))


def write_quantised(src: str, out: str, ref_out: str, method: str, group_size: int,
                    sym: bool = True, act_order: bool = False, seed: int = 0) -> None:
    """``out``: the GPTQ ("gptq": v1 zero points, "gptq_v2") or AWQ ("awq") checkpoint of
    ``src``'s projections; ``ref_out``: ``src`` with those projections replaced by the values
    ``out`` holds."""
    v1 = method == "gptq"
    method = method.removesuffix("_v2")
    tensors = load_file(str(Path(src) / "model.safetensors"))
    gen = torch.Generator().manual_seed(seed)
    quant, ref = {}, {}
    perms: dict[tuple[str, str], torch.Tensor] = {}
    for name, t in tensors.items():
        parts = name.split(".")
        if len(parts) < 2 or parts[-2] not in PROJ or parts[-1] != "weight":
            quant[name] = ref[name] = t
            continue
        w = t.float()
        n, k = w.shape
        groups = -(-k // group_size)
        g_idx = torch.arange(k) // group_size
        if act_order:  # one order per input, as GPTQ's Hessian gives q/k/v and gate/up
            key = (parts[-4] if len(parts) >= 4 else "", SHARED_INPUT[parts[-2]])
            g_idx = g_idx[perms.setdefault(key, torch.randperm(k, generator=gen))]
        q, scale, zero = _quantise(w, g_idx, groups, sym, 1 if v1 else 0)
        base = name.removesuffix(".weight")
        deq = (scale.float()[g_idx] * (q - zero[g_idx]).float()).t().contiguous()
        ref[name] = deq.to(t.dtype)
        assert torch.equal(ref[name].float(), deq), "the float checkpoint must hold W exactly"
        quant[f"{base}.scales"] = scale
        if method == "gptq":
            quant[f"{base}.qweight"] = _pack_rows(q)
            quant[f"{base}.qzeros"] = _pack_cols(zero - 1 if v1 else zero)  # v1: z - 1
            quant[f"{base}.g_idx"] = g_idx.to(torch.int32)
        else:
            quant[f"{base}.qweight"] = _pack_cols(q, AWQ_ORDER)
            quant[f"{base}.qzeros"] = _pack_cols(zero, AWQ_ORDER)
    for d, ts in ((out, quant), (ref_out, ref)):
        Path(d).mkdir(parents=True, exist_ok=True)
        for f in Path(src).iterdir():
            if f.name != "model.safetensors" and f.is_file():
                shutil.copy(f, Path(d) / f.name)
        save_file(ts, str(Path(d) / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((Path(src) / "config.json").read_text())
    cfg["quantization_config"] = (
        {"quant_method": "gptq", "bits": 4, "group_size": group_size, "desc_act": act_order,
         "sym": sym, "checkpoint_format": "gptq" if v1 else "gptq_v2"} if method == "gptq" else
        {"quant_method": "awq", "bits": 4, "group_size": group_size, "zero_point": True,
         "version": "gemm"})
    (Path(out) / "config.json").write_text(json.dumps(cfg, indent=2))
