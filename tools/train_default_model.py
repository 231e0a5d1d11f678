"""Train the embedded default model (``pipeline/default_model``) from text CPython ships.

Offline tool, not a pipeline stage: it owns no runtime state. It trains a byte-level BPE
tokenizer (``tokenizers``) and a small Llama-architecture model (GQA, tied embeddings) on
the values of ``pydoc_data.topics`` and writes a checkpoint exactly as transformers'
``LlamaForCausalLM.save_pretrained`` lays it out, without importing transformers.

Usage::

    nice -n 5 .venv/bin/python tools/train_default_model.py --out pipeline/default_model \
        [--steps 800] [--seed 0] [--threads 1] [--curve /tmp/curve.json]
    # a draft for speculative decoding: the default model's tokenizer, one small layer
    .venv/bin/python tools/train_default_model.py --out /tmp/draft --tokenizer-from \
        pipeline/default_model --layers 1 --hidden 128 --intermediate 344 --heads 2 --kv-heads 1
    .venv/bin/python tools/train_default_model.py --sample pipeline/default_model \
        [--prompts tools/sample_prompts.txt]

The run is deterministic for a given seed, thread count, torch build and CPython version
(``pydoc_data.topics`` changes between CPython releases). ``--sample`` loads a written
checkpoint into the training model and prints greedy and temperature-0.8 completions of
each prompt (plain lines, or JSON lines with a "prompt" field as ``pipeline run`` reads).
"""

from __future__ import annotations

import argparse
import json
import math
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from torch import nn

BOS, EOS, PAD = "<|bos|>", "<|eos|>", "<|pad|>"
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}{{ message['role'] }}: "
    "{{ message['content'] }}\n\n{% endfor %}{% if add_generation_prompt %}assistant: {% endif %}"
)


