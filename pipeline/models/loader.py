"""Models: load a Hugging Face safetensors checkpoint (single file or sharded with
``model.safetensors.index.json``) into a CausalLM, fusing q/k/v and gate/up on the way.

Under tensor parallelism each rank reads only its slices of every tensor
(``safe_open(...).get_slice``, the split of ``models.parallel``): no rank materialises the
full model. Owns nothing after loading; prints progress to stderr (one line per shard).
"""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch
from safetensors import safe_open

from pipeline.models.llama import CausalLM
from pipeline.models.parallel import TPShard
from pipeline.models.quantized import Int4Loader, checkpoint_quantization

# Checkpoint tensors that carry no weights we need (recomputed buffers).
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
_QKV = {"q_proj": 0, "k_proj": 1, "v_proj": 2}
_GATE_UP = {"gate_proj": 0, "up_proj": 1}


def checkpoint_files(model_dir: str | Path) -> list[Path]:
    d = Path(model_dir)
    index = d / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text()).get("weight_map", {})
        files = sorted({d / f for f in weight_map.values()})
        missing = [str(f) for f in files if not f.is_file()]
        if missing:
            raise FileNotFoundError(f"{index}: shard(s) listed but missing: {', '.join(missing)}")
        return files
    single = d / "model.safetensors"
    if single.is_file():
        return [single]
    files = sorted(d.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"--model {d}: no *.safetensors weights (only safetensors is supported)")
    return files


class _Assembler:
    """Collects the pieces of fused parameters until all have arrived."""

    def __init__(self, model: CausalLM) -> None:
        self.model = model
        self.params = dict(model.named_parameters(remove_duplicate=False))
        self.pending: dict[str, list[torch.Tensor | None]] = {}
        self.loaded: set[str] = set()

    def _put(self, name: str, t: torch.Tensor) -> None:
        p = self.params.get(name)
        if p is None:
            raise ValueError(f"checkpoint tensor maps to unknown parameter {name!r} "
                             f"(does config.json match the weights?)")
        if tuple(p.shape) != tuple(t.shape):
            raise ValueError(f"checkpoint tensor for {name!r} has shape {tuple(t.shape)}, "
                             f"config.json implies {tuple(p.shape)}")
        with torch.no_grad():
            p.copy_(t)
        self.loaded.add(name)

    def _part(self, fused: str, idx: int, n: int, t: torch.Tensor) -> None:
        parts = self.pending.setdefault(fused, [None] * n)
        parts[idx] = t
        if all(x is not None for x in parts):
            del self.pending[fused]
            self._put(fused, torch.cat(parts, dim=0))

    def add(self, hf_name: str, t: torch.Tensor) -> None:
        name = hf_name.removeprefix("model.")
        if name.endswith(_IGNORED_SUFFIXES):
            return
        if name == "lm_head.weight":
            if self.model.config.tie_word_embeddings:
                return  # some tied checkpoints still store it; the embedding wins, as in HF
            return self._put("lm_head", t)
        if name == "embed_tokens.weight":
            return self._put("embed_tokens", t)
        if name == "norm.weight":
            return self._put("norm.weight", t)
        parts = name.split(".")
        if len(parts) < 4 or parts[0] != "layers":
            raise ValueError(f"unexpected checkpoint tensor {hf_name!r}")
        layer, module, proj, kind = parts[1], parts[2], parts[3], parts[-1]
        prefix = f"layers.{layer}."
        if module == "self_attn" and proj in _QKV:
            return self._part(f"{prefix}qkv_{kind}", _QKV[proj], 3, t)
        if module == "self_attn" and proj == "o_proj":
            return self._put(f"{prefix}o_{kind}", t)
        if module == "self_attn" and proj in ("q_norm", "k_norm"):
            return self._put(f"{prefix}{proj}.weight", t)
        if module == "mlp" and proj in _GATE_UP:
            return self._part(f"{prefix}gate_up_{kind}", _GATE_UP[proj], 2, t)
        if module == "mlp" and proj == "down_proj":
            return self._put(f"{prefix}down_{kind}", t)
        if module in ("input_layernorm", "post_attention_layernorm"):
            return self._put(f"{prefix}{module}.weight", t)
        raise ValueError(f"unexpected checkpoint tensor {hf_name!r}")

    def finish(self) -> None:
        if self.pending:
            raise ValueError(f"checkpoint is missing parts of: {', '.join(sorted(self.pending))}")
        expected = {n for n, _ in self.model.named_parameters()}
        if self.model.config.tie_word_embeddings:
            expected.discard("lm_head")
        missing = sorted(expected - self.loaded)
        if missing:
            raise ValueError(f"checkpoint is missing weights for: {', '.join(missing[:8])}"
                             + (" ..." if len(missing) > 8 else ""))


