"""`pipeline bench cpu`: serving on a CPU at batch, this engine beside vLLM's CPU backend, on
the issue-23 shapes, in one run.

Shapes (random weights, written once under --models-dir by `make-model`, bf16 files):
``0.5b`` is Qwen2.5-0.5B's shape (24 layers, hidden 896, 14/2 heads, vocab 151936, tied);
``24m`` is the 24M Llama of `bench worker`. Each gets a word-level tokenizer over its whole
vocabulary, so that every token id decodes to text: a random model emits ids anywhere in the
vocabulary, and both engines' streams then carry one chunk per token.

Offline (``cpu_offline``, one child process per engine and format): load, a warm-up, then per
batch size (--batches) a 1-token generate and a full one; total time, output tok/s, decode
tok/s from their difference, load time and peak RSS. HTTP: each engine's OpenAI server
(`pipeline serve --http`, `vllm serve`) under --http-requests streamed /v1/completions at
--http-concurrency, ``bench serve --http``'s client, rounds alternating ABBA between engines:
output tok/s, TTFT p50/p99, inter-token p50/p99, the share of gaps held by prefills, and the
products served per second against the engine's instruction peak (``served_peak_fraction``).

With ``--llamacpp DIR`` (a llama.cpp tree built with cmake) llama.cpp's F16, Q8_0 and Q4_0 run
beside bf16, int8 and int4 (``cpu_llamacpp``). With ``--vllm-env DIR`` (made by
../shared/tools/vllm-cpu.sh install DIR) vLLM runs beside this engine, with the same threads
(VLLM_CPU_OMP_THREADS_BIND=0-(threads-1)), and the issue's targets are reported as ratios.
Without it, the figures are set against the machine's limits measured in the same run
(``cpu_limits``: DRAM read bandwidth, peak FLOP/s).
Owns nothing beyond the run.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
from pathlib import Path
from typing import Any

from pipeline.bench.cpu_http import SIGPIPE_EXIT, run_http
from pipeline.bench.cpu_limits import limits, peak_for, prefill_flops, weight_bytes
from pipeline.bench.cpu_llamacpp import run_llamacpp
from pipeline.bench.report import Report

SHAPES: dict[str, dict[str, Any]] = {
    "0.5b": dict(arch="qwen2", hidden_size=896, intermediate_size=4864, num_layers=24, num_heads=14,
                 num_kv_heads=2, vocab_size=151936, tie_word_embeddings=True),
    "24m": dict(arch="llama", hidden_size=384, intermediate_size=1024, num_layers=12, num_heads=6,
                num_kv_heads=2, vocab_size=8192, tie_word_embeddings=False),
    # For the bench's own tests.
    "tiny": dict(arch="llama", hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                 num_kv_heads=2, vocab_size=1024, tie_word_embeddings=True),
}
_DTYPE = {"bf16": ("bfloat16", "none"), "int8": ("bfloat16", "int8"), "int4": ("bfloat16", "int4"),
          "float32": ("float32", "none")}
VLLM_SH = Path(__file__).resolve().parents[3] / "shared" / "tools" / "vllm-cpu.sh"


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--models-dir", default="/tmp/pipeline-bench-cpu", help="checkpoints, made once")
    p.add_argument("--shapes", default="0.5b,24m", help=f"comma-separated: {', '.join(SHAPES)}")
    p.add_argument("--formats", default="bf16,int8", help="ours, comma-separated: bf16, int8, int4, float32")
    p.add_argument("--batches", default="1,8,32", help="offline batch sizes")
    p.add_argument("--prompt-len", type=int, default=128, help="tokens")
    p.add_argument("--output-len", type=int, default=96, help="tokens per request")
    p.add_argument("--threads", type=int, default=2, help="worker threads, both engines")
    p.add_argument("--vllm-env", default="", help="vLLM's CPU virtualenv (vllm-cpu.sh install DIR)")
    p.add_argument("--vllm-formats", default="bf16",
                   help="the formats vLLM runs, after ours: bf16, float32 (an AVX2-only core emulates "
                   "bf16); HTTP serves the first")
    p.add_argument("--llamacpp", default="", help="a llama.cpp tree built with cmake (bench/cpu_llamacpp.py)")
    p.add_argument("--http-requests", type=int, default=64)
    p.add_argument("--http-concurrency", type=int, default=32)
    p.add_argument("--rounds", type=int, default=2, help="HTTP runs per engine, ABBA")
    p.add_argument("--serve-args", default="", help="extra `pipeline serve` flags, one string (e.g. --step-log F)")
    p.add_argument("--skip-offline", action="store_true")
    p.add_argument("--skip-http", action="store_true")
    p.add_argument("--repeats", type=int, default=2, help="offline: each timing the best of this many")
    p.add_argument("--seed", type=int, default=0)


def _wordlevel_tokenizer(out: Path, vocab: int) -> None:
    """Overwrite the checkpoint's tokenizer with one word per id (" w0".." wN", a Metaspace
    word each), eos = the last id (unused: the bench ignores eos)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    tok = Tokenizer(models.WordLevel({f"\u2581w{i}": i for i in range(vocab)}, unk_token="\u2581w0"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    tok.save(str(out / "tokenizer.json"))
    cfg = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "\u2581w1",
           "eos_token": f"\u2581w{vocab - 1}", "pad_token": "\u2581w0", "model_max_length": 1 << 20,
           "clean_up_tokenization_spaces": False}
    (out / "tokenizer_config.json").write_text(json.dumps(cfg) + "\n")
    for extra in ("special_tokens_map.json", "chat_template.jinja"):
        (out / extra).unlink(missing_ok=True)
    gen = out / "generation_config.json"
    if gen.is_file():
        g = json.loads(gen.read_text())
        g.update(bos_token_id=1, eos_token_id=vocab - 1)
        gen.write_text(json.dumps(g) + "\n")
    c = json.loads((out / "config.json").read_text())
    c.update(bos_token_id=1, eos_token_id=vocab - 1)
    (out / "config.json").write_text(json.dumps(c) + "\n")


def checkpoint(models_dir: str, shape: str) -> str:
    """The bf16 checkpoint of ``shape`` under ``models_dir``, made on first use."""
    out = Path(models_dir) / shape
    if not (out / "config.json").is_file() or not (out / ".bench-ready").is_file():
        from pipeline.models import make_model
        s = SHAPES[shape]
        # (a throwaway 300-token BPE: _wordlevel_tokenizer replaces it)
        ns = argparse.Namespace(out=str(out), head_dim=0, tokenizer="bpe", tokenizer_vocab_size=300,
                                max_position_embeddings=2048, rope_theta=1000000.0, rms_norm_eps=1e-6,
                                dtype="bfloat16", max_shard_size=0, seed=0, **s)
        make_model.main(ns)
        _wordlevel_tokenizer(out, s["vocab_size"])
        (out / ".bench-ready").touch()
    return str(out)


def prompts(vocab: int, n: int, length: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(2, vocab - 1) for _ in range(length)] for _ in range(n)]


