"""Quality of the CPU worker's bf16, int8 (issue 12) and int4 (issue 23) weights against float32,
through the real engine (``pipeline.LLM``) on the embedded default model and the 25M bench
checkpoint.

- Perplexity, exp(mean NLL), of held-out text: the prompt logprob of every token of 256-token
  windows (BOS first), the same windows for float32, bf16 and int8; bf16 within 1% and int8
  within 3% of float32. Measured twice: with the default token budget (prefill rows go to the
  batched GEMM path of layers/lowp.py) and with a budget of 8 tokens (every step goes through
  the C GEMVs of cpu_ops_gemv_lp.h, where int8 also quantises activations per token).
- Greedy: the share of 64 prompts (16 tokens each) whose 32-token greedy continuation equals
  float32's, decoded 8 at a time (the GEMV path); printed beside the perplexities
  (``pytest -s``), with only a loose floor on the trained default model.
- ISA paths: the decode-path perplexity again under ``cpu_ops.set_isa`` caps (the LLM runs
  its ModelRunner in this process, so the cap reaches it): int8 and int4 identical on every
  path (exact int32 dot products, the same float steps), bf16 within its bound on each.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import pytest
import torch

from pipeline.config import DEFAULT_MODEL
from pipeline.layers import ops
from pipeline.layers.int4 import PACKED
from pipeline.llm import LLM
from pipeline.sampling_params import SamplingParams
from pipeline.tokenizer.tokenizer import Tokenizer

cpu_ops: Any = ops.backend(torch.device("cpu"))
pytestmark = pytest.mark.skipif(cpu_ops is None, reason="C CPU ops not built")

WINDOW = 256  # tokens per perplexity window, BOS included
NUM_PROMPTS, PROMPT_LEN, NEW_TOKENS = 64, 16, 32
FORMATS: dict[str, dict[str, Any]] = {"fp32": {"dtype": "float32"}, "bf16": {"dtype": "bfloat16"},
           "int8": {"quantization": "int8"}, "int4": {"quantization": "int4"}}
# The issues' perplexity bounds, relative to float32; int4: as int8's, which leaves the
# measured default-model loss (0.8%) four times over and still fails a broken kernel or
# packing (a wrong nibble order or group scale costs tens of percent).
BOUND = {"bf16": 0.01, "int8": 0.03, "int4": 0.03}
# Prefill windows 8 at a time (GEMM); greedy decode 8 at a time (M <= GEMV_MAX_M: the GEMVs).
PREFILL: dict[str, Any] = {"max_model_len": 512, "max_num_seqs": 8}
# Every step at most 8 tokens, so prompt logprobs too come out of the GEMVs.
DECODE: dict[str, Any] = {"max_model_len": 512, "max_num_seqs": 8, "max_num_batched_tokens": 8,
          "long_prefill_token_threshold": 8}


def held_out_docs() -> list[str]:
    """The default model's validation split: corpus() of tools/train_default_model.py (topics
    in sorted key order, paragraphs split on blank lines, every 20th at offset 7 held out,
    rejoined per topic). Reproduced because tools/ is not a package."""
    from pydoc_data.topics import topics

    val, n = [], 0
    for key in sorted(topics):
        va = []
        for para in topics[key].split("\n\n"):
            if n % 20 == 7:
                va.append(para)
            n += 1
        val += ["\n\n".join(va)] if va else []
    return val


@dataclass
class Data:
    windows: list[list[int]]  # BOS + WINDOW - 1 held-out tokens each
    prompts: list[list[int]]  # BOS + the first PROMPT_LEN - 1 tokens of held-out paragraphs


def make_data(model_dir: str, num_windows: int | None = None) -> Data:
    """num_windows: that many, spread evenly over the text; None: all of them."""
    tok = Tokenizer(model_dir)
    assert tok.bos_token_id is not None and tok.eos_token_ids
    bos, eos = tok.bos_token_id, tok.eos_token_ids[0]
    docs = held_out_docs()
    stream: list[int] = []
    for doc in docs:  # each document ends with EOS, as in training
        stream += tok.encode(doc, add_special_tokens=False) + [eos]
    step = WINDOW - 1
    windows = [[bos] + stream[i:i + step] for i in range(0, len(stream) - step + 1, step)]
    if num_windows is not None:
        windows = windows[::max(1, len(windows) // num_windows)][:num_windows]
    paras = [tok.encode(p, add_special_tokens=False) for d in docs for p in d.split("\n\n")]
    paras = [p for p in paras if len(p) >= PROMPT_LEN - 1]
    assert len(paras) >= NUM_PROMPTS
    prompts = [[bos] + paras[i * len(paras) // NUM_PROMPTS][:PROMPT_LEN - 1]
               for i in range(NUM_PROMPTS)]
    return Data(windows, prompts)


@dataclass
class Run:
    fmt: str
    prefill_nll: list[list[float]]  # per window, per scored token
    decode_nll: list[list[float]]
    greedy: list[list[int]]

    @staticmethod
    def ppl(nll: list[list[float]]) -> float:
        flat = [x for w in nll for x in w]
        return math.exp(sum(flat) / len(flat))


def window_nll(llm: LLM, windows: list[list[int]]) -> list[list[float]]:
    """-log p(token | its prefix) of every window token after the BOS."""
    outs = llm.generate(windows, SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0),
                        use_tqdm=False)
    nll = []
    for w, o in zip(windows, outs):
        assert o.prompt_logprobs is not None and len(o.prompt_logprobs) == len(w)
        nll.append([-pos[t].logprob for t, pos in zip(w[1:], o.prompt_logprobs[1:])
                    if pos is not None])
        assert len(nll[-1]) == len(w) - 1
    return nll


def check_packed(llm: LLM, fmt: str) -> None:
    """The format took effect: every projection packed (bf16/int8) or none (float32)."""
    assert llm.worker is not None
    packed = {m.fmt for m in llm.worker.model.modules() if isinstance(m, PACKED)}
    assert packed == (set() if fmt == "fp32" else {fmt})


def run_format(model_dir: str, fmt: str, data: Data, decode_windows: int | None) -> Run:
    with LLM(model_dir, **FORMATS[fmt], **PREFILL) as llm:
        check_packed(llm, fmt)
        prefill = window_nll(llm, data.windows)
        outs = llm.generate(data.prompts, SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0,
                                                         ignore_eos=True), use_tqdm=False)
        greedy = [list(o.outputs[0].token_ids) for o in outs]
    assert all(len(g) == NEW_TOKENS for g in greedy)
    with LLM(model_dir, **FORMATS[fmt], **DECODE) as llm:
        decode = window_nll(llm, data.windows[:decode_windows])
    return Run(fmt, prefill, decode, greedy)


def measure(name: str, model_dir: str, num_windows: int | None, decode_windows: int | None,
            hidden: int) -> dict[str, Run]:
    data = make_data(model_dir, num_windows)
    runs = {fmt: run_format(model_dir, fmt, data, decode_windows) for fmt in FORMATS}
    ref = runs["fp32"]
    for fmt in ("bf16", "int8", "int4"):
        r = runs[fmt]
        same = sum(a == b for a, b in zip(r.greedy, ref.greedy))
        isa = cpu_ops.lp_isa(fmt, hidden)
        print(f"\nlowp quality {name} {fmt} ({isa} GEMV): perplexity prefill "
              f"{r.ppl(r.prefill_nll):.3f} vs fp32 {ref.ppl(ref.prefill_nll):.3f} "
              f"(x{r.ppl(r.prefill_nll) / ref.ppl(ref.prefill_nll):.5f}, "
              f"{len(data.windows)} windows), decode {r.ppl(r.decode_nll):.3f} vs "
              f"{ref.ppl(ref.decode_nll):.3f} (x{r.ppl(r.decode_nll) / ref.ppl(ref.decode_nll):.5f}, "
              f"{len(r.decode_nll)} windows); greedy {NEW_TOKENS} tokens unchanged "
              f"{same}/{NUM_PROMPTS} = {same / NUM_PROMPTS:.3f}", flush=True)
    return runs


@pytest.fixture(scope="module")
def default_runs() -> dict[str, Run]:
    # All 24 windows of the ~6.3k held-out tokens, on both paths: the model is small.
    return measure("default", str(DEFAULT_MODEL), None, None, hidden=256)


@pytest.fixture(scope="module")
def bench_runs(tmp_path_factory) -> dict[str, Run]:
    from pipeline.bench.worker import make_bench_model

    path = tmp_path_factory.mktemp("bench25m")
    make_bench_model(path)
    # 8 of the 24 windows (2040 tokens) and 4 on the decode path: the GEMV path runs 8
    # tokens a step through 100 MB of float32 weights, ~19 s for all windows on 2 busy cores.
    return measure("25M", str(path), 8, 4, hidden=384)


def check_bounds(runs: dict[str, Run]) -> None:
    ref = runs["fp32"]
    for fmt, bound in BOUND.items():
        r = runs[fmt]
        for nll, ref_nll in ((r.prefill_nll, ref.prefill_nll), (r.decode_nll, ref.decode_nll)):
            assert abs(Run.ppl(nll) / Run.ppl(ref_nll) - 1) <= bound, (fmt, Run.ppl(nll), Run.ppl(ref_nll))
            # The lower precision really ran: its logprobs are not float32's.
            assert nll != ref_nll, fmt
    # Both paths scored the same tokens: float32 agrees with itself across budgets.
    n = len(ref.decode_nll)
    assert Run.ppl(ref.decode_nll) == pytest.approx(Run.ppl(ref.prefill_nll[:n]), rel=1e-4)


def test_default_model_perplexity_within_bounds(default_runs):
    check_bounds(default_runs)
    # Trained (docs/default_model.md: validation perplexity 47), far from uniform over 2048.
    assert Run.ppl(default_runs["fp32"].prefill_nll) < 80


def test_default_model_greedy_continuations_mostly_unchanged(default_runs):
    # Measured on AVX-512 BF16/VNNI: bf16 59/64, int8 40/64 (bf16 on AVX2 63/64). One flipped
    # near-tie changes the rest of a continuation, so the floors leave wide room for other
    # CPUs and builds while still catching a broken kernel (then nearly none match).
    ref = default_runs["fp32"].greedy
    # int4 is left out: its 16 levels move enough near-ties on this small model that few
    # 32-token continuations survive whole (measured 1-3/64; the first token 60/64, 8 tokens
    # 29/64), so a floor would not tell a broken kernel apart; its perplexity bound does.
    for fmt, floor in (("bf16", 0.5), ("int8", 0.35)):
        same = sum(a == b for a, b in zip(default_runs[fmt].greedy, ref))
        assert same / NUM_PROMPTS >= floor, (fmt, same)


def test_bench_checkpoint_perplexity_within_bounds(bench_runs):
    check_bounds(bench_runs)
    # Random weights: near-uniform over its 8192 ids (a mis-scored window would not be).
    assert 0.8 * 8192 < Run.ppl(bench_runs["fp32"].prefill_nll) < 1.5 * 8192


ISA_WINDOWS = 8


def test_every_isa_path_of_the_gemvs_keeps_the_bounds(default_runs):
    """The decode-path perplexity with the kernels capped at each lower ISA the CPU has."""
    model = str(DEFAULT_MODEL)
    windows = make_data(model).windows[:ISA_WINDOWS]
    ref = default_runs["fp32"].decode_nll[:ISA_WINDOWS]
    native = {fmt: cpu_ops.lp_isa(fmt, 256) for fmt in BOUND}  # uncapped: what the fixture ran
    checked = []
    try:
        for fmt in BOUND:
            native_nll = default_runs[fmt].decode_nll[:ISA_WINDOWS]
            for cap in ("avx2", "portable"):
                cpu_ops.set_isa(cap)
                level = cpu_ops.lp_isa(fmt, 256)
                if level == native[fmt]:
                    continue  # the CPU lacks the level above the cap: that path ran already
                with LLM(model, **FORMATS[fmt], **DECODE) as llm:
                    nll = window_nll(llm, windows)
                ratio = Run.ppl(nll) / Run.ppl(ref)
                print(f"\nlowp quality default {fmt} {level} GEMV: decode perplexity x{ratio:.5f} "
                      f"of fp32 ({ISA_WINDOWS} windows), identical to {native[fmt]}: "
                      f"{nll == native_nll}", flush=True)
                assert abs(ratio - 1) <= BOUND[fmt], (fmt, level, ratio)
                if fmt in ("int8", "int4"):  # exact int32 dot products on every path: same logprobs
                    assert nll == native_nll, level
                checked.append(f"{fmt} {level}")
    finally:
        cpu_ops.set_isa("amx")  # no cap: what every other test expects
    if not checked:
        pytest.skip("this CPU has one ISA level for the bf16 and int8 kernels")