def _rows(sl, lo: int, hi: int, dim: int) -> torch.Tensor:
    return sl[lo:hi] if dim == 0 else sl[:, lo:hi]


def read_shard(key: str, sl, shard: TPShard | None) -> torch.Tensor:
    """Checkpoint tensor ``key`` (a safetensors slice ``sl``), or the part of it rank
    ``shard`` holds (``models.parallel``): column-parallel rows, row-parallel columns, vocab
    rows padded with zeros, and the row-parallel biases on rank 0 only (zeros elsewhere)."""
    if shard is None or shard.size == 1:
        return sl[:]
    parts = key.removeprefix("model.").split(".")
    proj, kind = (parts[3], parts[-1]) if len(parts) >= 4 and parts[0] == "layers" else ("", "")
    if proj == "q_proj":
        return _rows(sl, *shard.q_rows(), 0)
    if proj in ("k_proj", "v_proj"):
        return _rows(sl, *shard.kv_rows(), 0)
    if proj in ("gate_proj", "up_proj"):
        return _rows(sl, *shard.inter_rows(), 0)
    if proj in ("o_proj", "down_proj"):
        if kind == "bias":  # added once, after the all-reduce's sum
            t = sl[:]
            return t if shard.rank == 0 else torch.zeros_like(t)
        return _rows(sl, *(shard.q_rows() if proj == "o_proj" else shard.inter_rows()), 1)
    if parts[0] in ("embed_tokens", "lm_head"):
        lo, hi = shard.vocab_rows()
        t = sl[lo:hi]
        if hi - lo < shard.vocab_per_rank:
            t = torch.cat([t, t.new_zeros((shard.vocab_per_rank - (hi - lo), t.shape[1]))])
        return t
    return sl[:]  # norms (q/k norms are per head_dim): every rank has them whole


def load_weights(model: CausalLM, model_dir: str | Path, quiet: bool = False,
                 shard: TPShard | None = None) -> int:
    """Copy every checkpoint tensor (or rank ``shard``'s slice of it) into ``model`` (cast to
    its dtype); return bytes read."""
    files = checkpoint_files(model_dir)
    rank = f"rank {shard.rank}: " if shard is not None and shard.size > 1 else ""
    asm = _Assembler(model)
    # GPTQ/AWQ: the quantised tensors go to their own loader (models/quantized.py).
    qc = checkpoint_quantization(model_dir)
    if qc is not None and shard is not None and shard.size > 1:
        raise ValueError(f"--tensor-parallel-size {shard.size}: a {qc['quant_method']} checkpoint "
                         f"loads on one rank only")
    int4 = Int4Loader(model, qc, torch.float32) if qc is not None else None
    dtype = model.embed_tokens.dtype
    total = 0
    t0 = time.perf_counter()
    last = t0
    for i, path in enumerate(files, 1):
        with safe_open(str(path), framework="pt", device="cpu") as f:
            keys = list(f.keys())
            for j, key in enumerate(keys, 1):
                t = read_shard(key, f.get_slice(key), shard)
                total += t.numel() * t.element_size()
                if int4 is None or not int4.add(key, t):
                    asm.add(key, t.to(dtype))
                now = time.perf_counter()
                # A line per shard, and one every few seconds inside a big shard.
                if not quiet and (j == len(keys) or now - last >= 5.0):
                    last = now
                    print(f"{rank}loading weights: shard {i}/{len(files)} {path.name}: tensor {j}/{len(keys)} "
                          f"({total / 2**20:.1f} MiB, {now - t0:.1f}s)", file=sys.stderr, flush=True)
    if int4 is not None:
        asm.loaded |= int4.finish()
    asm.finish()
    return total
