"""Wire protocol: round trips, strict decoding with errors that name the field and the
limit, one parser shared by pipe mode and ZMQ, client session bookkeeping. The limits that
need the model are the validator's (test_validate.py)."""
from __future__ import annotations

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline.frontend import protocol as P
from pipeline.frontend.request_parser import request_from_json, sampling_params
from pipeline.frontend.sessions import ClientSessions, DuplicateRequestId
from pipeline.messages import ErrorInfo, RequestDelta, RequestResult, Timings, Usage
from pipeline.sampling_params import SamplingParams


def frame(obj) -> bytes:
    return msgspec.msgpack.encode(obj)


def reject(obj_or_frame, max_frame_bytes: int = P.MAX_FRAME_BYTES) -> P.ProtocolError:
    data = obj_or_frame if isinstance(obj_or_frame, bytes) else frame(obj_or_frame)
    with pytest.raises(P.ProtocolError) as exc:
        msg = P.decode_client(data, max_frame_bytes)
        if isinstance(msg, P.Generate):
            sampling_params(msg)
    return exc.value


def test_sampling_fields_mirror_sampling_params():
    extra = {"v", "id", "prompt", "prompt_token_ids", "messages", "stream", "priority", "cache_salt",
             "kv_transfer", "add_generation_prompt", "continue_final_message", "chat_template_kwargs",
             "task", "tools"}
    assert set(P.Generate.__struct_fields__) - extra == set(SamplingParams.__struct_fields__)


def test_round_trips():
    msgs = [P.Generate(id="a", prompt="hi", max_tokens=3, stop=["x"], stream=True),
            P.Abort(id="a"), P.Health(id="h"), P.Stats(id="s"), P.Ping(), P.Bye()]
    for m in msgs:
        assert P.decode_client(P.encode(m)) == m
    res = RequestResult(id="a", text="t", token_ids=[1], finish_reason="stop", usage=Usage(1, 1, 0),
                        timings=Timings(arrival_time=1.0, itl=[0.1]))
    replies = [P.Delta(delta=RequestDelta("a", "t", [1])), P.Final(result=res),
               P.Error(id=None, error=ErrorInfo("invalid_request", "m")),
               P.HealthReply(id="h", status="ok"), P.StatsReply(id="s", stats={"x": 1})]
    for r in replies:
        assert P.decode_reply(P.encode(r)) == r


@pytest.mark.parametrize("obj, rid, needle", [
    ({"op": "generate", "id": "a", "prompt": "x", "max_tokens": "3"}, "a", "field `max_tokens`: expected `int`, got `str`"),
    ({"op": "generate", "id": "a", "prompt": "x", "bogus": 1}, "a", "unknown field `bogus`"),
    ({"op": "generate", "id": "a", "messages": [{"role": "user"}]}, "a", "missing required field `content`"),
    ({"op": "generate", "id": "a", "prompt": "x", "priority": 2**40}, "a", "field `priority`"),
    ({"op": "generate", "id": "a", "prompt": "x", "stop": [3]}, "a", "field `stop[0]`"),
    ({"op": "generate", "id": "x" * 300, "prompt": "x"}, None, f"length <= {P.MAX_ID_LEN}"),
    ({"op": "generate", "id": "a", "prompt": "x", "v": 7}, "a", "protocol version 7"),
    ({"op": "launch", "id": "a"}, "a", "field `op`"),
    ({"id": "a"}, "a", "missing required field `op`"),
    ([1, 2], None, "Expected `object`"),
])
def test_bad_requests_name_the_field(obj, rid, needle):
    err = reject(obj)
    assert needle in err.error.message and err.req_id == rid
    assert err.error.code in ("invalid_request", "unsupported_version")


def test_oversized_and_garbage_frames():
    err = reject(frame({"op": "generate", "id": "big", "prompt": "x" * 500}), max_frame_bytes=100)
    assert err.req_id == "big" and "limit of 100 bytes" in err.error.message
    assert "not valid msgpack" in reject(b"\xc1\x00").error.message


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=64))
def test_random_bytes_never_crash(data):
    try:
        P.decode_client(data)
    except P.ProtocolError as exc:
        assert exc.error.message


def test_request_from_json_is_the_same_path():
    req, sp = request_from_json(b'{"id": 7, "prompt": "hi", "temperature": 0, "stop": "END"}',
                                  {"max_tokens": 9})
    assert (req.id, req.prompt, sp.temperature, sp.max_tokens, sp.stop) == (7, "hi", 0.0, 9, ["END"])
    _, sp2 = request_from_json({"messages": [{"role": "user", "content": "x"}], "max_tokens": 2})
    assert sp2.max_tokens == 2
    with pytest.raises(P.ProtocolError, match="field `top_p`"):
        request_from_json({"id": "q", "prompt": "x", "top_p": "high"})
    with pytest.raises(P.ProtocolError, match="not valid JSON"):
        request_from_json(b"{nope")
    with pytest.raises(P.ProtocolError, match="unknown field `promt`") as exc:
        request_from_json({"id": "q", "promt": "x"})
    assert exc.value.req_id == "q"


def test_sessions_lifecycle():
    s = ClientSessions()
    a1 = s.start(b"A", "1")
    b1 = s.start(b"B", "1")  # same client id, other client: fine
    assert a1 != b1 and s.owner(a1) == (b"A", "1")
    with pytest.raises(DuplicateRequestId, match="already in flight"):
        s.start(b"A", "1")
    assert s.internal_id(b"A", "1") == a1
    assert s.finish(a1) == (b"A", "1") and s.finish(a1) is None
    a2 = s.start(b"A", "1")  # id reusable once finished, new internal id
    assert a2 != a1 and sorted(s.clients()) == [b"A", b"B"]
    assert s.drop_client(b"A") == [a2] and s.drop_client(b"B") == [b1] and len(s) == 0
    assert s.owner(a2) is None and s.clients() == []
