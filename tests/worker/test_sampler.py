"""The worker's sampler: penalties, filters, seeds, min-tokens and logprobs, batch-vectorised."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline.messages import NewRequestData, ids_to_bytes
from pipeline.sampling_params import SamplingParams
from pipeline.worker.input_batch import InputBatch
from pipeline.worker.sampler import Sampler, build_metadata, mix_seed

V = 64
EOS = [2]
CPU = torch.device("cpu")


def batch_of(specs: list[tuple[SamplingParams, list[int], int]]) -> tuple[InputBatch, np.ndarray]:
    """specs: (params, tokens, num_prompt_tokens) per request, in batch order."""
    b = InputBatch(max_num_reqs=max(len(specs), 1) + 2, max_model_len=256, block_size=16)
    rows = [b.add(NewRequestData(f"r{i}", ids_to_bytes(toks), n_prompt, sp, [0], len(toks)))
            for i, (sp, toks, n_prompt) in enumerate(specs)]
    return b, np.array(rows, dtype=np.int64)


def run(specs, logits: torch.Tensor, seed: int = 0):
    b, rows = batch_of(specs)
    md = build_metadata(b, rows, V, EOS, CPU)
    return Sampler(CPU, seed)(logits.clone(), md)


def rand_logits(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, V, generator=torch.Generator().manual_seed(seed)) * 3


def test_greedy_is_argmax_and_mixed_batch_keeps_greedy_rows():
    logits = rand_logits(4)
    greedy = SamplingParams(temperature=0.0)
    toks, lps = run([(greedy, [5], 1)] * 4, logits)
    assert toks.tolist() == logits.argmax(-1).tolist() and lps is None
    mixed = [(greedy, [5], 1), (SamplingParams(temperature=1.5), [5], 1)] * 2
    toks, _ = run(mixed, logits)
    assert toks[0] == logits[0].argmax() and toks[2] == logits[2].argmax()


@pytest.mark.parametrize("sp", [SamplingParams(temperature=2.0, top_k=1),
                                SamplingParams(temperature=2.0, top_p=1e-6),
                                SamplingParams(temperature=2.0, min_p=1.0)])
def test_filters_that_keep_only_the_top_token(sp):
    logits = rand_logits(8, seed=1)
    toks, _ = run([(sp, [7], 1)] * 8, logits)
    assert toks.tolist() == logits.argmax(-1).tolist()


@settings(max_examples=40, deadline=None)
@given(k=st.integers(1, V), p=st.floats(0.05, 1.0), seed=st.integers(0, 2**32))
def test_samples_stay_in_the_top_k_and_top_p_set(k, p, seed):
    logits = rand_logits(6, seed=seed % 1000)
    sp = SamplingParams(temperature=1.0, top_k=k, top_p=p)
    toks, _ = run([(sp, [1], 1)] * 6, logits, seed=seed)
    for i, t in enumerate(toks.tolist()):
        order = logits[i].argsort(descending=True)
        rank = (order == t).nonzero().item()
        assert rank < k
        probs = logits[i][order[:k]].softmax(-1)
        mass_before = probs[:rank].sum().item()
        assert mass_before <= p + 1e-5


def test_sampling_follows_the_distribution():
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05] + [0.0] * (V - 4))
    logits = probs.clamp_min(1e-30).log().expand(4000, V).contiguous()
    toks, _ = run([(SamplingParams(temperature=1.0), [1], 1)] * 4000, logits, seed=3)
    freq = np.bincount(toks.numpy(), minlength=V)[:4] / 4000
    assert np.abs(freq - probs[:4].numpy()).max() < 0.03
    assert np.bincount(toks.numpy(), minlength=V)[4:].sum() == 0


def test_seed_gives_the_same_token_whatever_the_batch():
    logits = rand_logits(5, seed=4)
    seeded = SamplingParams(temperature=1.0, seed=1234)
    other = SamplingParams(temperature=1.0)
    alone, _ = run([(seeded, [1, 2, 3], 2)], logits[2:3].clone(), seed=0)
    crowd, _ = run([(other, [9], 1), (other, [9], 1), (seeded, [1, 2, 3], 2), (other, [9], 1)],
                   logits[:4].clone(), seed=99)
    assert alone[0] == crowd[2]
    # The draw depends on the output position: over many positions it is not constant.
    flat = torch.zeros(1, V)
    draws = {run([(seeded, [1] * n, 1)], flat)[0].item() for n in range(1, 30)}
    assert len(draws) > 5
    assert mix_seed(1, 0) != mix_seed(1, 1) != mix_seed(2, 0)


def test_repetition_presence_frequency_penalties():
    logits = torch.linspace(-2, 2, V).repeat(1, 1)
    prompt, out = [10, 60], [60, 60, 30]
    sp = SamplingParams(temperature=0.0, repetition_penalty=2.0, presence_penalty=0.5,
                        frequency_penalty=0.25)
    b, rows = batch_of([(sp, prompt + out, len(prompt))])
    md = build_metadata(b, rows, V, EOS, CPU)
    got = logits.clone()
    Sampler._penalize(got, md)
    want = logits.clone()
    for t in {10, 60, 30}:  # repetition: prompt and output tokens
        want[0, t] = want[0, t] / 2.0 if want[0, t] > 0 else want[0, t] * 2.0
    for t, c in {60: 2, 30: 1}.items():  # presence/frequency: output tokens only
        want[0, t] -= 0.25 * c + 0.5
    assert torch.allclose(got, want)


def test_min_tokens_bans_eos_and_stop_tokens_until_reached():
    logits = torch.zeros(2, V)
    logits[:, 2] = 10.0  # EOS would win
    logits[:, 5] = 9.0  # a stop token next
    sp = SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=[5], max_tokens=8)
    toks, _ = run([(sp, [1, 7], 1), (sp, [1, 7, 8, 9], 1)], logits)
    assert toks[0] not in (2, 5)  # one output token so far: banned
    assert toks[1] == 2  # three output tokens: allowed again


def test_logprobs_of_the_raw_distribution():
    logits = rand_logits(3, seed=5)
    specs = [(SamplingParams(temperature=0.0, logprobs=5), [1], 1),
             (SamplingParams(temperature=0.0, logprobs=0, repetition_penalty=3.0), [1], 1),
             (SamplingParams(temperature=0.0), [1], 1)]
    toks, lps = run(specs, logits)
    ref = logits.log_softmax(-1)
    assert lps[2] is None
    assert lps[1].top_ids == [] and lps[1].token_id == toks[1]
    assert lps[1].logprob == pytest.approx(ref[1, toks[1]].item(), abs=1e-5)
    top = ref[0].topk(5)
    assert lps[0].top_ids == top.indices.tolist()
    assert lps[0].top_logprobs == pytest.approx(top.values.tolist(), abs=1e-5)
    assert lps[0].token_id == top.indices[0].item()
