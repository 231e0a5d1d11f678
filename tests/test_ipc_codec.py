"""Message codec: engine messages survive encode/decode exactly (token ids as raw bytes), and a
message decoded as the wrong type fails loudly instead of producing garbage."""
from __future__ import annotations

import msgspec
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline.engine.messages import AbortRequest, EngineOutput, EngineOutputs, EngineRequest
from pipeline.engine.sched_output import bytes_to_ids, ids_to_bytes
from pipeline.ipc import codec
from pipeline.sampling_params import SamplingParams

token_ids = st.lists(st.integers(0, 2**31 - 1), max_size=300)


@settings(max_examples=60, deadline=None)
@given(ids=token_ids, max_tokens=st.integers(1, 4096), temperature=st.floats(0, 2),
       stop=st.lists(st.text(max_size=8), max_size=3), salt=st.none() | st.text(max_size=8))
def test_engine_request_round_trips(ids, max_tokens, temperature, stop, salt):
    req = EngineRequest("r-1", ids_to_bytes(ids),
                        SamplingParams(max_tokens=max_tokens, temperature=temperature, stop=stop),
                        123.5, [2, 7], cache_salt=salt)
    back = codec.decode(codec.encode(req), EngineRequest)
    assert back == req
    assert bytes_to_ids(back.prompt_token_ids).tolist() == ids
    assert bytes_to_ids(back.prompt_token_ids).dtype == np.dtype("<i4")


@settings(max_examples=30, deadline=None)
@given(st.lists(st.tuples(st.text(max_size=6), token_ids.map(lambda x: x[:8]),
                          st.sampled_from([None, "stop", "length", "abort"])), max_size=20))
def test_engine_outputs_round_trip(rows):
    outs = EngineOutputs([EngineOutput(r, t, f) for r, t, f in rows], 1.0)
    assert codec.decode(codec.encode(outs), EngineOutputs) == outs


def test_wrong_type_is_rejected():
    blob = codec.encode(AbortRequest(["a", "b"], "stop"))
    assert codec.decode(blob, AbortRequest) == AbortRequest(["a", "b"], "stop")
    with pytest.raises(msgspec.ValidationError):
        codec.decode(blob, EngineRequest)
