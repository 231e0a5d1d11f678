"""`pipeline bench worker`: decode tokens/s at batch 1, 8, 32 and prefill tokens/s of the model
worker against transformers' `generate` on the same checkpoint, in the same run, plus batch-1
decode as a fraction of the memory-bandwidth limit: the machine's read bandwidth (a parallel
read of a buffer far larger than the caches, every core) over the weight bytes one decode
step reads. With ``--formats`` (default float32,bf16,int8,int4) the worker runs once per weight
format in the same run (bf16: ``--dtype bfloat16``, int8/int4: ``--quantization int8|int4``
with the checkpoint's dtype as a user's run gets it, so a bf16 checkpoint's KV cache is bf16;
all under float32 activations on CPU), and the issue-12 targets compare them with float32
(issue 23's: int4 batch 1 with int8).
``--device cuda`` runs both sides on the GPU (float32 and bf16 only; transformers in each
format's dtype) against the GPU's own read bandwidth.

Owns nothing; drives a ModelRunner directly with hand-built SchedulerOutputs (no engine), so
the figures are the worker's alone. transformers is imported here only (a bench dependency).
"""
from __future__ import annotations

import argparse
import gc
import os
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from pipeline.bench.bandwidth import cuda_read_bandwidth, read_bandwidth
from pipeline.bench.peak import add_peak_rows, cuda_peaks, instruction_peaks, projection_params
from pipeline.bench.report import Report
from pipeline.bench.steps import Steps
from pipeline.config import EngineConfig

PROMPT_LEN = 16
_clock = time.perf_counter


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="", help="checkpoint dir; default: make a 25.7M-param llama")
    p.add_argument("--batch-sizes", default="1,8,32")
    p.add_argument("--decode-steps", type=int, default=16, help="decode steps per timed window")
    p.add_argument("--repeats", type=int, default=3,
                   help="timed windows per figure; the best counts (robust to a busy machine)")
    p.add_argument("--prefill-tokens", type=int, default=512, help="tokens in the prefill step")
    p.add_argument("--prefill-seqs", type=int, default=4, help="prompts sharing them, of equal length")
    p.add_argument("--threads", type=int, default=0,
                   help="torch threads for both sides; 0: the worker's default (a team that adapts, from every core)")
    p.add_argument("--clock", choices=["wall", "cpu"], default="wall",
                   help="cpu: this process's CPU time (with --threads 1: tokens per core-second, "
                        "immune to other processes taking the cores)")
    p.add_argument("--skip-hf", action="store_true", help="do not run transformers")
    p.add_argument("--formats", default="float32,bf16,int8,int4",
                   help="weight formats to run, comma-separated: float32, bf16, int8, int4 (CPU only; "
                        "int4 in groups of 128)")
    p.add_argument("--peak", action="store_true",
                   help="prefill and batched decode as a fraction of the peak of the instructions "
                        "each format runs on (AMX tiles, or float32 FMAs for bf16/float32 with "
                        "AVX2 alone; on a GPU its matrix products), measured in the same run "
                        "(bench/peak.py)")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"],
                   help="cuda: both sides on the GPU, transformers in each format's dtype")


def make_bench_model(out: Path) -> None:
    from pipeline.models import make_model
    ns = argparse.Namespace(
        arch="llama", out=str(out), hidden_size=384, intermediate_size=1024, num_layers=12,
        num_heads=6, num_kv_heads=2, head_dim=0, vocab_size=8192, tokenizer="auto",
        tokenizer_vocab_size=512, max_position_embeddings=2048, rope_theta=10000.0,
        rms_norm_eps=1e-6, tie_word_embeddings=False, dtype="float32", max_shard_size=0, seed=0)
    make_model.main(ns)


def bench_model(model: str, tmp: str) -> tuple[str, int]:
    """(checkpoint dir, vocab to draw prompt ids from): ``model``, or the 25M checkpoint
    written under ``tmp``."""
    from pipeline.models.config import load_model_config
    if not model:
        model = str(Path(tmp) / "model")
        make_bench_model(Path(model))
    return model, min(load_model_config(model).vocab_size, 512)


