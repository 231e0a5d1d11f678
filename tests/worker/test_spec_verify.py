"""Speculative decoding's verify step (worker/spec/verify.py) keeps the target's distribution:
over a 6-token vocabulary with two drafts, the first output token is distributed as the
target's first position, the second (given the first draft kept) as its second position, the
third (both kept) as its last: a chi-square test of each against the exact probabilities.
An acceptance rule off by one position (comparing a draw with the next draft, or sampling a
position with the metadata of another) fails it. The sampler's generator is seeded: the test
is deterministic.
"""
from __future__ import annotations

import numpy as np
import torch

from pipeline.messages import NewRequestData, ids_to_bytes
from pipeline.sampling_params import SamplingParams
from pipeline.spec_config import SpeculativeConfig
from pipeline.worker.input_batch import InputBatch
from pipeline.worker.sampler import Sampler, build_metadata
from pipeline.worker.spec.verify import SpecDecoder

V, N, TRIALS = 6, 256, 16
DRAFTS = [2, 4]
# Target logits at the two draft positions and the last one: each a different distribution.
L = torch.tensor([[0.0, 0.5, 1.6, -1.0, 0.2, 0.1],
                  [0.3, -0.5, 0.0, 0.8, 1.0, 0.0],
                  [1.0, 0.0, -0.3, 0.4, 0.0, 0.9]])
P = torch.softmax(L, dim=-1).numpy()
CHI2_DF5_P001 = 20.52  # the chi-square quantile at 0.999, 5 degrees of freedom


def chi2(counts: np.ndarray, probs: np.ndarray) -> float:
    exp = probs * counts.sum()
    return float(((counts - exp) ** 2 / exp).sum())


def one_trial(sampler: Sampler) -> list[list[int]]:
    b = InputBatch(N, 64, 16)
    sp = SamplingParams(temperature=1.0, max_tokens=10)
    for i in range(N):
        b.add(NewRequestData(f"r{i}", ids_to_bytes([1, 3, 5]), 3, sp, [0, 1, 2, 3], 0))
    spec = SpecDecoder(SpeculativeConfig(method="ngram", num_speculative_tokens=2), proposes=False)
    spec.stage(b, {f"r{i}": ids_to_bytes(DRAFTS) for i in range(N)})
    rows = np.arange(N)
    ends = np.arange(N) * 3 + 2  # each row's three positions, flat
    idx, by_pos = spec.positions(rows, ends)
    assert idx.tolist() == [e - 2 for e in ends] + [e - 1 for e in ends]
    dev = torch.device("cpu")
    last, _ = sampler(L[2].expand(N, V).clone(), build_metadata(b, rows, V, [], dev))
    logits = torch.cat([L[0].expand(N, V), L[1].expand(N, V)]).clone()
    draws, _ = spec.verify(b, rows, last, None, logits, by_pos, sampler, V, [], dev)
    v = spec.accept(b, rows, last.numpy(), None, draws.numpy(), None, by_pos)
    out, i = [], 0
    for c in v.counts:
        out.append(v.tokens[i:i + c])
        i += c
    # The batch holds exactly the kept tokens after the prompt.
    for r, toks in enumerate(out):
        assert b.token_ids[r, 3:b.num_tokens[r]].tolist() == toks
    return out


def test_verify_keeps_the_targets_distribution_at_every_position():
    sampler = Sampler(torch.device("cpu"), seed=1234)
    outs = [o for _ in range(TRIALS) for o in one_trial(sampler)]
    first = np.bincount([o[0] for o in outs], minlength=V)
    second = np.bincount([o[1] for o in outs if o[0] == DRAFTS[0]], minlength=V)
    third = np.bincount([o[2] for o in outs if o[:2] == DRAFTS], minlength=V)
    assert all(len(o) == 1 for o in outs if o[0] != DRAFTS[0])
    assert second.sum() > 1000 and third.sum() > 200
    for counts, probs in ((first, P[0]), (second, P[1]), (third, P[2])):
        assert chi2(counts, probs) < CHI2_DF5_P001, (counts, probs * counts.sum())


def test_greedy_keeps_the_drafts_the_argmax_agrees_with():
    b = InputBatch(4, 64, 16)
    for i in range(3):
        b.add(NewRequestData(f"r{i}", ids_to_bytes([1, 3, 5]), 3, SamplingParams(temperature=0.0), [0], 0))
    spec = SpecDecoder(SpeculativeConfig(method="ngram", num_speculative_tokens=2), proposes=False)
    # r0: both drafts right; r1: the first wrong; r2: no drafts.
    spec.stage(b, {"r0": ids_to_bytes([2, 4]), "r1": ids_to_bytes([3, 4])})
    rows = np.arange(3)
    idx, by_pos = spec.positions(rows, np.array([2, 5, 6]))
    assert idx.tolist() == [0, 3, 1, 4]
    logits = torch.stack([L[0], L[0], L[1], L[1]])  # argmax 2 at position 0, 4 at position 1
    draws, _ = spec.verify(b, rows, torch.tensor([0, 0, 5]), None, logits, by_pos, None, V, [], torch.device("cpu"))
    v = spec.accept(b, rows, np.array([0, 0, 5]), None, draws.numpy(), None, by_pos)
    assert v.counts == [3, 1, 1] and v.tokens == [2, 4, 0, 2, 5]
    assert b.num_tokens[:3].tolist() == [6, 4, 4]
