"""Per-request logits processors: allowed_token_ids, logit_bias, bad words. In the sampler
on its own (many seeded samples), and through the real ModelRunner on the CPU float32 path
(the fused decoder hands hidden states to the sampler), greedy and sampled alike."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from model_driver import Driver, make_runner, tiny_hf_model

from pipeline.layers import ops
from pipeline.messages import NewRequestData, ids_to_bytes
from pipeline.sampling_params import SamplingParams
from pipeline.worker.input_batch import InputBatch
from pipeline.worker.sampler import Sampler, build_metadata

V = 64
CPU = torch.device("cpu")


def sample(specs: list[tuple[SamplingParams, list[int], int]], logits: torch.Tensor, seed: int = 0):
    b = InputBatch(max_num_reqs=len(specs) + 1, max_model_len=256, block_size=16)
    rows = np.array([b.add(NewRequestData(f"r{i}", ids_to_bytes(t), n, sp, [0], len(t)))
                     for i, (sp, t, n) in enumerate(specs)], dtype=np.int64)
    assert b.num_needs_sampler == sum(b.needs_sampler)
    return Sampler(CPU, seed)(logits.clone(), build_metadata(b, rows, V, [2], CPU))[0].tolist()


def logits_of(n: int, seed: int) -> torch.Tensor:
    return torch.randn(n, V, generator=torch.Generator().manual_seed(seed)) * 4


@settings(max_examples=25, deadline=None)
@given(allowed=st.sets(st.integers(0, V - 1), min_size=1, max_size=5), seed=st.integers(0, 2**31),
       temperature=st.sampled_from([0.0, 0.7, 1.0, 5.0]))
def test_allowed_token_ids_never_yield_another_token(allowed, seed, temperature):
    sp = SamplingParams(temperature=temperature, allowed_token_ids=sorted(allowed), seed=seed)
    toks = sample([(sp, [1], 1)] * 200, logits_of(200, seed % 997), seed)
    assert set(toks) <= allowed


def test_allowed_token_ids_keep_their_relative_odds():
    logits = torch.zeros(3000, V)
    logits[:, 5], logits[:, 9] = 2.0, 1.0  # odds e : 1 between the two allowed tokens
    toks = np.array(sample([(SamplingParams(temperature=1.0, allowed_token_ids=[5, 9]), [1], 1)] * 3000,
                           logits, seed=4))
    assert set(toks.tolist()) == {5, 9}
    assert abs((toks == 5).mean() - np.e / (np.e + 1)) < 0.03


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_logit_bias_of_100_forces_a_token_and_minus_100_bans_it(temperature):
    logits = logits_of(300, 7)
    forced = sample([(SamplingParams(temperature=temperature, logit_bias={13: 100.0}), [1], 1)] * 300, logits)
    assert forced == [13] * 300
    top = logits.argmax(-1)
    banned = sample([(SamplingParams(temperature=temperature, logit_bias={int(t): -100.0}), [1], 1)
                     for t in top.tolist()], logits)
    assert all(b != t for b, t in zip(banned, top.tolist()))


def test_bad_words_single_tokens_and_sequences():
    logits = torch.zeros(4, V)
    logits[:, 7] = 50.0  # greedy would always take 7
    sp = SamplingParams(temperature=0.0, bad_words_token_ids=[[7], [3, 4, 8]])
    assert 7 not in sample([(sp, [1, 2], 2)], logits[:1])
    logits[:, 7] = 0.0
    logits[:, 8] = 50.0
    # Output ends with 3, 4: taking 8 would complete the bad word.
    # Ends with 4 only, or 3, 4 only in the prompt: 8 is fine.
    toks = sample([(sp, [1, 3, 4], 1), (sp, [1, 9, 4], 1), (sp, [3, 4], 2), (sp, [1, 4, 3, 4], 2)], logits)
    assert toks[0] != 8 and toks[1:3] == [8, 8] and toks[3] != 8


def test_processors_mark_the_row_for_the_sampler():
    b = InputBatch(max_num_reqs=4, max_model_len=64, block_size=16)
    for i, sp in enumerate([SamplingParams(temperature=0.0, logit_bias={1: 1.0}),
                            SamplingParams(temperature=0.0, allowed_token_ids=[1]),
                            SamplingParams(temperature=0.0, bad_words_token_ids=[[1]]),
                            SamplingParams(temperature=0.0)]):
        b.add(NewRequestData(f"r{i}", ids_to_bytes([1]), 1, sp, [0], 0))
    assert b.needs_sampler.tolist() == [True, True, True, False] and b.num_needs_sampler == 3
    b.remove("r0")
    assert b.num_needs_sampler == 2 and b.logit_bias[0] is None


# -- through the real worker (CPU float32: the fused decoder path) ----------------------------
@pytest.fixture(scope="module")
def runner(tmp_path_factory):
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    path = str(tmp_path_factory.mktemp("llama"))
    tiny_hf_model("llama", path, seed=9)
    r = make_runner(path)
    assert ops.backend(r.device) is not None  # float32 on CPU with the C ops: the fused decoder
    yield r
    r.close()
    torch.set_num_threads(old)


PROMPT = [(3 * i + 11) % 300 + 3 for i in range(21)]


def outputs(runner, params: list[SamplingParams], n: int = 24) -> list[list[int]]:
    d = Driver(runner)
    for i, sp in enumerate(params):
        d.add(f"r{i}", PROMPT, n, params=sp)
    res = d.run()
    return [res[f"r{i}"] for i in range(len(params))]


def test_real_worker_applies_every_processor_greedy_and_sampled(runner):
    allowed = [10, 20, 30, 40]
    free = outputs(runner, [SamplingParams(temperature=0.0, max_tokens=24)])[0]
    got = outputs(runner, [
        SamplingParams(temperature=1.0, seed=1, max_tokens=24, allowed_token_ids=allowed),
        SamplingParams(temperature=0.0, max_tokens=24, allowed_token_ids=allowed),
        SamplingParams(temperature=1.0, seed=2, max_tokens=24, logit_bias={77: 100.0}),
        SamplingParams(temperature=0.0, max_tokens=24, bad_words_token_ids=[[t] for t in set(free)]),
        SamplingParams(temperature=0.0, max_tokens=24),  # plain greedy in the same batch
    ])
    assert set(got[0]) <= set(allowed) and len(set(got[0])) > 1
    assert set(got[1]) <= set(allowed)
    assert got[2] == [77] * 24
    assert not set(got[3]) & set(free)
    assert got[4] == free
