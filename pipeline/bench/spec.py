"""`pipeline bench spec`: speculative decoding (issue 27) on against off in the same run, on
the in-process ``LLM`` (default: the embedded default model, as a user gets it):

1. ``continue``: the model's own greedy continuations of a few prompts (a small model's
   output repeats itself): n-gram and suffix, batch 1 and 8 (target: n-gram >= 1.8x at batch 1);
2. ``agent``: loops of requests whose prompt carries the previous answer with one word
   changed, as an agent's observation does (target: suffix >= 2x at batch 1);
3. ``floor``: unseeded sampling at temperature 1, where few drafts are accepted (target: no
   worse than 3 % below off);
4. draft models on ``continue``: the target drafting for itself (``draft_self``: every draft
   accepted, the ceiling of acceptance; it costs a target forward per draft) and a random
   one-layer draft (``draft_random``: the floor, target no worse than 3 % below off).

Each figure is output tok/s with the method on over off, runs alternating ABBA (a fresh
``LLM`` for each run, so no index learns from a previous run), the median of the pairs'
ratios; greedy outputs are checked equal on and off. ``--interleave``: each round runs the
two engines side by side in the process, every generate call on one then the other (the order
alternating), each timed apart: on a shared machine load that comes and goes within a run
falls on both alike, where whole runs one after the other can differ by +-30 %. Acceptance: tokens per verify step
(``spec_mean_acceptance_length``) and accepted drafts per position; ``ceiling``: the speedup
this acceptance allows at the price of a token the engine measured in the run (where the
weights sit in cache, each token a step runs costs compute: the physics of the figure).
Owns nothing beyond the run.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from pipeline.bench.report import Report
from pipeline.config import DEFAULT_MODEL
from pipeline.sampling_params import SamplingParams

PROMPTS = ["The history of the city begins", "def parse(text):\n    ", "Once upon a time, in a small village,",
           "The following is a list of", "In mathematics, a group is", "Q: What is the capital of France?\nA:",
           "import numpy as np\n", "Chapter 1\n\nThe morning was"]
METHODS = {"ngram": {"method": "ngram", "num_speculative_tokens": 6, "prompt_lookup_min": 1,
                     "prompt_lookup_max": 5},
           "suffix": {"method": "suffix", "num_speculative_tokens": 8}}


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="checkpoint directory (default: the embedded model)")
    p.add_argument("--rounds", type=int, default=2, help="ABBA pairs per figure")
    p.add_argument("--batches", default="1,8")
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--agent-steps", type=int, default=8, help="requests per agent loop")
    p.add_argument("--threads", type=int, default=0, help="worker threads (0: the adaptive default)")
    p.add_argument("--workloads", default=",".join(WORKLOADS), help="comma-separated subset")
    p.add_argument("--methods", default="", help="comma-separated subset (default: each workload's)")
    p.add_argument("--dtype", default="auto", help="the target's (and drafts') dtype")
    p.add_argument("--interleave", action="store_true",
                   help="off and on side by side, alternating each generate call (for a shared machine)")
    p.add_argument("--quick", action="store_true", help="tiny workloads (the bench's test)")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"],
                   help="cuda: both engines on the GPU, each with a fixed KV of 1024 blocks (two "
                        "at once must not each size theirs to the device)")


def _llm(args: argparse.Namespace, spec: dict | None) -> Any:
    from pipeline import LLM
    kw: dict[str, Any] = {"worker_threads": args.threads} if args.threads else {}
    if args.model:
        kw["model"] = args.model
    if args.device == "cuda":  # a decode step there is bound by the host, not the weights
        kw.update(device="cuda", num_blocks=1024)
    return LLM(speculative_config=spec, max_model_len=2048, dtype=args.dtype, **kw)


def _continue(llm: Any, batch: int, args: argparse.Namespace) -> tuple[int, float, list]:
    sp = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    toks, secs, outs = 0, 0.0, []
    for i in range(0, len(PROMPTS), batch):
        t0 = time.perf_counter()
        res = llm.generate(PROMPTS[i:i + batch], sp, use_tqdm=False)
        secs += time.perf_counter() - t0
        outs += [list(r.outputs[0].token_ids) for r in res]
        toks += sum(len(r.outputs[0].token_ids) for r in res)
    return toks, secs, outs


def _agent(llm: Any, batch: int, args: argparse.Namespace) -> tuple[int, float, list]:
    """``batch`` loops side by side; each step's prompt is the task plus the previous answer
    with its fifth word replaced (the step number), as a tool's observation would quote it."""
    sp = SamplingParams(max_tokens=args.max_tokens // 2, temperature=0.0, ignore_eos=True)
    prev = [""] * batch
    toks, secs, outs = 0, 0.0, []
    for step in range(args.agent_steps):
        prompts = []
        for loop in range(batch):
            words = prev[loop].split(" ")
            if len(words) > 5:
                words[4] = f"#{step}"
            prompts.append(f"Task {loop}: fix the failing test.\nObservation: {' '.join(words)}\nAction:")
        t0 = time.perf_counter()
        res = llm.generate(prompts, sp, use_tqdm=False)
        secs += time.perf_counter() - t0
        prev = [r.outputs[0].text for r in res]
        outs += [list(r.outputs[0].token_ids) for r in res]
        toks += sum(len(r.outputs[0].token_ids) for r in res)
    return toks, secs, outs


def _floor(llm: Any, batch: int, args: argparse.Namespace) -> tuple[int, float, list]:
    sp = SamplingParams(max_tokens=args.max_tokens, temperature=1.0, ignore_eos=True)
    toks, secs = 0, 0.0
    for i in range(0, len(PROMPTS), batch):
        t0 = time.perf_counter()
        res = llm.generate(PROMPTS[i:i + batch], sp, use_tqdm=False)
        secs += time.perf_counter() - t0
        toks += sum(len(r.outputs[0].token_ids) for r in res)
    return toks, secs, []


WORKLOADS = {"continue": (_continue, ("ngram", "suffix", "draft_self", "draft_random")),
             "agent": (_agent, ("ngram", "suffix")), "floor": (_floor, ("ngram",))}


def random_draft(target: str, out: Path) -> str:
    """A one-layer draft of random weights with the target's vocabulary: it (almost) never
    agrees with the target, the floor of a draft model."""
    from pipeline.models.config import load_model_config
    from pipeline.models.make_model import hf_config, random_state_dict, write_checkpoint
    mc = load_model_config(target)
    cfg = hf_config("llama", vocab_size=mc.vocab_size, hidden_size=128, intermediate_size=256, num_layers=1,
                    num_heads=2, num_kv_heads=1, head_dim=64, max_position_embeddings=mc.max_position_embeddings,
                    rope_theta=10000.0, rms_norm_eps=1e-5, tie_word_embeddings=True, dtype="float32",
                    bos_token_id=0, eos_token_id=1)
    write_checkpoint(out, cfg, random_state_dict(cfg, 7, torch.float32), {})
    return str(out)


def _run(args: argparse.Namespace, fn, batch: int, spec: dict | None) -> tuple[float, list, dict]:
    llm = _llm(args, spec)
    try:
        # Warm the kernels (untimed) on text the workload never sees: a suffix index must
        # not learn the workload's answers before it is timed.
        llm.generate(["Warm up."], SamplingParams(max_tokens=8, temperature=0.0), use_tqdm=False)
        toks, secs, outs = fn(llm, batch, args)
        return toks / secs, outs, llm.stats()
    finally:
        llm.close()


class _Pair:
    """Two engines (off, on) behind one ``generate``: each call runs on both, the order
    alternating, each timed apart; it answers with the ``on`` engine's outputs."""

    def __init__(self, off: Any, on: Any) -> None:
        self.llms = {False: off, True: on}
        self.secs = {False: 0.0, True: 0.0}
        self.toks = {False: 0, True: 0}
        self.outs: dict[bool, list] = {False: [], True: []}
        self.calls = 0

    def generate(self, prompts: list, sp: SamplingParams, use_tqdm: bool = False) -> list:
        res = {}
        for on in ((False, True) if self.calls % 2 == 0 else (True, False)):
            t0 = time.perf_counter()
            res[on] = self.llms[on].generate(prompts, sp, use_tqdm=use_tqdm)
            self.secs[on] += time.perf_counter() - t0
        self.calls += 1
        for on, got in res.items():
            self.toks[on] += sum(len(r.outputs[0].token_ids) for r in got)
            self.outs[on] += [list(r.outputs[0].token_ids) for r in got]
        return res[True]


def _run_pair(args: argparse.Namespace, fn, batch: int, spec: dict) -> dict[bool, tuple[float, list, dict]]:
    """One round of --interleave: {on: (tok/s, outputs, stats)}."""
    llms = [_llm(args, None)]
    try:
        llms.append(_llm(args, spec))
        for llm in llms:  # as _run: warm up on text the workload never sees
            llm.generate(["Warm up."], SamplingParams(max_tokens=8, temperature=0.0), use_tqdm=False)
        pair = _Pair(*llms)
        fn(pair, batch, args)
        return {on: (pair.toks[on] / pair.secs[on], pair.outs[on], llms[on].stats()) for on in (False, True)}
    finally:
        for llm in llms:
            llm.close()


def ceiling(st: dict) -> float:
    """The most speculation can give with this run's acceptance and this machine's price of
    a token (engine.spec_decode): max over K of (1 + sum of the first K positions' keep
    shares) / (1 + K x price), the keep share of position i being accepted / drafted there."""
    acc, drafted = st.get("spec_accepted_per_position", []), st.get("spec_drafted_per_position", [])
    price = float(st.get("spec_token_price", 0.0))
    best, gain = 1.0, 1.0
    for k, (a, d) in enumerate(zip(acc, drafted), 1):
        if not d:
            break
        gain += a / d
        best = max(best, gain / (1.0 + k * price))
    return round(best, 3)


def measure(args: argparse.Namespace, rep: Report, workload: str, method: str, batch: int) -> dict:
    fn, _ = WORKLOADS[workload]
    spec = METHODS[method]
    ratios, on_tps, off_tps = [], [], []
    equal, st = True, {}  # type: tuple[bool, dict[str, Any]]
    for r in range(args.rounds):
        if args.interleave:
            pair = _run_pair(args, fn, batch, spec)
            (tps_off, outs_off, _), (tps_on, outs_on, st) = pair[False], pair[True]
        else:
            order = (None, spec) if r % 2 == 0 else (spec, None)
            got = {}
            for s in order:
                got[s is None] = _run(args, fn, batch, s)
            (tps_off, outs_off, _), (tps_on, outs_on, st) = got[True], got[False]
        equal = equal and outs_on == outs_off
        ratios.append(tps_on / tps_off)
        on_tps.append(tps_on)
        off_tps.append(tps_off)
    return rep.add(f"{workload} {method} batch {batch}", workload=workload, method=method, batch=batch,
                   ceiling=ceiling(st),
                   ratio=round(statistics.median(ratios), 3), ratios=[round(x, 3) for x in ratios],
                   tok_s_on=round(statistics.median(on_tps), 1), tok_s_off=round(statistics.median(off_tps), 1),
                   acceptance_length=round(float(st.get("spec_mean_acceptance_length", 0.0)), 3),
                   accepted_per_position=st.get("spec_accepted_per_position", []),
                   drafted_per_position=st.get("spec_drafted_per_position", []),
                   draft_cap=st.get("spec_draft_cap", 0), token_price=st.get("spec_token_price", 0.0),
                   proposal_price=st.get("spec_proposal_price", 0.0),
                   outputs_equal=equal if workload != "floor" else None, interleaved=args.interleave)


def main(args: argparse.Namespace) -> int:
    if args.rounds < 1 or args.max_tokens < 1 or args.agent_steps < 1:
        print("pipeline bench spec: --rounds, --max-tokens and --agent-steps must be >= 1", file=sys.stderr)
        return 2
    if args.quick:
        args.max_tokens, args.agent_steps = min(args.max_tokens, 24), min(args.agent_steps, 2)
    batches = [int(b) for b in args.batches.split(",")]
    rep = Report("spec")
    rows = {}
    target = args.model or DEFAULT_MODEL
    with tempfile.TemporaryDirectory(prefix="spec-bench-") as tmp:
        # A draft model drafting for the target itself (every draft the target's argmax: the
        # ceiling of acceptance) and a random one (the floor).
        METHODS["draft_self"] = {"method": "draft_model", "model": target, "num_speculative_tokens": 4}
        METHODS["draft_random"] = {"method": "draft_model", "model": random_draft(target, Path(tmp) / "draft"),
                                   "num_speculative_tokens": 4}
        only = set(args.methods.split(",")) if args.methods else None
        for workload, (_, methods) in WORKLOADS.items():
            if workload not in args.workloads.split(","):
                continue
            for method in methods:
                if only is not None and method not in only:
                    continue
                for batch in batches:
                    rows[(workload, method, batch)] = measure(args, rep, workload, method, batch)
    for (workload, method, batch), goal, name in (
            (("continue", "ngram", 1), 1.8, "n-gram on the model's own continuations, batch 1"),
            (("agent", "suffix", 1), 2.0, "suffix on an agent loop, batch 1"),
            (("continue", "draft_random", 1), 0.97, "a random draft model, batch 1"),
            (("floor", "ngram", 1), 0.97, "few accepted (sampling), batch 1"),
            (("floor", "ngram", 8), 0.97, "few accepted (sampling), batch 8")):
        row = rows.get((workload, method, batch))
        if row is not None:
            rep.target(name, row["ratio"], f">= {goal}", row["ratio"] >= goal)
    bad = [r["case"] for r in rep.results if r.get("outputs_equal") is False]
    if bad:
        print(f"pipeline bench spec: greedy outputs differ with speculation: {bad}", file=sys.stderr)
    rep.emit(args.json)
    return 1 if bad else 0