def _child(args, engine: str, model: str, fmt: str, ps: list[list[int]], batches: list[int]) -> dict:
    dtype, quant = _DTYPE[fmt]
    spec = {"engine": engine, "model": model, "dtype": dtype, "quantization": quant,
            "threads": args.threads, "max_model_len": args.prompt_len + args.output_len + 16,
            "max_num_seqs": max(batches), "output_len": args.output_len, "batches": batches,
            "repeats": args.repeats,
            "prompts": ps}
    script = str(Path(__file__).with_name("cpu_offline.py"))
    if engine == "vllm":
        cmd = ["bash", str(VLLM_SH), "python", args.vllm_env, script, json.dumps(spec)]
    else:
        cmd = [sys.executable, script, json.dumps(spec)]
    env = dict(os.environ, VLLM_CPU_OMP_THREADS_BIND=f"0-{args.threads - 1}")
    for _ in range(3):  # vllm-cpu.sh's SIGPIPE at start (cpu_http.SIGPIPE_EXIT)
        p = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
        if p.returncode != SIGPIPE_EXIT:
            break
    if p.returncode != 0:
        raise RuntimeError(f"{engine} {fmt} offline run failed ({p.returncode}):\n{p.stderr[-3000:]}")
    return json.loads(p.stdout.strip().splitlines()[-1])


