"""`pipeline bench cpu --llamacpp DIR`: llama.cpp beside this engine on the same checkpoint.

DIR is a llama.cpp source tree built with cmake (``build/bin/llama-bench``,
``llama-batched-bench``, ``llama-quantize``; the `llama-cpp-python` sdist vendors one). Its
converter wants a tokenizer it recognises, which a bench checkpoint's word-level one is not,
so the checkpoint is written to GGUF here with the tree's own ``gguf-py`` (qwen2 tensor names,
an SPM vocabulary of the same words, float16 tensors: the weights are random, and q/k's rotary
layout only matters to the answers, not to the speed), then quantised to Q8_0 and Q4_0 by
``llama-quantize``. Decode at batch 1 is ``llama-bench -p 0 -n OUT``; batch B is
``llama-batched-bench -npp PROMPT -ntg OUT -npl B`` (its total time is the offline total).
``--no-repack``: the repacked q8_0 path dies with SIGILL in these VMs.
Owns the GGUF files it writes under --models-dir.
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

_NAMES = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
          "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
          "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm"}


def _gguf_name(hf: str) -> str:
    name = hf.removeprefix("model.")
    if name.startswith("layers."):
        _, i, rest = name.split(".", 2)
        mod, kind = rest.rsplit(".", 1)
        return f"blk.{i}.{_NAMES[mod]}.{kind}"
    return {"embed_tokens.weight": "token_embd.weight", "norm.weight": "output_norm.weight",
            "lm_head.weight": "output.weight"}[name]


def write_gguf(model: str, out: Path, tree: Path) -> None:
    """The checkpoint as a float16 GGUF (norms float32) for llama.cpp's qwen2 graph."""
    sys.path.insert(0, str(tree / "gguf-py"))
    import gguf
    import torch
    from safetensors import safe_open

    from pipeline.models.config import load_model_config
    from pipeline.models.loader import checkpoint_files
    c = load_model_config(model)
    w = gguf.GGUFWriter(str(out), "qwen2")
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_block_count(c.num_layers)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_heads)
    w.add_head_count_kv(c.num_kv_heads)
    w.add_rope_freq_base(c.rope.theta)
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    w.add_tokenizer_model("llama")
    w.add_token_list([f"\u2581w{i}" for i in range(c.vocab_size)])
    w.add_token_scores([0.0] * c.vocab_size)
    w.add_token_types([gguf.TokenType.NORMAL] * c.vocab_size)
    w.add_bos_token_id(1)
    w.add_eos_token_id(c.vocab_size - 1)
    for path in checkpoint_files(model):
        with safe_open(str(path), "pt") as f:
            for key in f.keys():
                t = f.get_tensor(key)
                dtype = torch.float32 if t.dim() == 1 else torch.float16
                w.add_tensor(_gguf_name(key), t.to(dtype).numpy())
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def _run(cmd: list[str]) -> str:
    p = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if p.returncode != 0:
        raise RuntimeError(f"{Path(cmd[0]).name} failed ({p.returncode}): {p.stderr[-2000:]}")
    return p.stdout


def quantized(model: str, models_dir: str, tree: Path, qtype: str) -> Path:
    """``<models_dir>/<name>-<qtype>.gguf`` (F16: the converted file itself), made once."""
    base = Path(models_dir) / f"{Path(model).name}-f16.gguf"
    if not base.is_file():
        write_gguf(model, base, tree)
    if qtype == "F16":
        return base
    out = base.with_name(f"{Path(model).name}-{qtype.lower()}.gguf")
    if not out.is_file():
        _run([str(tree / "build" / "bin" / "llama-quantize"), str(base), str(out), qtype])
    return out


def decode_b1(tree: Path, gguf_file: Path, threads: int, out_len: int) -> float:
    """Batch-1 decode tok/s (llama-bench's tg test, best of its repetitions' mean)."""
    res = json.loads(_run([str(tree / "build" / "bin" / "llama-bench"), "-m", str(gguf_file), "-p", "0",
                           "-n", str(out_len), "-t", str(threads), "-r", "3", "--repack", "0", "-o", "json"]))
    return float(res[0]["avg_ts"])


def batched(tree: Path, gguf_file: Path, threads: int, prompt_len: int, out_len: int, batch: int) -> dict[str, Any]:
    """``llama-batched-bench`` at one batch size: total seconds and decode tok/s."""
    ctx = batch * (prompt_len + out_len) + 64
    out = _run([str(tree / "build" / "bin" / "llama-batched-bench"), "-m", str(gguf_file), "-c", str(ctx),
                "-b", "2048", "-ub", "512", "-npp", str(prompt_len), "-ntg", str(out_len), "-npl", str(batch),
                "-t", str(threads), "--no-repack", "--output-format", "jsonl"])
    row = json.loads([line for line in out.splitlines() if line.startswith("{")][-1])
    return {"total_s": float(row["t"]), "decode_tok_per_s": float(row["speed_tg"]),
            "prefill_tok_per_s": float(row["speed_pp"])}


# Our weight format -> the llama.cpp type it is set against.
PEERS = {"bf16": "F16", "int8": "Q8_0", "int4": "Q4_0"}


def run_llamacpp(args, rep, shape: str, model: str, ours: dict[str, dict], batches: list[int]) -> None:
    """llama.cpp's rows for ``shape`` and the batch-1 targets against ``ours`` (offline results)."""
    tree = Path(args.llamacpp)
    big = max(batches)
    for fmt, qtype in PEERS.items():
        f = quantized(model, args.models_dir, tree, qtype)
        b1 = decode_b1(tree, f, args.threads, args.output_len)
        bb = batched(tree, f, args.threads, args.prompt_len, args.output_len, big)
        rep.add(f"{shape} llama.cpp {qtype}", decode_b1_tok_per_s=round(b1, 2),
                **{f"batch{big}_{k}": round(v, 3) for k, v in bb.items()})
        mine = ours.get(fmt, {}).get("batches", {})
        if "1" in mine:
            r = mine["1"]["decode_tok_per_s"] / b1
            goal = 1.3
            rep.target(f"{shape} {fmt} batch-1 decode vs llama.cpp {qtype}", round(r, 3), f">= {goal}", r >= goal)
        if str(big) in mine:
            r = bb["total_s"] / mine[str(big)]["total_s"]
            rep.target(f"{shape} {fmt} batch-{big} offline total vs llama.cpp {qtype}", round(r, 3), "> 1", r > 1)
