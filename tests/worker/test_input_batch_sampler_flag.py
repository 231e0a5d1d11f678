"""Worker persistent batch: the count of live rows that need the full sampler (the model
runner takes a bare argmax while it is zero), and of rows that ask for prompt logprobs,
stay exact through any add/remove sequence."""
from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline.messages import NewRequestData, ids_to_bytes
from pipeline.sampling_params import SamplingParams
from pipeline.worker.input_batch import InputBatch

PARAMS = [
    SamplingParams(temperature=0.0),
    SamplingParams(temperature=0.0, max_tokens=8),
    SamplingParams(temperature=0.7),
    SamplingParams(temperature=0.0, repetition_penalty=1.2),
    SamplingParams(temperature=0.0, presence_penalty=0.5),
    SamplingParams(temperature=0.0, frequency_penalty=0.5),
    SamplingParams(temperature=0.0, logprobs=0),
    SamplingParams(temperature=0.0, min_tokens=2, max_tokens=4),
    SamplingParams(temperature=0.0, logit_bias={3: 1.0}),
    SamplingParams(temperature=0.0, allowed_token_ids=[1, 2]),
    SamplingParams(temperature=0.0, bad_words_token_ids=[[4, 5]]),
    SamplingParams(temperature=0.0, prompt_logprobs=1),  # the model runner's, not the sampler's
]
PLAIN = {0, 1, 11}


@settings(max_examples=60, deadline=None)
@given(ops=st.lists(st.tuples(st.booleans(), st.integers(0, 5), st.integers(0, len(PARAMS) - 1)),
                    max_size=40))
def test_needs_sampler_count_tracks_live_rows(ops):
    b = InputBatch(max_num_reqs=4, max_model_len=64, block_size=16)
    live: dict[str, int] = {}
    for add, rid_n, p in ops:
        rid = f"r{rid_n}"
        if add and rid not in live and len(live) < 4:
            b.add(NewRequestData(rid, ids_to_bytes([1, 2, 3]), 3, PARAMS[p], [0], 0))
            live[rid] = p
        elif not add:
            b.remove(rid)  # unknown ids are ignored
            live.pop(rid, None)
        assert b.num_needs_sampler == sum(p not in PLAIN for p in live.values())
        assert int(b.needs_sampler.sum()) == b.num_needs_sampler
        assert b.num_prompt_logprob_rows == sum(p == 11 for p in live.values())
        assert b.has_processors.sum() == sum(p in (8, 9, 10) for p in live.values())
