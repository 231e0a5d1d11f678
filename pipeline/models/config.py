"""Models: parse a Hugging Face ``config.json`` into the one ModelArch (the architecture) the model uses.

Owns no state beyond the parsed struct. Every config field that would change the math and
that we do not implement raises UnsupportedModelError naming the field, so a checkpoint
never runs silently wrong.
"""
from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass, field
from pathlib import Path

# architectures[0] -> model_type family handled by pipeline/models/llama.py
SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
}
SUPPORTED_ROPE_TYPES = ("default", "llama3", "linear")


class UnsupportedModelError(ValueError):
    """The checkpoint asks for something this engine does not implement."""


@dataclass(slots=True)
class RopeConfig:
    theta: float = 10000.0
    rope_type: str = "default"  # default | llama3 | linear
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclass(slots=True)
class ModelArch:
    architecture: str
    family: str  # llama | mistral | qwen2 | qwen3
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    qk_norm: bool
    rope: RopeConfig = field(default_factory=RopeConfig)
    sliding_window: int | None = None  # window size when some layer uses one
    torch_dtype: str = "float32"
    eos_token_ids: list[int] = field(default_factory=list)
    bos_token_id: int | None = None

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def check_max_model_len(self, max_model_len: int) -> None:
        """Refuse a context length at which a sliding window would change attention."""
        if self.sliding_window is not None and max_model_len > self.sliding_window:
            raise UnsupportedModelError(
                f"config.json: sliding_window={self.sliding_window} is in effect for "
                f"max_model_len={max_model_len}; sliding-window attention is not supported, "
                f"pass --max-model-len <= {self.sliding_window}")


def _as_id_list(v) -> list[int]:
    if v is None:
        return []
    if isinstance(v, int):
        return [v]
    return [int(x) for x in v]


def _parse_rope(cfg: dict) -> RopeConfig:
    # transformers >= 5 writes rope_parameters (with rope_theta inside); older checkpoints
    # write rope_theta at the top level and rope_scaling for the variant.
    params = cfg.get("rope_parameters") or {}
    scaling = cfg.get("rope_scaling") or {}
    if "rope_type" not in params and not scaling and isinstance(params, dict) and params:
        if all(isinstance(v, dict) for v in params.values()):
            raise UnsupportedModelError("config.json: per-layer-type rope_parameters are not supported")
    merged = {**scaling, **params}
    theta = float(merged.get("rope_theta", cfg.get("rope_theta", 10000.0)))
    rope_type = merged.get("rope_type", merged.get("type", "default")) or "default"
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise UnsupportedModelError(
            f"config.json: rope_scaling type {rope_type!r} is not supported "
            f"(supported: {', '.join(SUPPORTED_ROPE_TYPES)})")
    prf = merged.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0))
    if prf is not None and float(prf) != 1.0:
        raise UnsupportedModelError(f"config.json: partial_rotary_factor={prf} is not supported (only 1.0)")
    rope = RopeConfig(theta=theta, rope_type=rope_type)
    if rope_type in ("llama3", "linear"):
        if "factor" not in merged:
            raise UnsupportedModelError(f"config.json: rope_scaling {rope_type!r} needs 'factor'")
        rope.factor = float(merged["factor"])
    if rope_type == "llama3":
        for k in ("low_freq_factor", "high_freq_factor", "original_max_position_embeddings"):
            if k not in merged:
                raise UnsupportedModelError(f"config.json: rope_scaling 'llama3' needs {k!r}")
        rope.low_freq_factor = float(merged["low_freq_factor"])
        rope.high_freq_factor = float(merged["high_freq_factor"])
        rope.original_max_position_embeddings = int(merged["original_max_position_embeddings"])
        if rope.high_freq_factor <= rope.low_freq_factor:
            raise UnsupportedModelError("config.json: rope_scaling high_freq_factor must exceed low_freq_factor")
    return rope


def _sliding_window(cfg: dict, family: str, num_layers: int) -> int | None:
    window = cfg.get("sliding_window")
    if window is None:
        return None
    if family == "mistral":
        return int(window)
    if family in ("qwen2", "qwen3"):
        if not cfg.get("use_sliding_window", False):
            return None
        layer_types = cfg.get("layer_types")
        if layer_types is None:
            mwl = int(cfg.get("max_window_layers", num_layers))
            return int(window) if mwl < num_layers else None
        return int(window) if "sliding_attention" in layer_types else None
    return None