def offline(args, rep: Report, shape: str, model: str, batches: list[int], lim: dict) -> dict:
    from pipeline.models.config import load_model_config
    vocab = load_model_config(model).vocab_size
    ps = prompts(vocab, max(batches), args.prompt_len, args.seed)
    res: dict[str, dict] = {}
    for fmt in args.formats.split(","):
        res[fmt] = _child(args, "pipeline", model, fmt, ps, batches)
    for fmt in args.vllm_formats.split(",") if args.vllm_env else ():
        res[f"vllm {fmt}"] = _child(args, "vllm", model, fmt, ps, batches)
    for name, r in res.items():
        fmt = name.split()[-1]
        wb = weight_bytes(model, fmt)
        for b, f in r["batches"].items():
            row = rep.add(f"{shape} offline {name} batch {b}", **{k: round(v, 6) for k, v in f.items()},
                          load_s=round(r["load_s"], 2), max_rss_mib=round(r["max_rss_mib"]),
                          rss_mib=round(r["rss_mib"]))
            # Decode reads every weight once per step: tok/s per sequence x bytes vs the bandwidth.
            row["decode_bw_fraction"] = round(f["decode_tok_per_s"] / int(b) * wb / lim["read_bytes_per_s"], 3)
            # The 1-token generate is the prefill: its products against the instructions' peak.
            flop, peak = prefill_flops(model, int(b), args.prompt_len), peak_for(fmt, lim)
            row["prefill_gflop_s"] = round(flop / f["prefill_s"] / 1e9, 1)
            if peak:
                row["prefill_peak_fraction"] = round(flop / f["prefill_s"] / peak, 3)
    return res


def check_args(args: argparse.Namespace) -> list[int]:
    """The batch sizes; ValueError naming the flag and its limit."""
    try:
        batches = [int(b) for b in args.batches.split(",")]
    except ValueError:
        raise ValueError(f"--batches: comma-separated integers, got {args.batches!r}") from None
    for flag, v in (("--batches", min(batches)), ("--threads", args.threads), ("--repeats", args.repeats),
                    ("--prompt-len", args.prompt_len), ("--output-len", args.output_len - 1),
                    ("--http-requests", args.http_requests), ("--http-concurrency", args.http_concurrency),
                    ("--rounds", args.rounds)):
        if v < 1:
            raise ValueError(f"{flag} must be >= {1 + (flag == '--output-len')}")
    for shape in args.shapes.split(","):
        if shape not in SHAPES:
            raise ValueError(f"--shapes: unknown {shape!r}; one of {', '.join(SHAPES)}")
    for fmt in args.formats.split(","):
        if fmt not in _DTYPE:
            raise ValueError(f"--formats: unknown {fmt!r}; one of {', '.join(_DTYPE)}")
    for fmt in args.vllm_formats.split(","):
        if fmt not in ("bf16", "float32"):
            raise ValueError(f"--vllm-formats: unknown {fmt!r}; one of bf16, float32")
    return batches


