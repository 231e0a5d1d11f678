"""Models: load a Hugging Face safetensors checkpoint (single file or sharded with
``model.safetensors.index.json``) into a CausalLM built on the meta device, streaming: each
tensor is read (``models.safetensors_read``), fused with its siblings (q/k/v, gate/up) and, as
soon as a parameter is complete, handed to ``WeightPlan.finalize`` (``models.weights``), which
packs or converts it into its final place; the read copy is dropped then. The reading runs
in a thread ahead of the packing (``models.weight_stream``), so the disk (or the page-cache
copy) and the packing overlap; the peak memory is the finished weights plus the parameters in
flight (one fused parameter, the read-ahead) and what packing one needs.

A GPTQ/AWQ checkpoint (``models.quantized``) streams its float tensors so, then its quantised
ones (a few bytes per weight) in a second pass that builds each projection's Int4Weight.

Under tensor parallelism each rank reads only its slices of every tensor (``read_shard``,
the split of ``models.parallel``): no rank materialises the full model. Owns nothing after
loading; prints progress to stderr (a line at the start, per shard, and every
``PROGRESS_EVERY_S`` inside one).
"""
from __future__ import annotations

import ctypes
import json
import sys
import time
from pathlib import Path
from typing import NamedTuple

import torch

from pipeline.models.config import ModelArch
from pipeline.models.llama import CausalLM
from pipeline.models.parallel import TPShard
from pipeline.models.quantized import QUANT_SUFFIXES, Int4Loader, checkpoint_quantization
from pipeline.models.safetensors_read import SafetensorsFile
from pipeline.models.weight_stream import WeightStream
from pipeline.models.weights import RowParts, WeightPlan

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


class Slot(NamedTuple):
    """Where a checkpoint tensor goes: rows [lo, hi) of parameter ``param`` (fused q/k/v and
    gate/up take ``parts`` tensors; the others one, all of it)."""
    param: str
    lo: int
    hi: int
    parts: int


def route(config: ModelArch, hf_name: str) -> Slot | None:
    """The slot of checkpoint tensor ``hf_name`` in a CausalLM of ``config`` (a rank's config
    under tensor parallelism), or None for a tensor that carries nothing we keep."""
    name = hf_name.removeprefix("model.")
    if name.endswith(_IGNORED_SUFFIXES):
        return None
    if name == "lm_head.weight":
        # Some tied checkpoints still store it; the embedding wins, as in HF.
        return None if config.tie_word_embeddings else Slot("lm_head", 0, config.vocab_size, 1)
    whole = {"embed_tokens.weight": ("embed_tokens", config.vocab_size),
             "norm.weight": ("norm.weight", config.hidden_size)}
    if name in whole:
        return Slot(whole[name][0], 0, whole[name][1], 1)
    parts = name.split(".")
    if len(parts) < 4 or parts[0] != "layers":
        raise ValueError(f"unexpected checkpoint tensor {hf_name!r}")
    layer, module, proj, kind = parts[1], parts[2], parts[3], parts[-1]
    prefix = f"layers.{layer}."
    q, kv, inter, hidden = config.q_size, config.kv_size, config.intermediate_size, config.hidden_size
    if module == "self_attn" and proj in _QKV:
        lo = (0, q, q + kv)[_QKV[proj]]
        return Slot(f"{prefix}qkv_{kind}", lo, lo + (q if proj == "q_proj" else kv), 3)
    if module == "self_attn" and proj == "o_proj":
        return Slot(f"{prefix}o_{kind}", 0, hidden, 1)
    if module == "self_attn" and proj in ("q_norm", "k_norm"):
        return Slot(f"{prefix}{proj}.weight", 0, config.head_dim, 1)
    if module == "mlp" and proj in _GATE_UP:
        lo = _GATE_UP[proj] * inter
        return Slot(f"{prefix}gate_up_{kind}", lo, lo + inter, 2)
    if module == "mlp" and proj == "down_proj":
        return Slot(f"{prefix}down_{kind}", 0, hidden, 1)
    if module in ("input_layernorm", "post_attention_layernorm"):
        return Slot(f"{prefix}{module}.weight", 0, hidden, 1)
    raise ValueError(f"unexpected checkpoint tensor {hf_name!r}")


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


PROGRESS_EVERY_S = 2.0