@dataclass(slots=True, frozen=True)
class ModelArgs:
    vocab_size: int = 2048
    hidden_size: int = 256
    intermediate_size: int = 688
    num_layers: int = 4
    num_heads: int = 4
    num_kv_heads: int = 2
    max_position_embeddings: int = 2048
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in float32 and scale after casting back, as transformers' LlamaRMSNorm does.
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def rope_cos_sin(args: ModelArgs, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    # Non-interleaved halves (rotate_half) so q_proj/k_proj mean what they mean in HF Llama.
    inv = 1.0 / args.rope_theta ** (torch.arange(0, args.head_dim, 2, dtype=torch.int64).float() / args.head_dim)
    freqs = torch.outer(torch.arange(seq_len, dtype=torch.float32), inv)
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()


class Block(nn.Module):
    def __init__(self, a: ModelArgs, dropout: float) -> None:
        super().__init__()
        self.a = a
        self.dropout = dropout
        self.input_layernorm = RMSNorm(a.hidden_size, a.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(a.hidden_size, a.rms_norm_eps)
        self.q_proj = nn.Linear(a.hidden_size, a.num_heads * a.head_dim, bias=False)
        self.k_proj = nn.Linear(a.hidden_size, a.num_kv_heads * a.head_dim, bias=False)
        self.v_proj = nn.Linear(a.hidden_size, a.num_kv_heads * a.head_dim, bias=False)
        self.o_proj = nn.Linear(a.num_heads * a.head_dim, a.hidden_size, bias=False)
        self.gate_proj = nn.Linear(a.hidden_size, a.intermediate_size, bias=False)
        self.up_proj = nn.Linear(a.hidden_size, a.intermediate_size, bias=False)
        self.down_proj = nn.Linear(a.intermediate_size, a.hidden_size, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        a = self.a
        h = self.input_layernorm(x)
        q = self.q_proj(h).view(b, t, a.num_heads, a.head_dim).transpose(1, 2)
        k = self.k_proj(h).view(b, t, a.num_kv_heads, a.head_dim).transpose(1, 2)
        v = self.v_proj(h).view(b, t, a.num_kv_heads, a.head_dim).transpose(1, 2)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        # Residual dropout is training-only regularisation (the corpus is ~130k tokens); it
        # does not change what the weights mean at inference.
        attn = self.o_proj(o.transpose(1, 2).reshape(b, t, a.num_heads * a.head_dim))
        x = x + F.dropout(attn, self.dropout, self.training)
        h = self.post_attention_layernorm(x)
        mlp = self.down_proj(F.silu(self.gate_proj(h)) * self.up_proj(h))
        return x + F.dropout(mlp, self.dropout, self.training)


class TinyLlama(nn.Module):
    def __init__(self, a: ModelArgs, dropout: float = 0.0) -> None:
        super().__init__()
        self.a = a
        self.embed_tokens = nn.Embedding(a.vocab_size, a.hidden_size)
        self.layers = nn.ModuleList(Block(a, dropout) for _ in range(a.num_layers))
        self.norm = RMSNorm(a.hidden_size, a.rms_norm_eps)
        for p in self.parameters():
            if p.dim() == 2:
                nn.init.normal_(p, std=0.02)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        cos, sin = rope_cos_sin(self.a, ids.shape[1])
        x = self.embed_tokens(ids)
        for layer in self.layers:
            x = layer(x, cos, sin)
        return self.norm(x) @ self.embed_tokens.weight.T  # tied lm_head

    def hf_state_dict(self) -> dict[str, torch.Tensor]:
        out = {"model.embed_tokens.weight": self.embed_tokens.weight, "model.norm.weight": self.norm.weight}
        for i, layer in enumerate(self.layers):
            p = f"model.layers.{i}."
            for n in ("input_layernorm", "post_attention_layernorm"):
                out[f"{p}{n}.weight"] = getattr(layer, n).weight
            for n in ("q_proj", "k_proj", "v_proj", "o_proj"):
                out[f"{p}self_attn.{n}.weight"] = getattr(layer, n).weight
            for n in ("gate_proj", "up_proj", "down_proj"):
                out[f"{p}mlp.{n}.weight"] = getattr(layer, n).weight
        return {k: v.detach() for k, v in out.items()}

    def load_hf_state_dict(self, sd: dict[str, torch.Tensor]) -> None:
        mine = self.hf_state_dict()
        if set(sd) != set(mine):
            raise ValueError(f"weight names differ: {sorted(set(sd) ^ set(mine))[:5]}")
        with torch.no_grad():
            for k, v in mine.items():
                v.copy_(sd[k].to(v.dtype))

    @torch.no_grad()
    def generate(self, ids: list[int], n: int, temperature: float, eos: int, gen: torch.Generator) -> list[int]:
        out = list(ids)
        for _ in range(n):
            logits = self(torch.tensor([out[-self.a.max_position_embeddings:]]))[0, -1]
            if temperature == 0.0:
                nxt = int(logits.argmax())
            else:
                nxt = int(torch.multinomial(torch.softmax(logits / temperature, -1), 1, generator=gen))
            out.append(nxt)
            if nxt == eos:
                break
        return out[len(ids):]


def corpus() -> tuple[list[str], list[str]]:
    """Topics in sorted key order, split into paragraphs; every 20th paragraph (about 5% of
    the text) is held out for validation. Each topic yields one train and one val document."""
    from pydoc_data.topics import topics

    train, val, n = [], [], 0
    for key in sorted(topics):
        tr, va = [], []
        for para in topics[key].split("\n\n"):
            (va if n % 20 == 7 else tr).append(para)
            n += 1
        train += ["\n\n".join(tr)] if tr else []
        val += ["\n\n".join(va)] if va else []
    return train, val


def train_tokenizer(texts: list[str], vocab_size: int) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    # ByteLevel maps every byte to a symbol, so any UTF-8 string round-trips exactly.
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=[BOS, EOS, PAD], show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(texts, trainer=trainer)
    # Llama convention: encode(add_special_tokens=True) prepends BOS.
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, 0)]
    )
    return tok