def main(args: argparse.Namespace) -> int:
    rep = Report("cpu")
    try:
        batches = check_args(args)
        if args.vllm_env and not Path(args.vllm_env, "bin", "python").is_file():
            raise ValueError(f"--vllm-env {args.vllm_env}: no bin/python there (vllm-cpu.sh install DIR)")
        if args.llamacpp and not Path(args.llamacpp, "build", "bin", "llama-bench").is_file():
            raise ValueError(f"--llamacpp {args.llamacpp}: no build/bin/llama-bench there (cmake --build build)")
        if args.vllm_env and not VLLM_SH.is_file():
            raise ValueError(f"--vllm-env needs {VLLM_SH} (the project's shared tools)")
    except ValueError as exc:
        print(f"pipeline bench cpu: {exc}", file=sys.stderr)
        return 2
    lim = limits(args.threads)
    rep.add("limits", **lim)
    for shape in args.shapes.split(","):
        model = checkpoint(args.models_dir, shape)
        if not args.skip_offline:
            _section(rep, f"{shape} offline", _offline_section, args, rep, shape, model, batches, lim)
        if not args.skip_http:
            _section(rep, f"{shape} http", run_http, args, rep, shape, model, lim)
    if args.vllm_env:
        _reap_kmp_files()
    return rep.emit(args.json)


def _reap_kmp_files() -> None:
    """vLLM's Intel OpenMP registers each process in /dev/shm/__KMP_REGISTERED_LIB_<pid>_<n>
    and removes the file only at a normal exit; its workers are killed at shutdown. The files
    of processes that are gone are removed, so a run leaves /dev/shm as it found it."""
    for f in Path("/dev/shm").glob("__KMP_REGISTERED_LIB_*"):
        pid = f.name.split("_")[-2]
        if pid.isdigit() and not Path(f"/proc/{pid}").exists():
            f.unlink(missing_ok=True)


def _section(rep: Report, name: str, run, *a) -> None:
    """A part of the run; its failure is a row and a missed target, and the rest still runs
    (one peer's crash must not lose the other figures of a 30-minute run)."""
    try:
        run(*a)
    except (RuntimeError, OSError, ValueError, KeyError) as exc:
        rep.add(f"{name} failed", error=str(exc)[-2000:])
        rep.target(f"{name} ran", 0, "== 1", False)


def _offline_section(args, rep: Report, shape: str, model: str, batches: list[int], lim: dict) -> None:
    res = offline(args, rep, shape, model, batches, lim)
    big = str(max(batches))
    # Against vLLM's bf16, or its float32 where that is the one it ran (an AVX2-only core
    # emulates bf16: docs/benchmarks.md)
    peer = next((f"vllm {f}" for f in ("bf16", "float32") if f"vllm {f}" in res), "")
    if peer and "bf16" in res:
        vs = "vLLM CPU" + (" float32" if peer.endswith("float32") else "")
        ours, theirs = res["bf16"]["batches"][big], res[peer]["batches"][big]
        r = theirs["total_s"] / ours["total_s"]
        rep.target(f"{shape} bf16 batch-{big} offline total vs {vs}", round(r, 3), ">= 1.25", r >= 1.25)
        b1 = res["bf16"]["batches"].get("1"), res[peer]["batches"].get("1")
        if b1[0] and b1[1]:
            r = b1[0]["decode_tok_per_s"] / b1[1]["decode_tok_per_s"]
            rep.target(f"{shape} bf16 batch-1 decode vs {vs}", round(r, 3), ">= 1.3", r >= 1.3)
    if "int8" in res and "bf16" in res:
        r = res["bf16"]["batches"][big]["total_s"] / res["int8"]["batches"][big]["total_s"]
        rep.target(f"{shape} int8 batch-{big} vs bf16 batch-{big}", round(r, 3), ">= 1.3", r >= 1.3)
    if args.llamacpp:
        run_llamacpp(args, rep, shape, model, res, batches)
    if "int4" in res and "int8" in res and "1" in res["int4"]["batches"]:
        r = res["int4"]["batches"]["1"]["decode_tok_per_s"] / res["int8"]["batches"]["1"]["decode_tok_per_s"]
        rep.target(f"{shape} int4 batch-1 decode vs int8", round(r, 3), ">= 1.7", r >= 1.7)