def load_weights(model: CausalLM, model_dir: str | Path, plan: WeightPlan, quiet: bool = False,
                 shard: TPShard | None = None) -> int:
    """Stream every checkpoint tensor (or rank ``shard``'s slice of it) into ``model`` (built
    on the meta device), each parameter finalised by ``plan`` as soon as it is complete;
    return the bytes of the files' tensors."""
    files = checkpoint_files(model_dir)
    rank = f"rank {shard.rank}: " if shard is not None and shard.size > 1 else ""
    form = f"packed as {plan.fmt}" if plan.fmt else str(plan.dtype).removeprefix("torch.") + (
        ", projections [in, out]" if plan.kn else "")
    file_bytes = sum(p.stat().st_size for p in files)

    def say(msg: str) -> None:
        if not quiet:
            print(f"{rank}loading weights: {msg}", file=sys.stderr, flush=True)
    say(f"{len(files)} file(s), {file_bytes / 2**20:.1f} MiB, {form}")
    # GPTQ/AWQ: the quantised tensors go to their own loader (models/quantized.py), after
    # the stream of the float ones.
    qc = checkpoint_quantization(model_dir)
    if qc is not None and shard is not None and shard.size > 1:
        raise ValueError(f"--tensor-parallel-size {shard.size}: a {qc['quant_method']} checkpoint "
                         f"loads on one rank only")

    def slot(key: str) -> Slot | None:
        if qc is not None and key.rsplit(".", 1)[-1] in QUANT_SUFFIXES:
            return None
        return route(model.config, key)
    plan.materialize_buffers(model)
    shapes = {n: tuple(p.shape) for n, p in model.named_parameters(remove_duplicate=False)}
    loaded: set[str] = set()
    total = 0
    t0 = last = time.perf_counter()
    tied = model.config.tie_word_embeddings
    stream = WeightStream(files, slot, shapes, shard, read_shard,
                          lambda param, dtype: plan.maps(param, tied and param == "embed_tokens", dtype),
                          plan.output_for)
    # The reader thread has a core of its own: packing takes the others. (On 2 cores, two
    # threads of small element-wise ops ran 20-30x slower whenever the reader or another
    # process held the second core: each op waits at its barrier for the descheduled one.)
    threads = torch.get_num_threads()
    torch.set_num_threads(max(1, threads - 1))
    try:
        j, prev = 0, -1
        for item in stream:
            j = j + 1 if item.file == prev else 1
            prev = item.file
            total += item.nbytes
            if item.param is not None:
                assert item.value is not None
                _check(item.param, item.value, shapes, loaded)
                plan.finalize(model, item.param, item.value, item.mapped, item.out)
                loaded.add(item.param)
                item.value = item.out = None  # a mapped view: unmapped here
                stream.release(item.held)
            now = time.perf_counter()
            if j == item.tensors or now - last >= PROGRESS_EVERY_S:
                last = now
                say(f"shard {item.file + 1}/{len(files)} {files[item.file].name}: tensor {j}/{item.tensors} "
                    f"({total / 2**20:.1f} MiB read and {form}, {now - t0:.1f}s)")
    finally:
        stream.close()
        torch.set_num_threads(threads)
    if qc is not None:
        loaded |= _load_int4(model, files, qc, plan)
    expected = set(shapes) - ({"lm_head"} if model.config.tie_word_embeddings else set())
    missing = sorted(expected - loaded)
    if missing:
        raise ValueError(f"checkpoint is missing weights for: {', '.join(missing[:8])}"
                         + (" ..." if len(missing) > 8 else ""))
    free_heap()
    return total


def _load_int4(model: CausalLM, files: list[Path], qc: dict, plan: WeightPlan) -> set[str]:
    """A GPTQ/AWQ checkpoint's quantised projections (a few bytes per weight, so read whole);
    returns the parameters they became."""
    int4 = Int4Loader(model, qc, plan.gemm_dtype)
    for path in files:
        with SafetensorsFile(path) as f:
            for key in f.keys():
                if key.rsplit(".", 1)[-1] in QUANT_SUFFIXES:
                    int4.add(key, f.get_slice(key)[:])
    return int4.finish()


def _check(name: str, t: torch.Tensor | RowParts, shapes: dict[str, tuple[int, ...]], loaded: set[str]) -> None:
    shape = shapes.get(name)
    if shape is None:
        raise ValueError(f"checkpoint tensor maps to unknown parameter {name!r} "
                         f"(does config.json match the weights?)")
    if tuple(t.shape) != shape:
        raise ValueError(f"checkpoint tensor for {name!r} has shape {tuple(t.shape)}, "
                         f"config.json implies {shape}")
    if name in loaded:
        raise ValueError(f"checkpoint has {name!r} twice (in two shards?)")


def free_heap() -> None:
    """Hand the C heap's free pages back to the system: loading frees thousands of buffers of
    a few MB, which glibc keeps (its mmap threshold grows with each freed block) as resident
    memory nothing uses. No-op where libc has no ``malloc_trim``."""
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):
        pass
