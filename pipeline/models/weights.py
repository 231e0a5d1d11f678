"""Models: the form every weight takes in a loaded model, decided once per worker
(``WeightPlan``) and applied to each parameter as soon as the loader has all of it
(``WeightPlan.finalize``): the one step between a checkpoint tensor and the model.

The model is built on the meta device (no memory); ``finalize(model, name, tensor)`` puts the
parameter ``name`` in its final form and place, so loading holds at most the parameter being
assembled beside the finished ones (no float32 copy of the whole model):

- ``fmt`` bf16/int8 (CPU, float32 activations): the projections, the embedding and an untied
  lm_head become ``LowpWeight``s (an untied embedding packed for lookups only), or for int4
  ``Int4Weight``s in groups of ``group_size`` inputs; the
  checkpoint's float32, bf16 or float16 goes in as read (the packing rounds it; float16 is
  exact in float32), other dtypes widened to float32 first, so the result is what packing
  the float32 model gave, bit for bit (a NaN stays a NaN, its bits as torch's conversion).
- no ``fmt``: ``dtype`` on ``device``; on CPU the projections and an untied lm_head stored
  [in, out] (``kn``: MKL's GEMV reads a pre-transposed matrix markedly faster), converted and
  transposed in one copy.
- norms and biases: ``dtype`` (float32 under a ``fmt``).

A loader that packs a tensor itself (a GPTQ/AWQ checkpoint's projections, models.quantized)
passes the finished module, which is placed as is. Owns no state beyond the plan's fields.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from pipeline.layers.int4 import PACKED, Int4Weight
from pipeline.layers.lowp import LowpWeight
from pipeline.layers.lowp_pack import packed_shape
from pipeline.models.llama import PROJECTIONS, CausalLM
from pipeline.models.safetensors_read import empty


@dataclass(slots=True)
class RowParts:
    """A fused parameter (q/k/v, gate/up) of ``shape`` as its checkpoint tensors, each a
    read-only view of the file (``SafetensorsFile.map``) holding rows [lo, lo + len) of it;
    ``WeightPlan.finalize`` packs each straight to its blocks."""
    parts: list[tuple[int, torch.Tensor]]
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for _, t in self.parts)

    def cat(self) -> torch.Tensor:
        return torch.cat([t for _, t in sorted(self.parts, key=lambda p: p[0])])


@dataclass(frozen=True, slots=True)
class WeightPlan:
    dtype: torch.dtype  # float parameters: norms, biases, unpacked projections
    device: torch.device
    fmt: str | None = None  # "bf16" / "int8" / "int4": packed projections and embedding (CPU)
    gemm_dtype: torch.dtype = torch.float32  # LowpWeight's GEMM dtype (bf16 where native)
    kn: bool = False  # float projections stored [in, out]
    group_size: int = 128  # int4: inputs per scale

    def materialize_buffers(self, model: CausalLM) -> None:
        """The non-weight buffers (RoPE tables) on ``device``; call once, before loading.
        ``torch.empty_strided`` rather than ``Module.to_empty``: on meta tensors its
        ``empty_like`` goes through torch._refs, which imports sympy (~0.5 s for nothing)."""
        dev = self.device
        model.rotary._apply(lambda t: torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=dev))
        model.rotary.reset()

    def maps(self, name: str, tied: bool, dtype: torch.dtype) -> bool:
        """Whether parameter ``name``, stored as ``dtype``, is better handed to ``finalize`` as
        a read-only view of the file (``SafetensorsFile.map``) than as a copy: where it is
        packed into new memory smaller than what is read (int8, int4; bf16 from a wider
        dtype), the copy and the faults of a buffer dropped after packing are saved. A bf16
        file packed as bf16 is read and packed in place (its own memory kept: mapped, the
        packed copy's faults cost what the read's copy does, measured); an untied bf16/int8
        embedding is kept as read."""
        projection = name.rpartition(".")[2] in PROJECTIONS or name in ("embed_tokens", "lm_head")
        return (self.fmt is not None and projection and (self.fmt != "bf16" or dtype != torch.bfloat16)
                and (tied or name != "embed_tokens" or self.fmt == "int4"))

    def output_for(self, name: str, shape: tuple[int, ...]) -> torch.Tensor | None:
        """Memory, faulted in, for the packed form of mapped parameter ``name`` of ``shape``
        (bf16/int8; int4 allocates its own), made by the loader's reading thread so that
        the packing thread finds its pages in place."""
        if self.fmt not in ("bf16", "int8") or len(shape) != 2:
            return None
        packed, dtype = packed_shape(self.fmt, *shape)
        return empty(packed, dtype)

    def _value(self, model: CausalLM, owner: nn.Module, name: str, attr: str, t: torch.Tensor | nn.Module,
               tied: bool, mapped: bool, out: torch.Tensor | None) -> nn.Module:
        """Parameter ``name``'s final form from the complete tensor ``t`` (see ``finalize``)."""
        projection = attr in PROJECTIONS or name in ("embed_tokens", "lm_head")
        if isinstance(t, nn.Module):
            return t
        if self.fmt == "int4" and projection:
            return Int4Weight.from_float(t, self.group_size, self.gemm_dtype)  # widened per chunk
        if self.fmt is not None and projection:
            w = t if t.dtype in (torch.float32, torch.bfloat16, torch.float16) else t.float()
            # t is the buffer the reader filled for this parameter alone (packed in place), or
            # a view of the file (packed into ``out``).
            return LowpWeight(w, self.fmt, self.gemm_dtype,
                              table_only=name == "embed_tokens" and not tied, reuse=not mapped, out=out)
        if self.kn and projection and not name == "embed_tokens" and not tied:
            w = torch.empty((t.shape[1], t.shape[0]), dtype=self.dtype, device=self.device)
            if name == "lm_head":
                model.lm_head_kn = True
            else:
                owner.kn = True
            return nn.Parameter(w.copy_(t.t()), requires_grad=False)
        return nn.Parameter(t.to(device=self.device, dtype=self.dtype), requires_grad=False)

    @torch.no_grad()
    def finalize(self, model: CausalLM, name: str, t: torch.Tensor | nn.Module | RowParts,
                 mapped: bool = False, out: torch.Tensor | None = None) -> None:
        """Put parameter ``name`` (``model.named_parameters`` spelling, lm_head / embed_tokens
        without ``.weight``) into ``model``, from the complete tensor ``t`` (or a packed module).
        ``mapped``: ``t`` is a read-only view of the file (never packed over); ``out``: memory
        for its packed form (``output_for``)."""
        owner_name, _, attr = name.rpartition(".")
        owner = model.get_submodule(owner_name) if owner_name else model
        tied = model.config.tie_word_embeddings and name == "embed_tokens"
        value: nn.Module | None = None
        if isinstance(t, RowParts):  # mapped parts of a fused parameter (maps() said packed)
            value = (Int4Weight.from_parts(t.parts, t.shape[0], self.group_size, self.gemm_dtype)
                     if self.fmt == "int4" else LowpWeight.from_parts(t.parts, t.shape[0], self.fmt or "",
                                                                      self.gemm_dtype, out))
            if value is None:  # no C packer: one tensor after all
                t = t.cat()
        if value is None:
            assert not isinstance(t, RowParts)
            value = self._value(model, owner, name, attr, t, tied, mapped, out)
        # A parameter cannot be reassigned as a module: drop the placeholder first.
        delattr(owner, attr)
        setattr(owner, attr, value)
        if tied:
            delattr(model, "lm_head")
            model.lm_head = value


def weight_bytes(model: nn.Module) -> int:
    """Bytes the model's weights hold (parameters and packed buffers, a tied one once; not
    the RoPE tables)."""
    seen: set[int] = set()
    total = 0
    packed = [b for m in model.modules() if isinstance(m, PACKED) for b in m.buffers()]
    for t in (*model.parameters(), *packed):
        if id(t) not in seen:  # (oneDNN's packed copies have no data_ptr)
            seen.add(id(t))
            total += t.numel() * t.element_size()
    return total
