"""`pipeline make-model`: write a random-initialised Llama / Qwen2 / Qwen3 checkpoint in exactly
the Hugging Face layout (config.json, generation_config.json, model.safetensors or shards with
model.safetensors.index.json, tokenizer.json, tokenizer_config.json), for tests and benchmarks.

Owns nothing at run time. ``write_checkpoint`` and ``build_bpe_tokenizer`` are reusable by
tools that train a model (tools/train_default_model.py).
"""
from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

import torch

from pipeline.config import DEFAULT_MODEL
from pipeline.sizes import size_arg

ARCHS = {"llama": ("LlamaForCausalLM", "llama"), "qwen2": ("Qwen2ForCausalLM", "qwen2"),
         "qwen3": ("Qwen3ForCausalLM", "qwen3")}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "chat_template.jinja")
SPECIAL_TOKENS = ["<|begin_of_text|>", "<|end_of_text|>", "<|im_start|>", "<|im_end|>"]
# ChatML, with OpenAI `tools` and assistant tool calls in the hermes format (Qwen2.5's):
# the tool-call parser `hermes` reads what a model trained on it answers.
CHAT_TEMPLATE = (
    "{{ bos_token }}{% if tools %}{{ '<|im_start|>system\\n# Tools\\n\\nYou may call these functions. "
    "To call one, answer <tool_call>{\"name\": NAME, \"arguments\": ARGUMENTS}</tool_call>\\n' }}"
    "{% for tool in tools %}{{ tool | tojson }}{{ '\\n' }}{% endfor %}{{ '<|im_end|>\\n' }}{% endif %}"
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is not none %}{{ message['content'] }}{% endif %}"
    "{% for call in message['tool_calls'] or [] %}{{ '<tool_call>{\"name\": \"' }}"
    "{{ call['function']['name'] }}{{ '\", \"arguments\": ' }}"
    "{% if call['function']['arguments'] is string %}{{ call['function']['arguments'] }}"
    "{% else %}{{ call['function']['arguments'] | tojson }}{% endif %}{{ '}</tool_call>' }}{% endfor %}"
    "<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def build_bpe_tokenizer(out_dir: Path, vocab_size: int, texts: list[str] | None = None) -> int:
    """Train a byte-level BPE on ``texts`` (default: CPython's pydoc topics) and write
    tokenizer.json + tokenizer_config.json; return the vocabulary size."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    if texts is None:
        from pydoc_data.topics import topics
        texts = list(topics.values())
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(texts, trainer)
    bos = SPECIAL_TOKENS[0]
    tok.post_processor = processors.TemplateProcessing(
        single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, tok.token_to_id(bos))])
    out_dir.mkdir(parents=True, exist_ok=True)
    tok.save(str(out_dir / "tokenizer.json"))
    cfg = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": bos,
           "eos_token": SPECIAL_TOKENS[3], "pad_token": SPECIAL_TOKENS[1],
           "model_max_length": 1 << 20, "clean_up_tokenization_spaces": False,
           "chat_template": CHAT_TEMPLATE}
    (out_dir / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    return tok.get_vocab_size()


def hf_config(arch: str, *, vocab_size: int, hidden_size: int, intermediate_size: int,
              num_layers: int, num_heads: int, num_kv_heads: int, head_dim: int,
              max_position_embeddings: int, rope_theta: float, rms_norm_eps: float,
              tie_word_embeddings: bool, dtype: str, bos_token_id: int, eos_token_id: int) -> dict:
    cls, model_type = ARCHS[arch]
    cfg = {"architectures": [cls], "model_type": model_type, "vocab_size": vocab_size,
           "hidden_size": hidden_size, "intermediate_size": intermediate_size,
           "num_hidden_layers": num_layers, "num_attention_heads": num_heads,
           "num_key_value_heads": num_kv_heads, "head_dim": head_dim, "hidden_act": "silu",
           "max_position_embeddings": max_position_embeddings, "rms_norm_eps": rms_norm_eps,
           "rope_theta": rope_theta, "rope_scaling": None, "initializer_range": 0.02,
           "tie_word_embeddings": tie_word_embeddings, "torch_dtype": dtype,
           "attention_dropout": 0.0, "use_cache": True,
           "bos_token_id": bos_token_id, "eos_token_id": eos_token_id}
    if arch in ("llama", "qwen3"):
        cfg["attention_bias"] = False
    if arch == "llama":
        cfg["mlp_bias"] = False
    if arch in ("qwen2", "qwen3"):
        cfg.update(use_sliding_window=False, sliding_window=None, max_window_layers=num_layers)
    return cfg


def random_state_dict(cfg: dict, seed: int, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Weights named as transformers saves them; N(0, initializer_range), norms at 1."""
    g = torch.Generator().manual_seed(seed)
    std = cfg["initializer_range"]
    h, i, d = cfg["hidden_size"], cfg["intermediate_size"], cfg["head_dim"]
    q, kv = cfg["num_attention_heads"] * d, cfg["num_key_value_heads"] * d

    def w(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=g) * std).to(dtype)

    sd = {"model.embed_tokens.weight": w(cfg["vocab_size"], h), "model.norm.weight": torch.ones(h, dtype=dtype)}
    for n in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{n}."
        sd.update({p + "self_attn.q_proj.weight": w(q, h), p + "self_attn.k_proj.weight": w(kv, h),
                   p + "self_attn.v_proj.weight": w(kv, h), p + "self_attn.o_proj.weight": w(h, q),
                   p + "mlp.gate_proj.weight": w(i, h), p + "mlp.up_proj.weight": w(i, h),
                   p + "mlp.down_proj.weight": w(h, i),
                   p + "input_layernorm.weight": torch.ones(h, dtype=dtype),
                   p + "post_attention_layernorm.weight": torch.ones(h, dtype=dtype)})
        if cfg["model_type"] == "qwen2":
            sd.update({p + "self_attn.q_proj.bias": w(q), p + "self_attn.k_proj.bias": w(kv),
                       p + "self_attn.v_proj.bias": w(kv)})
        if cfg["model_type"] == "qwen3":
            sd.update({p + "self_attn.q_norm.weight": torch.ones(d, dtype=dtype),
                       p + "self_attn.k_norm.weight": torch.ones(d, dtype=dtype)})
    if not cfg["tie_word_embeddings"]:
        sd["lm_head.weight"] = w(cfg["vocab_size"], h)
    return sd


