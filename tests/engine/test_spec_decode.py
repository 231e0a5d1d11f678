"""Speculative decoding (issue 27) through the in-process ``LLM(speculative_config=...)``:
greedy outputs token-identical with it on and off for every method, over 64 prompts with
chunked prefill, preemption and prefix hits, with stop tokens, stop strings, max_tokens, n > 1
and a grammar among them; seeded sampling (penalties, min_tokens, logprobs) identical too (each
output position draws with its own seed); tensor parallelism; the adaptive K. The default
model in float32: its greedy continuations repeat, so drafts are accepted.
"""
from __future__ import annotations

import random
from pathlib import Path

import pytest

from pipeline import LLM
from pipeline.config import DEFAULT_MODEL
from pipeline.engine.request import Request
from pipeline.engine.spec_decode import PROBE_EVERY, SpecDecode
from pipeline.sampling_params import SamplingParams
from pipeline.sampling_params.structured import StructuredOutputsParams

pytestmark = pytest.mark.skipif(not (Path(DEFAULT_MODEL) / "model.safetensors").is_file(),
                                reason="default model not built")

# cost_aware off: whether drafts pay on this machine is a timing question; these tests ask
# whether the drafts verified are exact.
METHODS = [{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 4,
            "cost_aware": False},
           {"method": "suffix", "num_speculative_tokens": 6, "cost_aware": False},
           # The default model drafting for itself: every draft is accepted (a greedy draft
           # equals the target's argmax), the ceiling of acceptance.
           {"method": "draft_model", "model": DEFAULT_MODEL, "num_speculative_tokens": 3, "cost_aware": False}]
_rng = random.Random(27)
SHARED = [_rng.randrange(3, 2000) for _ in range(40)]  # 2.5 blocks every 4th prompt shares
PROMPTS: list[list[int]] = []
PARAMS: list[SamplingParams] = []
for i in range(64):
    body = [_rng.randrange(3, 2000) for _ in range(_rng.randrange(4, 90))]  # some > the chunk
    PROMPTS.append((SHARED if i % 4 == 0 else []) + body + body[:8])  # a repeat: n-gram food
    kw: dict = {"max_tokens": _rng.choice([1, 2, 7, 24, 48]), "temperature": 0.0}
    if i % 5 == 0:
        kw["stop_token_ids"] = [201]  # "\n", frequent in the model's output
    if i % 7 == 0:
        kw["stop"] = ["\n\n"]
    if i % 9 == 0:
        kw["ignore_eos"] = True
    PARAMS.append(SamplingParams(**kw))
PARAMS[3] = SamplingParams(n=2, max_tokens=24, temperature=0.0)
PARAMS[5] = SamplingParams(max_tokens=16, temperature=0.0,
                           structured_outputs=StructuredOutputsParams(choice=["yes", "no"]))


def make_llm(spec: dict | None, **kw) -> LLM:
    return LLM(device="cpu", dtype="float32", block_size=16, max_model_len=256, worker_threads=1,
               speculative_config=spec, **kw)


def outputs(llm: LLM, prompts, params) -> list[list[tuple[list[int], str, str | None]]]:
    outs = llm.generate(prompts, params, use_tqdm=False)
    return [[(list(c.token_ids), c.text, c.finish_reason) for c in o.outputs] for o in outs]


@pytest.fixture(scope="module")
def reference():
    # A pool too small for every request at once (preemptions), a chunked prefill budget.
    with make_llm(None, num_blocks=48, max_num_batched_tokens=64) as llm:
        return outputs(llm, PROMPTS, PARAMS)


@pytest.mark.parametrize("spec", METHODS, ids=[m["method"] for m in METHODS])
def test_greedy_outputs_equal_with_speculation_on_and_off(spec, reference):
    # A draft model's lookahead slots make admission keep more headroom: a smaller pool
    # gets it preempting too (greedy float32 outputs do not depend on the pool's size).
    blocks = 24 if spec["method"] == "draft_model" else 48
    with make_llm(spec, num_blocks=blocks, max_num_batched_tokens=64) as llm:
        got = outputs(llm, PROMPTS, PARAMS)
        st = llm.stats()
    assert got == reference
    assert st["spec_num_accepted_tokens"] > 0 and st["spec_num_drafts"] > 0
    assert st["num_preemptions"] > 0 and st["prefix_cache_hit_tokens"] > 0
    assert sum(st["spec_accepted_per_position"]) == st["spec_num_accepted_tokens"]
    assert st["spec_mean_acceptance_length"] == pytest.approx(
        1 + st["spec_num_accepted_tokens"] / st["spec_num_drafts"])