def encode_docs(tok: Tokenizer, docs: list[str]) -> torch.Tensor:
    ids: list[int] = []
    for enc in tok.encode_batch(docs):  # each document: BOS text EOS
        ids.extend(enc.ids)
        ids.append(tok.token_to_id(EOS))
    return torch.tensor(ids, dtype=torch.long)


def write_checkpoint(out: Path, model: TinyLlama, tok: Tokenizer, dtype: torch.dtype) -> None:
    a = model.a
    out.mkdir(parents=True, exist_ok=True)
    dt = str(dtype).removeprefix("torch.")
    bos, eos, pad = (tok.token_to_id(t) for t in (BOS, EOS, PAD))
    config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "vocab_size": a.vocab_size, "hidden_size": a.hidden_size,
        "intermediate_size": a.intermediate_size, "num_hidden_layers": a.num_layers,
        "num_attention_heads": a.num_heads, "num_key_value_heads": a.num_kv_heads,
        "head_dim": a.head_dim, "hidden_act": "silu",
        "max_position_embeddings": a.max_position_embeddings, "initializer_range": 0.02,
        "rms_norm_eps": a.rms_norm_eps, "rope_theta": a.rope_theta, "rope_scaling": None,
        "rope_parameters": {"rope_theta": a.rope_theta, "rope_type": "default"},
        "attention_bias": False, "attention_dropout": 0.0, "mlp_bias": False,
        "pretraining_tp": 1, "tie_word_embeddings": True, "use_cache": True,
        "bos_token_id": bos, "eos_token_id": eos, "pad_token_id": pad,
        "torch_dtype": dt, "dtype": dt,
    }
    sd = {k: v.to(dtype).contiguous() for k, v in model.hf_state_dict().items()}
    save_file(sd, str(out / "model.safetensors"), metadata={"format": "pt"})
    tok.save(str(out / "tokenizer.json"))
    tok_cfg = {
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": BOS, "eos_token": EOS,
        "pad_token": PAD, "unk_token": None, "add_bos_token": True, "add_eos_token": False,
        "clean_up_tokenization_spaces": False, "model_max_length": a.max_position_embeddings,
        "chat_template": CHAT_TEMPLATE,
    }
    gen_cfg = {"bos_token_id": bos, "eos_token_id": [eos], "pad_token_id": pad}
    for name, obj in (("config.json", config), ("tokenizer_config.json", tok_cfg),
                      ("generation_config.json", gen_cfg)):
        (out / name).write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n")


def load_checkpoint(path: Path) -> tuple[TinyLlama, Tokenizer]:
    c = json.loads((path / "config.json").read_text())
    a = ModelArgs(c["vocab_size"], c["hidden_size"], c["intermediate_size"], c["num_hidden_layers"],
                  c["num_attention_heads"], c["num_key_value_heads"], c["max_position_embeddings"],
                  c["rope_theta"], c["rms_norm_eps"])
    model = TinyLlama(a)
    model.load_hf_state_dict(load_file(str(path / "model.safetensors")))
    return model.eval(), Tokenizer.from_file(str(path / "tokenizer.json"))


@torch.no_grad()
def eval_loss(model: TinyLlama, data: torch.Tensor, seq: int) -> float:
    model.eval()
    n = (len(data) - 1) // seq
    x = data[: n * seq].view(n, seq)
    y = data[1 : n * seq + 1].view(n, seq)
    losses = [F.cross_entropy(model(x[i:i + 16]).flatten(0, 1), y[i:i + 16].flatten(), reduction="sum")
              for i in range(0, n, 16)]
    model.train()
    return float(sum(losses)) / (n * seq)