# format -> (--dtype, --quantization). The quantized formats keep --dtype auto, as a user's
# `--quantization int4` does: the KV cache in the checkpoint's dtype (bf16 for a bf16 one,
# whose attention then reads half the bytes of a float32 cache).
FORMAT_FLAGS = {"float32": ("float32", "none"), "bf16": ("bfloat16", "none"),
                "int8": ("auto", "int8"), "int4": ("auto", "int4")}


def step_weight_bytes(model: torch.nn.Module, tied: bool) -> int:
    """Bytes of weights one decode step reads: every parameter and packed (bf16/int8/int4)
    weight, less an untied embedding table (only its looked-up rows are read)."""
    from pipeline.layers.int4 import PACKED
    total = sum(p.numel() * p.element_size() for n, p in model.named_parameters()
                if n != "embed_tokens" or tied)
    return total + sum(m.step_nbytes for n, m in model.named_modules()
                       if isinstance(m, PACKED) and (n != "embed_tokens" or tied))


def bench_formats(model_dir: str, formats: list[str], batches: list[int], steps: int,
                  prefill_tokens: int, vocab: int, repeats: int, device: str = "cpu",
                  n_seq: int = 4) -> dict[str, tuple[dict[int, float], float, int]]:
    """Per format: (decode tok/s per batch size, prefill tok/s, weight bytes per step). One
    ModelRunner per format, all loaded at once; every timed window alternates the formats,
    so a machine whose speed drifts (a shared VM) weighs on all of them alike."""
    from pipeline.worker.model_runner import ModelRunner
    max_b = max(batches)
    plen = prefill_tokens // n_seq
    runners: dict[str, ModelRunner] = {}
    try:
        for fmt in formats:
            dtype, quantization = FORMAT_FLAGS[fmt]
            runners[fmt] = ModelRunner(EngineConfig.of(
                model=model_dir, device=device, dtype=dtype, quantization=quantization,
                block_size=16, max_num_seqs=max(max_b, n_seq),  # the prefill step admits n_seq
                num_blocks=max(max_b * -(-(PROMPT_LEN + repeats * steps + 4) // 16),
                               n_seq * -(-(plen + 1) // 16), 1024 // 16 * 4) + 8,
                max_num_batched_tokens=max(prefill_tokens, 256)))
            runners[fmt].load()
        gc.freeze()  # as the worker stage does once loaded (runtime/process.py)
        rng = np.random.default_rng(0)
        decode: dict[str, dict[int, float]] = {f: {} for f in formats}
        s = {f: Steps(r) for f, r in runners.items()}
        for b in batches:
            prompts = rng.integers(3, vocab, (b, PROMPT_LEN)).tolist()
            ids = {f: s[f].admit(prompts, repeats * steps + 2, f"d{b}-")[1] for f in formats}
            computed = PROMPT_LEN
            for _ in range(2):  # warm-up
                for f in formats:
                    s[f].decode(ids[f], computed)
                computed += 1
            best = dict.fromkeys(formats, float("inf"))
            for _ in range(repeats):
                for f in formats:
                    c = computed
                    t = _clock()
                    for _ in range(steps):
                        s[f].decode(ids[f], c)
                        c += 1
                    best[f] = min(best[f], _clock() - t)
                computed += steps
            for f in formats:
                decode[f][b] = b * steps / best[f]
                s[f].finish(ids[f])
        prefill = dict.fromkeys(formats, float("inf"))
        for rep in range(repeats):
            prompts = rng.integers(3, vocab, (n_seq, plen)).tolist()
            for f in formats:
                t = _clock()
                _, pids = s[f].admit(prompts, 1, f"p{rep}-")
                prefill[f] = min(prefill[f], _clock() - t)
                s[f].finish(pids)
        out = {}
        for f, r in runners.items():
            assert r.model is not None  # set by load()
            out[f] = (decode[f], n_seq * plen / prefill[f],
                      step_weight_bytes(r.model, r.model_config.tie_word_embeddings))
        return out
    finally:
        gc.unfreeze()
        for r in runners.values():
            r.close()


def bench_ours(model_dir: str, batches: list[int], steps: int, prefill_tokens: int,
               vocab: int, repeats: int, fmt: str = "float32") -> tuple[dict[int, float], float, int]:
    return bench_formats(model_dir, [fmt], batches, steps, prefill_tokens, vocab, repeats)[fmt]


def bench_hf(model_dir: str, batches: list[int], steps: int, prefill_tokens: int,
             vocab: int, repeats: int, device: str = "cpu", dtype: torch.dtype = torch.float32,
             n_seq: int = 4) -> tuple[dict[int, float], float]:
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(device).eval()
    rng = np.random.default_rng(0)
    decode: dict[int, float] = {}
    # the GPU runs ahead of Python: a time is taken once its work is done (ours: .cpu() waits)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)

    def gen(ids: torch.Tensor, n: int) -> float:
        sync()
        t = _clock()
        model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                       do_sample=False, eos_token_id=None, pad_token_id=0)
        sync()
        return _clock() - t

    with torch.inference_mode():
        for b in batches:
            ids = torch.from_numpy(rng.integers(3, vocab, (b, PROMPT_LEN))).to(device)
            gen(ids, 2)  # warm-up
            one = min(gen(ids, 1) for _ in range(repeats))
            full = min(gen(ids, steps + 1) for _ in range(repeats))
            decode[b] = b * steps / max(full - one, 1e-9)
        ids = torch.from_numpy(rng.integers(3, vocab, (n_seq, prefill_tokens // n_seq))).to(device)
        model(ids)
        best = float("inf")
        for _ in range(repeats):
            sync()
            t = _clock()
            model(ids)
            sync()
            best = min(best, _clock() - t)
    return decode, ids.numel() / best


def main(args: argparse.Namespace) -> int:
    global _clock
    _clock = time.process_time if args.clock == "cpu" else time.perf_counter
    if args.threads:
        os.environ["PIPELINE_WORKER_THREADS"] = str(args.threads)
    batches = [int(x) for x in args.batch_sizes.split(",") if x]
    if not 1 <= args.prefill_seqs <= args.prefill_tokens:
        raise SystemExit(f"--prefill-seqs: {args.prefill_seqs} must be between 1 and --prefill-tokens "
                         f"({args.prefill_tokens})")
    if args.device == "cuda" and args.clock == "cpu":
        raise SystemExit("--clock cpu: this process's CPU time does not time GPU work; use --clock wall")
    from pipeline.worker.device import worker_threads
    from pipeline.worker.threads import usable_cores
    # transformers gets the worker's fixed team, or every core (where the worker's starts)
    torch.set_num_threads(worker_threads() or usable_cores())
    cuda = args.device == "cuda"
    read_bw = cuda_read_bandwidth if cuda else read_bandwidth
    bw = read_bw()
    with tempfile.TemporaryDirectory(prefix="pipeline-bench-worker-") as tmp:
        model_dir, vocab = bench_model(args.model, tmp)
        formats = [f for f in args.formats.split(",") if f]
        for f in formats:
            if f not in FORMAT_FLAGS:
                raise SystemExit(f"--formats: {f!r} is not one of {', '.join(FORMAT_FLAGS)}")
            if cuda and FORMAT_FLAGS[f][1] != "none":
                raise SystemExit(f"--formats: {f} runs on the CPU only, not with --device cuda")
        params = projection_params(model_dir) if args.peak else (0, 0, 0)
        runs = bench_formats(model_dir, formats, batches, args.decode_steps,
                             args.prefill_tokens, vocab, args.repeats, args.device, args.prefill_seqs)
        # transformers per format: in float32 for all on CPU (its own bf16 there is no baseline),
        # in each format's dtype on the GPU
        hf_runs: dict[str, tuple[dict[int, float], float]] = {}
        if not args.skip_hf:
            for f in formats if cuda else ["float32"]:
                hf_runs[f] = bench_hf(model_dir, batches, args.decode_steps, args.prefill_tokens, vocab,
                                      args.repeats, args.device, getattr(torch, FORMAT_FLAGS[f][0]),
                                      args.prefill_seqs)
    bw = max(bw, read_bw())  # best of two, apart in time: the cores are shared
    rep = Report("worker")
    rep.machine["device"] = torch.cuda.get_device_name() if cuda else "cpu"
    rep.machine["torch_threads"] = torch.get_num_threads()
    rep.machine["clock"] = args.clock
    rep.machine["read_gb_s"] = round(bw / 1e9, 2)
    rep.machine["read_threads"] = len(os.sched_getaffinity(0))
    rep.machine["loadavg_1m"] = round(os.getloadavg()[0], 2)  # other work sharing the cores
    for f, (ours, ours_prefill, weight_bytes) in runs.items():
        hf, hf_prefill = hf_runs.get(f if cuda else "float32", ({}, 0.0))
        tag = "" if f == "float32" else f" {f}"
        rep.machine[f"weight_mib{tag.replace(' ', '_')}"] = round(weight_bytes / 2**20, 1)
        for b in batches:
            row = {"pipeline_tok_s": ours[b]}
            if hf:
                row.update(hf_tok_s=hf[b], speedup=ours[b] / hf[b])
            rep.add(f"decode batch {b}{tag}", **row)
        row = {"pipeline_tok_s": ours_prefill}
        if hf:
            row.update(hf_tok_s=hf_prefill, speedup=ours_prefill / hf_prefill)
        rep.add(f"prefill {args.prefill_tokens} tokens ({args.prefill_seqs} seqs){tag}", **row)
        if 1 in ours:
            limit = bw / weight_bytes
            frac = ours[1] / limit
            rep.add(f"decode batch 1 vs bandwidth limit{tag}", pipeline_tok_s=ours[1],
                    limit_tok_s=limit, fraction=frac)
            if f == "float32":
                rep.target("batch-1 decode / read-bandwidth limit", round(frac, 3), ">= 0.8",
                           frac >= 0.8)
    if "int8" in runs and "int4" in runs and 1 in batches:
        r = runs["int4"][0][1] / runs["int8"][0][1]
        rep.target("int4 batch-1 decode vs int8", round(r, 2), ">= 1.7x", r >= 1.7)
        # what reading fewer bytes allows: the ratio of the two steps' weight bytes
        rep.machine["int8_over_int4_weight_bytes"] = round(runs["int8"][2] / runs["int4"][2], 3)
    if args.peak:
        if not cuda:
            rep.machine["peak_threads"] = torch.get_num_threads()
        peaks = cuda_peaks() if cuda else instruction_peaks(torch.get_num_threads())
        add_peak_rows(rep, runs, batches, args.prefill_tokens, args.prefill_seqs, params, peaks, bw)
    if "float32" in runs:
        base, base_prefill, _ = runs["float32"]
        goals = (("bf16", 1, 1.8), ("int8", 1, 2.5), ("bf16", 32, 1.4), ("int8", 32, 1.0))
        for f, b, goal in goals:
            if f in runs and b in base:
                r = runs[f][0][b] / base[b]
                rep.target(f"{f} batch-{b} decode vs float32", round(r, 2), f">= {goal}x", r >= goal)
        if "bf16" in runs:
            r = runs["bf16"][1] / base_prefill
            rep.target("bf16 prefill tokens/s vs float32", round(r, 2), ">= 1.3x", r >= 1.3)
        ours = base
        hf = hf_runs.get("float32", ({}, 0.0))[0]
        if hf and 32 in ours:
            r = ours[32] / hf[32]
            rep.target("batch-32 decode vs transformers", round(r, 2), ">= 4x", r >= 4)
        if hf and 1 in ours:
            r = ours[1] / hf[1]
            rep.target("batch-1 decode vs transformers", round(r, 2), ">= 2x", r >= 2)
    return rep.emit(args.json)