def test_seeded_sampling_is_the_same_with_speculation():
    """Each output position draws with (seed, position): drafts accepted or not, the tokens
    and their logprobs are the ones plain decoding draws."""
    prompts = PROMPTS[:8]
    params = [SamplingParams(max_tokens=40, temperature=0.8, seed=s, ignore_eos=True,
                             logprobs=2 if s % 2 else None, top_k=50 if s == 2 else 0,
                             repetition_penalty=1.2 if s == 1 else 1.0,
                             frequency_penalty=0.3 if s == 3 else 0.0,
                             min_tokens=30 if s == 4 else 0) for s in range(8)]
    with make_llm(None) as llm:
        want = llm.generate(prompts, params, use_tqdm=False)
    with make_llm(METHODS[0]) as llm:
        got = llm.generate(prompts, params, use_tqdm=False)
        st = llm.stats()
    for w, g in zip(want, got, strict=True):
        assert list(g.outputs[0].token_ids) == list(w.outputs[0].token_ids)
        # A verify step computes several positions in one forward (the prefill kernels): the
        # logprobs agree to float32 rounding, not bit for bit.
        for lg, lw in zip(g.outputs[0].logprobs or [], w.outputs[0].logprobs or [], strict=True):
            assert lg.keys() == lw.keys()
            assert all(lg[t].logprob == pytest.approx(lw[t].logprob, abs=1e-4) and lg[t].rank == lw[t].rank
                       for t in lg)
        assert (g.outputs[0].logprobs is None) == (w.outputs[0].logprobs is None)
    assert st["spec_num_drafts"] > 0


@pytest.mark.parametrize("spec", [METHODS[0], METHODS[2]], ids=["ngram", "draft_model"])
def test_two_ranks_speculate_as_one(spec):
    prompts, params = PROMPTS[:6], [SamplingParams(max_tokens=24, temperature=0.0)] * 6
    with make_llm(None) as llm:
        want = outputs(llm, prompts, params)
    with make_llm(spec, tensor_parallel_size=2) as llm:
        got = outputs(llm, prompts, params)
        assert llm.stats()["spec_num_accepted_tokens"] > 0
    assert got == want


def test_a_request_that_never_accepts_goes_dormant_and_probes():
    spec = SpecDecode(4)
    req = Request("r", [1, 2, 3], SamplingParams(max_tokens=1000))
    spec.start(req)
    drafted = steps = 0
    for _ in range(2000):
        req.spec_token_ids = [7, 7, 7, 7]  # the proposer always has drafts; none is right
        drafts = spec.drafts_for(req, 100)
        steps += 1
        if drafts:
            drafted += len(drafts)
            spec.on_verified(req, len(drafts), 0)
    assert req.spec_k == 0
    # Two drafts, then K shrinking (2, 1), probes after 2, 4, 8, 16 steps, then one draft
    # every PROBE_EVERY steps: the 3 % budget.
    assert drafted <= 2 + 2 + 1 + 4 + steps / PROBE_EVERY + 1
    assert drafted / steps <= 0.04


def test_k_follows_the_acceptance():
    spec = SpecDecode(8)
    req = Request("r", [1, 2, 3], SamplingParams(max_tokens=1000))
    spec.start(req)
    assert req.spec_k == 2  # a new request starts small
    for _ in range(6):
        spec.on_verified(req, req.spec_k, req.spec_k)
    assert req.spec_k == 8  # all kept: K grows to the configured one
    spec.on_verified(req, 8, 0)
    spec.on_verified(req, req.spec_k, 0)
    assert 1 <= req.spec_k < 8  # nothing kept: it shrinks


@pytest.mark.parametrize("text, needle", [
    ('{"method": "ngram"}', "num_speculative_tokens"),
    ('{"method": "medusa", "num_speculative_tokens": 2}', "method"),
    ('{"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 9, '
     '"prompt_lookup_max": 3}', "prompt_lookup_min"),
    ('{"method": "ngram", "num_speculative_tokens": 2, "typo": 1}', "typo"),
    ('{"method": "draft_model", "num_speculative_tokens": 2, "model": "/nonexistent"}', "no config.json"),
    ('{"method": "suffix", "num_speculative_tokens": 2, "model": "/x"}', '"model" is for method'),
    ("not json", "not JSON"),
])
def test_bad_speculative_configs_are_refused_naming_the_field(text, needle):
    with pytest.raises(ValueError, match=needle):
        make_llm(text)  # type: ignore[arg-type]


def test_a_grammar_checks_the_drafts_and_masks_each_position():
    """Requests with structured outputs verify drafts too: the proposer's drafts are cut at
    the first token the grammar refuses, each draft position is masked with the grammar
    advanced over the drafts before it; the answers are those of plain decoding."""
    prompts = [PROMPTS[i] for i in range(4)]
    params = [SamplingParams(max_tokens=40, temperature=0.0, structured_outputs=StructuredOutputsParams(
        regex="(ab|cd|ef)( (ab|cd|ef)){5,30}")),
              SamplingParams(max_tokens=40, temperature=0.0, structured_outputs=StructuredOutputsParams(
                  json={"type": "object", "properties": {"x": {"type": "array", "items": {"type": "integer"}}},
                        "required": ["x"]})),
              SamplingParams(max_tokens=40, temperature=0.7, seed=3, structured_outputs=StructuredOutputsParams(
                  regex="(yes|no)(, (yes|no)){3,20}")),
              SamplingParams(max_tokens=40, temperature=0.0)]
    with make_llm(None) as llm:
        want = outputs(llm, prompts, params)
    spec = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3,
            "cost_aware": False}
    with make_llm(spec) as llm:
        got = outputs(llm, prompts, params)
        st = llm.stats()
    assert got == want
    assert st["spec_num_accepted_tokens"] > 0