def train(args: argparse.Namespace) -> None:
    torch.manual_seed(args.seed)
    torch.use_deterministic_algorithms(True)
    train_docs, val_docs = corpus()
    # A draft model for speculative decoding shares the target's tokenizer (--tokenizer-from).
    tok = (Tokenizer.from_file(str(Path(args.tokenizer_from) / "tokenizer.json")) if args.tokenizer_from
           else train_tokenizer(train_docs, args.vocab))
    tr, va = encode_docs(tok, train_docs), encode_docs(tok, val_docs)
    print(f"tokens: train {len(tr)}, val {len(va)} ({sum(map(len, train_docs))} train chars)", flush=True)
    model = TinyLlama(ModelArgs(vocab_size=tok.get_vocab_size(), num_layers=args.layers, hidden_size=args.hidden,
                                intermediate_size=args.intermediate, num_heads=args.heads,
                                num_kv_heads=args.kv_heads), args.dropout)
    print(f"params: {sum(p.numel() for p in model.parameters())}", flush=True)
    decay = [p for p in model.parameters() if p.dim() == 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.95))
    warm = max(1, args.steps // 20)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / warm) * (
        0.1 + 0.45 * (1 + math.cos(math.pi * min(1.0, max(0, s - warm) / max(1, args.steps - warm))))))
    gen = torch.Generator().manual_seed(args.seed)
    curve: list[dict[str, float]] = []
    t0, acc = time.time(), 0.0
    for step in range(1, args.steps + 1):
        starts = torch.randint(0, len(tr) - args.seq - 1, (args.batch,), generator=gen)
        x = torch.stack([tr[s:s + args.seq] for s in starts.tolist()])
        y = torch.stack([tr[s + 1:s + args.seq + 1] for s in starts.tolist()])
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        acc += loss.item()
        if step % args.log_every == 0 or step == args.steps:
            k = step % args.log_every or args.log_every
            row = {"step": step, "train_loss": round(acc / k, 4), "elapsed_s": round(time.time() - t0, 1)}
            if step % args.eval_every == 0 or step == args.steps:
                row["val_loss"] = round(eval_loss(model, va, args.seq), 4)
            curve.append(row)
            print(json.dumps(row), flush=True)
            acc = 0.0
    write_checkpoint(Path(args.out), model, tok, torch.bfloat16)
    reloaded, _ = load_checkpoint(Path(args.out))
    print(f"val loss of the written bfloat16 checkpoint: {eval_loss(reloaded, va, args.seq):.4f}", flush=True)
    if args.curve:
        Path(args.curve).write_text(json.dumps(curve, indent=1) + "\n")


def sample(args: argparse.Namespace) -> None:
    model, tok = load_checkpoint(Path(args.sample))
    eos = tok.token_to_id(EOS)
    lines = [ln for ln in Path(args.prompts).read_text().splitlines() if ln.strip()]
    prompts = [json.loads(ln)["prompt"] if ln.lstrip().startswith("{") else ln for ln in lines]
    gen = torch.Generator().manual_seed(args.seed)
    for p in prompts:
        ids = tok.encode(p).ids
        for temp in (0.0, 0.8):
            text = tok.decode(model.generate(ids, args.max_tokens, temp, eos, gen))
            print(f"### {p!r} T={temp}\n{p}{text}\n", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="pipeline/default_model", help="checkpoint directory to write")
    ap.add_argument("--steps", type=int, default=800)
    ap.add_argument("--seed", type=int, default=0)
    # One thread: two OpenMP threads stall whenever another job holds one of the two cores.
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=2048)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--intermediate", type=int, default=688)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--tokenizer-from", default=None,
                    help="a checkpoint whose tokenizer to keep (a draft model for speculative decoding)")
    ap.add_argument("--dropout", type=float, default=0.1)
    ap.add_argument("--log-every", type=int, default=25)
    ap.add_argument("--eval-every", type=int, default=100)
    ap.add_argument("--curve", default=None, help="write the loss curve as JSON here")
    ap.add_argument("--sample", default=None, help="sample from this checkpoint instead of training")
    ap.add_argument("--prompts", default="tools/sample_prompts.txt")
    ap.add_argument("--max-tokens", type=int, default=48)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if args.sample:
        sample(args)
    else:
        train(args)


if __name__ == "__main__":
    main()
