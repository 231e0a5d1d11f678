"""Message codec: engine messages survive encode/decode exactly (token ids as raw bytes), and a
message of a type its ring does not carry, or with an unknown tag, fails loudly instead of
producing garbage."""
from __future__ import annotations

import msgspec
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline.ipc.codec import TaggedCodec
from pipeline.messages import (
    AbortRequest,
    EngineOutput,
    EngineOutputs,
    EngineRequest,
    RequestResult,
    Tag,
    bytes_to_ids,
    ids_to_bytes,
)
from pipeline.runtime.rings import RING_MESSAGES
from pipeline.sampling_params import SamplingParams

REQUESTS = TaggedCodec(RING_MESSAGES["requests"])
OUTPUTS = TaggedCodec(RING_MESSAGES["outputs"])
token_ids = st.lists(st.integers(0, 2**31 - 1), max_size=300)


@settings(max_examples=60, deadline=None)
@given(ids=token_ids, max_tokens=st.integers(1, 4096), temperature=st.floats(0, 2),
       stop=st.lists(st.text(min_size=1, max_size=8), max_size=3), salt=st.none() | st.text(max_size=8))
def test_engine_request_round_trips(ids, max_tokens, temperature, stop, salt):
    req = EngineRequest("r-1", ids_to_bytes(ids),
                        SamplingParams(max_tokens=max_tokens, temperature=temperature, stop=stop),
                        123.5, [2, 7], cache_salt=salt)
    back = REQUESTS.decode(REQUESTS.encode(req))
    assert back == req
    assert bytes_to_ids(back.prompt_token_ids).tolist() == ids
    assert bytes_to_ids(back.prompt_token_ids).dtype == np.dtype("<i4")


@settings(max_examples=30, deadline=None)
@given(st.lists(st.tuples(st.text(max_size=6), token_ids.map(lambda x: x[:8]),
                          st.sampled_from([None, "stop", "length", "abort"])), max_size=20))
def test_engine_outputs_round_trip(rows):
    outs = EngineOutputs([EngineOutput(r, t, f) for r, t, f in rows], 1.0)
    assert OUTPUTS.decode(OUTPUTS.encode(outs)) == outs


def test_wrong_type_is_rejected():
    blob = REQUESTS.encode(AbortRequest(["a", "b"], "stop"))
    assert REQUESTS.decode(blob) == AbortRequest(["a", "b"], "stop")
    with pytest.raises(TypeError, match="EngineOutputs is not carried here"):
        REQUESTS.encode(EngineOutputs([], 0.0))
    with pytest.raises(ValueError, match=f"unknown message tag {int(Tag.ABORT)}"):
        OUTPUTS.decode(blob)  # an abort on the outputs ring: a mis-wired ring
    forged = bytes([Tag.ENGINE_REQUEST]) + bytes(blob[1:])  # an abort's payload, a request's tag
    with pytest.raises(msgspec.ValidationError):
        REQUESTS.decode(forged)
    with pytest.raises(ValueError, match="empty"):
        REQUESTS.decode(b"")


def test_every_ring_names_distinct_types_and_tags():
    for role, types in RING_MESSAGES.items():
        assert len(set(types.values())) == len(types), role
        assert all(isinstance(t, Tag) for t in types), role
    assert RequestResult in RING_MESSAGES["answers"].values()