def parse_model_config(cfg: dict, generation_config: dict | None = None) -> ModelArch:
    archs = cfg.get("architectures") or []
    arch = archs[0] if archs else None
    if arch not in SUPPORTED_ARCHITECTURES:
        raise UnsupportedModelError(
            f"config.json: architecture {arch!r} is not supported "
            f"(supported: {', '.join(SUPPORTED_ARCHITECTURES)})")
    family = SUPPORTED_ARCHITECTURES[arch]

    def need(key: str):
        if key not in cfg or cfg[key] is None:
            raise UnsupportedModelError(f"config.json: required field {key!r} is missing")
        return cfg[key]

    hidden = int(need("hidden_size"))
    heads = int(need("num_attention_heads"))
    kv_heads = int(cfg.get("num_key_value_heads") or heads)
    layers = int(need("num_hidden_layers"))
    head_dim = int(cfg.get("head_dim") or hidden // heads)
    if heads % kv_heads:
        raise UnsupportedModelError(
            f"config.json: num_attention_heads={heads} is not a multiple of num_key_value_heads={kv_heads}")
    act = cfg.get("hidden_act", "silu")
    if act not in ("silu", "swish"):
        raise UnsupportedModelError(f"config.json: hidden_act={act!r} is not supported (only 'silu')")
    for k in ("attn_logit_softcapping", "final_logit_softcapping", "logits_scaling"):
        if cfg.get(k) not in (None, 0, 1, 1.0):
            raise UnsupportedModelError(f"config.json: {k}={cfg[k]} is not supported")

    attention_bias = bool(cfg.get("attention_bias", False))
    if family == "qwen2":
        qkv_bias, o_bias = True, False
    elif family == "mistral":
        if attention_bias:
            raise UnsupportedModelError("config.json: attention_bias=true is not supported for Mistral")
        qkv_bias = o_bias = False
    else:  # llama, qwen3: one flag for q/k/v/o
        qkv_bias = o_bias = attention_bias
    mlp_bias = bool(cfg.get("mlp_bias", False))
    if mlp_bias and family != "llama":
        raise UnsupportedModelError(f"config.json: mlp_bias=true is not supported for {arch}")

    gen = generation_config or {}
    eos = _as_id_list(gen.get("eos_token_id")) or _as_id_list(cfg.get("eos_token_id"))
    mpe = int(cfg.get("max_position_embeddings") or 2048)
    dtype = cfg.get("dtype") or cfg.get("torch_dtype") or "float32"
    return ModelArch(
        architecture=arch, family=family, vocab_size=int(need("vocab_size")), hidden_size=hidden,
        intermediate_size=int(need("intermediate_size")), num_layers=layers, num_heads=heads,
        num_kv_heads=kv_heads, head_dim=head_dim, rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        max_position_embeddings=mpe, tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        qkv_bias=qkv_bias, o_bias=o_bias, mlp_bias=mlp_bias, qk_norm=(family == "qwen3"),
        rope=_parse_rope(cfg), sliding_window=_sliding_window(cfg, family, layers),
        torch_dtype=str(dtype), eos_token_ids=eos, bos_token_id=cfg.get("bos_token_id"))


def load_model_config(model_dir: str | Path) -> ModelArch:
    d = Path(model_dir)
    path = d / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"--model {d}: no config.json (expected a Hugging Face checkpoint directory)")
    cfg = json.loads(path.read_text())
    gen_path = d / "generation_config.json"
    gen = json.loads(gen_path.read_text()) if gen_path.is_file() else None
    return parse_model_config(cfg, gen)


def rope_inv_freq(rope: RopeConfig, head_dim: int):
    """Inverse frequencies as transformers computes them (float32), with the scaling variant."""
    import torch
    inv = 1.0 / (rope.theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if rope.rope_type == "linear":
        return inv / rope.factor
    if rope.rope_type == "llama3":
        old = rope.original_max_position_embeddings
        low_wl, high_wl = old / rope.low_freq_factor, old / rope.high_freq_factor
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > low_wl, inv / rope.factor, inv)
        smooth = (old / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
        smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
        medium = ~(wavelen < high_wl) * ~(wavelen > low_wl)
        return torch.where(medium, smoothed, scaled)
    return inv


def model_hash(model_dir: str | Path) -> str:
    """A digest of the checkpoint's config.json (keys sorted): two instances whose KV caches
    exchange blocks must run the same model, wherever each keeps its copy."""
    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    canon = json.dumps(cfg, sort_keys=True, separators=(",", ":")).encode()
    return hashlib.blake2b(canon, digest_size=16).hexdigest()


SAMPLE_BYTES = 1 << 16  # of a weight file, at each of three places (weights_id)


def weights_id(model_dir: str | Path, numerics: str) -> str:
    """A digest of the model a KV tier's blocks were computed by, for files that outlive the
    process: the config (``model_hash``), each weight file's name and size and three 64 KiB
    samples of its bytes (two checkpoints of one config, as a fine-tune and its base, differ
    there), and ``numerics``: what else changes the KV (dtype, quantization, ranks). Reads
    ~200 KiB a file, not the weights."""
    h = hashlib.blake2b(digest_size=16)
    h.update(model_hash(model_dir).encode() + b"\0" + numerics.encode() + b"\0")
    for f in sorted(Path(model_dir).glob("*.safetensors")) + sorted(Path(model_dir).glob("*.bin")):
        size = f.stat().st_size
        h.update(f"{f.name}\0{size}\0".encode())
        with open(f, "rb") as fh:
            for off in (0, max(0, size // 2 - SAMPLE_BYTES // 2), max(0, size - SAMPLE_BYTES)):
                fh.seek(off)
                h.update(fh.read(SAMPLE_BYTES))
    return h.hexdigest()
