"""Invariants of the runner's vectorised step inputs against a per-token reference: for any mix
of new requests, prefill chunks with cached context and decodes, every token's id, position
and KV slot, the per-sequence lengths, and which requests are sampled."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from model_driver import make_runner, tiny_hf_model

from pipeline.messages import NewRequestData, SchedulerOutput, ids_to_bytes
from pipeline.sampling_params import SamplingParams

BS = 16


@pytest.fixture(scope="module")
def runner(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("llama"))
    tiny_hf_model("llama", path, seed=3)
    r = make_runner(path, num_blocks=512, max_num_seqs=16)
    yield r
    r.close()


request = st.tuples(st.integers(1, 80), st.integers(0, 80), st.integers(1, 40)).map(
    # (known tokens, computed before this step, scheduled now) made consistent
    lambda t: (t[0], min(t[1], t[0] - 1), min(t[2], t[0] - min(t[1], t[0] - 1))))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(reqs=st.lists(request, min_size=1, max_size=8), seed=st.integers(0, 2**16))
def test_step_inputs_match_a_per_token_reference(runner, reqs, seed):
    rng = np.random.default_rng(seed)
    free = rng.permutation(runner.num_blocks).tolist()
    new, sched, expect = [], {}, []
    for i, (known, computed, n) in enumerate(reqs):
        tokens = rng.integers(0, runner.vocab_size, known).tolist()
        blocks = [free.pop() for _ in range(-(-(computed + n) // BS))]
        rid = f"q{i}"
        new.append(NewRequestData(rid, ids_to_bytes(tokens), known, SamplingParams(), blocks, computed))
        sched[rid] = n
        expect.append((tokens, blocks, computed, n, computed + n >= known))
    so = SchedulerOutput(1, new, [], sched, sum(sched.values()), [], [])
    runner._apply_diff(so)
    try:
        inp = runner.prepare_inputs(so)
    finally:
        runner._apply_diff(SchedulerOutput(2, [], [], {}, 0, list(sched), []))
    ids, pos, slots, logit_idx = [], [], [], []
    for tokens, blocks, computed, n, sampled in expect:
        for p in range(computed, computed + n):
            ids.append(tokens[p])
            pos.append(p)
            slots.append(blocks[p // BS] * BS + p % BS)
        if sampled:
            logit_idx.append(len(ids) - 1)
    assert inp.input_ids.tolist() == ids
    assert inp.positions.tolist() == pos
    assert inp.meta.slot_mapping.tolist() == slots
    assert inp.meta.seq_lens.tolist() == [c + n for _, _, c, n, _ in expect]
    assert inp.meta.cu_seqlens_q.tolist() == np.concatenate([[0], np.cumsum([n for *_, n, _ in expect])]).tolist()
    assert inp.logits_indices.tolist() == logit_idx
    for row, (_, blocks, *_rest) in enumerate(expect):
        assert inp.meta.block_tables[row, :len(blocks)].tolist() == blocks
    assert inp.meta.block_tables.dtype == torch.int32 and inp.meta.slot_mapping.dtype == torch.int64
