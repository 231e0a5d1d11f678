"""Models: checkpoints already quantised to 4 bits in the Hugging Face formats (GPTQ, AWQ).

``quantization_config`` in config.json says which (``quant_method``). Both store, per linear
layer of ``in`` = K inputs and ``out`` = N outputs, int4 values q, fp16 ``scales`` [K/g, N]
and integer zero points z per group of g inputs, with W[n, k] = scales[g(k), n] *
(q[k, n] - z[g(k), n]):

- GPTQ: ``qweight`` int32 [K/8, N], input 8i + b in bits 4b..4b+3 of row i; ``qzeros``
  int32 [K/g, N/8], output 8j + b in bits 4b of column j, stored as z - 1 in the original
  ("gptq", v1) checkpoint format and as z in "gptq_v2"; ``g_idx`` int32 [K] the group of each
  input: k // g, or any order with act-order (``desc_act``).
- AWQ (``version`` "gemm"): ``qweight`` int32 [K, N/8] and ``qzeros`` [K/g, N/8], output
  8j + ORDER[b] in bits 4b of column j (AWQ's interleaved nibble order); groups k // g.

The loader hands every ``*.qweight/qzeros/scales/g_idx`` tensor here (``Int4Loader.add``);
once all parts of a fused projection (q/k/v, gate/up: the loader's ``_Assembler`` names) are
in, they become one ``layers.int4.Int4Weight`` in the model. Act-order: the inputs are sorted
by group (a stable argsort of g_idx), which makes every group contiguous; the weight keeps
that permutation and the kernel gathers x by it (the fused parts must share it, as GPTQ
gives layers with the same input). Owns the pending parts until their projection is built.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

from pipeline.layers.int4 import Int4Weight

QUANT_SUFFIXES = ("qweight", "qzeros", "scales", "g_idx")
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # nibble b of an AWQ int32 holds output 8j + AWQ_ORDER[b]
_FUSED = {"q_proj": ("qkv_weight", 0, 3), "k_proj": ("qkv_weight", 1, 3), "v_proj": ("qkv_weight", 2, 3),
          "o_proj": ("o_weight", 0, 1), "gate_proj": ("gate_up_weight", 0, 2),
          "up_proj": ("gate_up_weight", 1, 2), "down_proj": ("down_weight", 0, 1)}


def checkpoint_quantization(model_dir: str | Path) -> dict | None:
    """config.json's ``quantization_config`` when it is a supported 4-bit GPTQ/AWQ one, None
    when there is none; ValueError naming the field of anything else."""
    path = Path(model_dir) / "config.json"
    qc = json.loads(path.read_text()).get("quantization_config") if path.is_file() else None
    if qc is None:
        return None
    method = qc.get("quant_method")
    if method not in ("gptq", "awq"):
        raise ValueError(f"{path}: quantization_config.quant_method {method!r} is not supported "
                         f"(gptq and awq 4-bit are)")
    bits = qc.get("bits", qc.get("w_bit"))
    if bits != 4:
        raise ValueError(f"{path}: quantization_config.bits = {bits}: only 4-bit {method} is supported")
    if method == "awq":
        if str(qc.get("version", "gemm")).lower() != "gemm":
            raise ValueError(f"{path}: quantization_config.version = {qc.get('version')!r}: "
                             f"only AWQ's gemm layout is supported")
        if not qc.get("zero_point", True):
            raise ValueError(f"{path}: quantization_config.zero_point = false is not supported")
    elif qc.get("checkpoint_format", "gptq") not in ("gptq", "gptq_v2"):
        raise ValueError(f"{path}: quantization_config.checkpoint_format "
                         f"{qc.get('checkpoint_format')!r} is not supported (gptq, gptq_v2 are)")
    gs = qc.get("group_size", qc.get("q_group_size", -1))
    if not isinstance(gs, int) or (gs != -1 and (gs <= 0 or gs % 8)):
        raise ValueError(f"{path}: quantization_config.group_size = {gs!r}: must be -1 or a "
                         f"positive multiple of 8")
    return qc


def weight_format(qc: dict | None, quantization: str, device_type: str = "cpu") -> str | None:
    """"int4" for a GPTQ/AWQ checkpoint (its embedding and lm_head are quantised to int4 at
    load too), None otherwise; ``--quantization int8`` with one is refused, as is a GPU."""
    if qc is None:
        return None
    if device_type != "cpu":
        raise ValueError(f"a {qc['quant_method']} checkpoint (quantization_config.quant_method) "
                         f"runs on CPU only, not {device_type}; use --device cpu")
    if quantization not in ("none", "int4"):
        raise ValueError(f"--quantization {quantization}: the checkpoint is already quantised "
                         f"(quantization_config.quant_method = {qc['quant_method']!r}); use "
                         f"--quantization int4 or none")
    return "int4"


def _nibbles(t: torch.Tensor) -> torch.Tensor:
    """int32 [..., C] -> uint8 [..., C, 8]: nibble b (bits 4b..4b+3) of each value."""
    shifts = torch.arange(0, 32, 4, dtype=torch.int32)
    return ((t[..., None] >> shifts) & 15).to(torch.uint8)


def unpack_part(method: str, qc: dict, parts: dict[str, torch.Tensor]
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None, int]:
    """One checkpoint linear layer -> (q uint8 [N, K], scale fp16 [N, G], zero int16 [N, G],
    g_idx [K] or None, group size)."""
    qweight, qzeros, scales = parts["qweight"], parts["qzeros"], parts["scales"].to(torch.float16)
    if method == "gptq":
        q = _nibbles(qweight).permute(0, 2, 1).reshape(-1, qweight.shape[1])  # [K, N]
        z = _nibbles(qzeros).reshape(qzeros.shape[0], -1).to(torch.int16)      # [G, N]
        if qc.get("checkpoint_format", "gptq") == "gptq":
            z = z + 1  # v1 stores z - 1
    else:
        order = torch.tensor(AWQ_ORDER).argsort()  # output 8j + c is nibble order[c]
        q = _nibbles(qweight)[:, :, order].reshape(qweight.shape[0], -1)
        z = _nibbles(qzeros)[:, :, order].reshape(qzeros.shape[0], -1).to(torch.int16)
    k, n = q.shape
    if scales.shape[1] != n or z.shape != scales.shape:
        raise ValueError(f"{method} layer: qweight {tuple(qweight.shape)}, qzeros {tuple(qzeros.shape)}, "
                         f"scales {tuple(scales.shape)} do not fit together")
    gs = qc.get("group_size", qc.get("q_group_size", -1))
    gs = -(-k // 8) * 8 if gs == -1 else gs
    g_idx = parts.get("g_idx")
    if g_idx is not None and torch.equal(g_idx.long(), torch.arange(k) // gs):
        g_idx = None  # the trivial order
    return q.t().contiguous(), scales.t().contiguous(), z.t().contiguous(), g_idx, gs


def build_int4(method: str, qc: dict, parts: list[dict[str, torch.Tensor]],
               gemm_dtype: torch.dtype) -> Int4Weight:
    """The Int4Weight of the fused projection whose checkpoint parts (q, k, v / gate, up /
    one) are ``parts``, concatenated along the outputs."""
    unpacked = [unpack_part(method, qc, p) for p in parts]
    gs, g_idx = unpacked[0][4], unpacked[0][3]
    for u in unpacked[1:]:
        if u[4] != gs or (u[3] is None) != (g_idx is None) or (g_idx is not None and not torch.equal(u[3], g_idx)):
            raise ValueError(f"{method}: the fused parts of a projection have different g_idx "
                             f"(act-order permutations); this loader needs them equal")
    q = torch.cat([u[0] for u in unpacked])
    scale = torch.cat([u[1] for u in unpacked])
    zero = torch.cat([u[2] for u in unpacked])
    k = q.shape[1]
    perm = None
    if g_idx is not None:
        perm = torch.argsort(g_idx.long(), stable=True)
        if not torch.equal(g_idx.long()[perm], torch.arange(k) // gs):
            raise ValueError(f"{method}: g_idx does not put exactly group_size = {gs} inputs in "
                             f"each group; not supported")
        q = q[:, perm]
    g = -(-k // gs)
    if scale.shape[1] != g:
        raise ValueError(f"{method}: scales has {scale.shape[1]} groups, {k} inputs in groups of "
                         f"{gs} make {g}")
    if g * gs != k:
        q = torch.cat([q, q.new_zeros((q.shape[0], g * gs - k))], dim=1)
    if zero.min() < 0 or zero.max() > 255:
        raise ValueError(f"{method}: zero points out of range")
    z = None if bool((zero == 8).all()) else zero.to(torch.uint8)
    return Int4Weight(q, scale, z, gs, k, gemm_dtype, perm)


class Int4Loader:
    """Collects the quantised tensors of a GPTQ/AWQ checkpoint and installs each fused
    projection in ``model`` as an Int4Weight once all its parts have arrived."""

    def __init__(self, model: nn.Module, qc: dict, gemm_dtype: torch.dtype) -> None:
        self.model, self.qc, self.method = model, qc, qc["quant_method"]
        self.gemm_dtype = gemm_dtype
        self.pending: dict[str, list[dict[str, torch.Tensor]]] = {}
        self.done: set[str] = set()

    def add(self, hf_name: str, t: torch.Tensor) -> bool:
        """Take ``t`` if it is a quantised tensor (True), else leave it to the float loader."""
        parts = hf_name.removeprefix("model.").split(".")
        if parts[-1] not in QUANT_SUFFIXES:
            return False
        if len(parts) != 5 or parts[0] != "layers" or parts[3] not in _FUSED:
            raise ValueError(f"unexpected quantised checkpoint tensor {hf_name!r}")
        fused, idx, n = _FUSED[parts[3]]
        name = f"layers.{parts[1]}.{fused}"
        slots = self.pending.setdefault(name, [{} for _ in range(n)])
        slots[idx][parts[4]] = t
        need = {"qweight", "qzeros", "scales"} | ({"g_idx"} if self.method == "gptq" else set())
        if all(need <= set(s) for s in slots):
            del self.pending[name]
            layer = self.model.layers[int(parts[1])]
            w = build_int4(self.method, self.qc, slots, self.gemm_dtype)
            old = getattr(layer, fused)
            if (w.out_features, w.in_features) != tuple(old.shape):
                raise ValueError(f"checkpoint weight for {name!r} is {w.out_features} x "
                                 f"{w.in_features}, config.json implies {tuple(old.shape)}")
            delattr(layer, fused)
            setattr(layer, fused, w)
            self.done.add(name)
        return True

    def finish(self) -> set[str]:
        """The parameter names now held as Int4Weights; ValueError for incomplete ones."""
        if self.pending:
            raise ValueError(f"quantised checkpoint is missing parts of: {', '.join(sorted(self.pending))}")
        return self.done