def write_checkpoint(out: Path, cfg: dict, state_dict: dict[str, torch.Tensor],
                     generation_config: dict, max_shard_bytes: int = 0) -> list[Path]:
    """Write config, generation config and safetensors (sharded above ``max_shard_bytes``)."""
    from safetensors.torch import save_file
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    (out / "generation_config.json").write_text(json.dumps(generation_config, indent=2) + "\n")
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, t in state_dict.items():
        nbytes = t.numel() * t.element_size()
        if max_shard_bytes and shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = t.contiguous()
        size += nbytes
    meta = {"format": "pt"}
    if len(shards) == 1:
        save_file(shards[0], str(out / "model.safetensors"), metadata=meta)
        return [out / "model.safetensors"]
    paths, weight_map = [], {}
    for k, shard in enumerate(shards, 1):
        name = f"model-{k:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(out / name), metadata=meta)
        weight_map.update({t: name for t in shard})
        paths.append(out / name)
    total = sum(t.numel() * t.element_size() for t in state_dict.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    return paths


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--arch", choices=sorted(ARCHS), default="llama")
    p.add_argument("--out", required=True, help="output directory (created)")
    p.add_argument("--hidden-size", type=int, default=256)
    p.add_argument("--intermediate-size", type=int, default=688)
    p.add_argument("--num-layers", type=int, default=4)
    p.add_argument("--num-heads", type=int, default=4)
    p.add_argument("--num-kv-heads", type=int, default=2)
    p.add_argument("--head-dim", type=int, default=0, help="0: hidden_size / num_heads")
    p.add_argument("--vocab-size", type=int, default=0,
                   help="0: the tokenizer's; larger pads the embedding as real models do")
    p.add_argument("--tokenizer", choices=["auto", "bpe"], default="auto",
                   help="auto: copy the default model's tokenizer when present, else train a BPE")
    p.add_argument("--tokenizer-vocab-size", type=int, default=512,
                   help="BPE vocabulary when no default-model tokenizer is there to copy")
    p.add_argument("--max-position-embeddings", type=int, default=2048)
    p.add_argument("--rope-theta", type=float, default=10000.0)
    p.add_argument("--rms-norm-eps", type=float, default=1e-6)
    p.add_argument("--tie-word-embeddings", action="store_true")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32")
    p.add_argument("--max-shard-size", type=size_arg, default=0, help="bytes per shard; 0: one file")
    p.add_argument("--seed", type=int, default=0)


def _check(args: argparse.Namespace) -> None:
    for f in ("hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads",
              "max_position_embeddings"):
        if getattr(args, f) < 1:
            raise SystemExit(f"--{f.replace('_', '-')} must be >= 1, got {getattr(args, f)}")
    if args.num_heads % args.num_kv_heads:
        raise SystemExit(f"--num-heads ({args.num_heads}) must be a multiple of --num-kv-heads ({args.num_kv_heads})")
    if not args.head_dim and args.hidden_size % args.num_heads:
        raise SystemExit(f"--hidden-size ({args.hidden_size}) must be a multiple of --num-heads "
                         f"({args.num_heads}) unless --head-dim is given")
    if (args.head_dim or args.hidden_size // args.num_heads) % 2:
        raise SystemExit("head_dim must be even (rotary embedding)")


def main(args: argparse.Namespace) -> int:
    _check(args)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    src = Path(DEFAULT_MODEL)
    if args.tokenizer == "auto" and (src / "tokenizer.json").is_file() \
            and (src / "tokenizer_config.json").is_file():
        for f in TOKENIZER_FILES:
            if (src / f).is_file():
                shutil.copyfile(src / f, out / f)
    else:
        build_bpe_tokenizer(out, args.tokenizer_vocab_size)
    from tokenizers import Tokenizer
    tok = Tokenizer.from_file(str(out / "tokenizer.json"))
    tok_vocab = tok.get_vocab_size()
    vocab = args.vocab_size or tok_vocab
    if vocab < tok_vocab:
        raise SystemExit(f"--vocab-size ({vocab}) must be >= the tokenizer's vocabulary ({tok_vocab})")
    tcfg = json.loads((out / "tokenizer_config.json").read_text())
    bos = tok.token_to_id(tcfg.get("bos_token") or SPECIAL_TOKENS[0])
    eos = tok.token_to_id(tcfg.get("eos_token") or SPECIAL_TOKENS[3])
    bos = 0 if bos is None else bos
    eos = 0 if eos is None else eos
    cfg = hf_config(args.arch, vocab_size=vocab, hidden_size=args.hidden_size,
                    intermediate_size=args.intermediate_size, num_layers=args.num_layers,
                    num_heads=args.num_heads, num_kv_heads=args.num_kv_heads,
                    head_dim=args.head_dim or args.hidden_size // args.num_heads,
                    max_position_embeddings=args.max_position_embeddings, rope_theta=args.rope_theta,
                    rms_norm_eps=args.rms_norm_eps, tie_word_embeddings=args.tie_word_embeddings,
                    dtype=args.dtype, bos_token_id=bos, eos_token_id=eos)
    sd = random_state_dict(cfg, args.seed, getattr(torch, args.dtype))
    # Stop at the end of a chat turn and at the end of text, as instruct checkpoints do.
    eos_ids = sorted({eos} | {i for t in SPECIAL_TOKENS[1::2] if (i := tok.token_to_id(t)) is not None})
    gen = {"bos_token_id": bos, "eos_token_id": eos_ids if len(eos_ids) > 1 else eos}
    files = write_checkpoint(out, cfg, sd, gen, args.max_shard_size)
    nparams = sum(t.numel() for t in sd.values())
    print(f"wrote {args.arch} checkpoint to {out}: {nparams / 1e6:.2f}M params, vocab {vocab}, "
          f"{len(files)} safetensors file(s)", file=sys.stderr)
    return 0
