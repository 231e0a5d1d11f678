"""Size limits are counted in the unit the transport enforces (bytes), before a request is
accepted, and the rings are sized from them: a request that passes them fits every ring it
crosses, and its answer fits the answers ring. The daemon test drives the real processes
(a prompt under the old character limit but over the ring's byte limit used to crash it)."""
from __future__ import annotations

import threading
import time

import pytest
import zmq
from e2e_helpers import Daemon, make_tiny_model, shm_entries
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline.config import EngineConfig
from pipeline.frontend import protocol as P
from pipeline.gateway.gateway import Gateway
from pipeline.ipc.codec import TaggedCodec
from pipeline.ipc.ring import Ring
from pipeline.messages import (
    AbortRequest,
    EngineRequest,
    GatewayRequest,
    OutputRegistration,
    RequestResult,
    Timings,
    TokenLogprobs,
    Usage,
)
from pipeline.messages.answers import Completion
from pipeline.messages.requests import MAX_PROMPT_BYTES, MAX_PROMPT_TOKENS, MAX_REQUEST_BYTES
from pipeline.runtime.ring_sizes import (
    ANSWER_BYTES_PER_TOKEN,
    answer_bytes_bound,
    capacity,
    request_bytes,
)
from pipeline.runtime.rings import RING_MESSAGES, Channel, message_limits
from pipeline.sampling_params import SamplingParams
from pipeline.sampling_params.limits import (
    MAX_BAD_WORD_TOKENS,
    MAX_BAD_WORDS,
    MAX_LOGIT_BIAS,
    MAX_LOGPROBS,
    MAX_STOP_STRING_BYTES,
    MAX_STOP_STRINGS,
    MAX_STOP_TOKEN_IDS,
)

WIDE = "\U0010FFFF"  # 4 bytes of UTF-8, the most one character takes


def encoded(role: str, msg) -> int:
    """Bytes of `msg` as ring `role` carries it."""
    return len(TaggedCodec(RING_MESSAGES[role]).encode(msg))


def widest_params() -> SamplingParams:
    """Every list field of SamplingParams at its limit, with the widest values."""
    big = 2**31 - 1
    return SamplingParams(
        n=64, max_tokens=big, stop=[WIDE * (MAX_STOP_STRING_BYTES // 4)] * MAX_STOP_STRINGS,
        stop_token_ids=[big] * MAX_STOP_TOKEN_IDS,
        bad_words_token_ids=[[big] * MAX_BAD_WORD_TOKENS] * (2 * MAX_BAD_WORDS),
        logit_bias={big - i: -1.5 for i in range(MAX_LOGIT_BIAS)}, seed=2**63 - 1,
        temperature=0.123456789, prompt_logprobs=MAX_LOGPROBS,
        truncate_prompt_tokens=big)


def test_a_request_within_every_field_limit_is_within_the_request_limit():
    """So the catch-all (MAX_REQUEST_BYTES) refuses only requests over some field's limit
    or with fields no limit names (e.g. allowed_token_ids)."""
    req = GatewayRequest(req_id=WIDE * P.MAX_ID_LEN, sampling_params=widest_params(),
                         prompt=WIDE * (MAX_PROMPT_BYTES // 4), stream=True,
                         arrival_time=time.time(), priority=-(2**31), cache_salt=WIDE * 256)
    assert encoded("submit", req) <= MAX_REQUEST_BYTES


@settings(max_examples=30, deadline=None)
@given(max_len=st.integers(2, 4 * MAX_PROMPT_TOKENS))
def test_a_tokenized_request_fits_the_register_and_requests_rings(max_len):
    """What crossed the submit ring (at most MAX_REQUEST_BYTES, sampling params included),
    with its prompt as token ids of the longest prompt validation lets through."""
    sp = widest_params()
    rest = GatewayRequest(req_id=WIDE * P.MAX_ID_LEN, sampling_params=sp, cache_salt=WIDE * 256)
    assert encoded("submit", rest) <= MAX_REQUEST_BYTES
    ids = b"\xff" * 4 * min(max_len - 1, MAX_PROMPT_TOKENS)
    reg = OutputRegistration(req_id=rest.req_id, prompt_token_ids=ids, sampling_params=sp,
                             stream=True, arrival_time=time.time())
    er = EngineRequest(rest.req_id, ids, sp, time.time(), [2**31 - 1] * 64, -(2**31), rest.cache_salt)
    limits = message_limits(EngineConfig(), max_len)
    assert encoded("register", reg) <= limits["register"] == request_bytes(max_len)
    assert encoded("requests", er) <= limits["requests"]
    assert capacity(limits["register"]) // 2 >= limits["register"]


def logprobs(k: int, n: int) -> list[TokenLogprobs]:
    return [TokenLogprobs(2**31 - 1, -1e-300, [2**31 - 1] * k, [-1e-300] * k) for _ in range(n)]


@settings(max_examples=60, deadline=None)
@given(n=st.integers(1, 5), max_tokens=st.integers(1, 40), prompt=st.integers(1, 40),
       lp=st.one_of(st.none(), st.integers(0, MAX_LOGPROBS)),
       plp=st.one_of(st.none(), st.integers(0, MAX_LOGPROBS)), text=st.integers(1, 40))
def test_answer_bound_is_an_upper_bound_of_the_real_final(n, max_tokens, prompt, lp, plp, text):
    """The largest final the token processor can build for these params (every field at its
    widest) encodes within answer_bytes_bound, which the tokenizer stage checks against the
    answers ring's message limit."""
    sp = SamplingParams(n=n, max_tokens=max_tokens, logprobs=lp, prompt_logprobs=plp)
    chars = WIDE * (text // 4) + "x" * (text % 4)  # `text` bytes of text per token
    stop = WIDE * (MAX_STOP_STRING_BYTES // 4)

    def completion(i: int) -> Completion:
        return Completion(index=i, text=chars * max_tokens, token_ids=[2**31 - 1] * max_tokens,
                          finish_reason="length", stop_reason=stop,
                          logprobs=None if lp is None else logprobs(lp, max_tokens),
                          cumulative_logprob=-1e-300)

    outs = [completion(i) for i in range(n)] if n > 1 else []
    c = completion(0)
    t = time.time()
    res = RequestResult(
        id=WIDE * P.MAX_ID_LEN, text=c.text, token_ids=c.token_ids, finish_reason="length",
        usage=Usage(2**31 - 1, 2**31 - 1, 2**31 - 1),
        timings=Timings(t, t, t, t, 1e-300, 1e-300, 1e-300, [1e-300] * (n * max_tokens)),
        stop_reason=stop, logprobs=c.logprobs, outputs=outs, cumulative_logprob=-1e-300,
        prompt_logprobs=None if plp is None else [None, *logprobs(plp, prompt - 1)])
    assert encoded("answers", res) <= answer_bytes_bound(sp, prompt, text)


@pytest.mark.parametrize("max_len", [256, 2048, 32768, 131072])
def test_answers_ring_carries_a_plain_answer_of_max_model_len_tokens(max_len):
    """Sizing policy: n = 1 without logprobs, up to max_model_len - 1 output tokens of up to
    ANSWER_BYTES_PER_TOKEN - 14 bytes of text each, is never refused for its size."""
    limit = message_limits(EngineConfig(), max_len)["answers"]
    sp = SamplingParams(max_tokens=max_len - 1)
    assert answer_bytes_bound(sp, 1, ANSWER_BYTES_PER_TOKEN - 14) <= limit


def test_gateway_aborts_any_number_of_requests_in_messages_that_fit_the_ring(inst):
    """A drain aborts everything in flight at once: 10000 long ids used to be one message
    over the submit ring's limit, which raised out of the drain."""
    gw = Gateway(EngineConfig(), lambda out: None)
    ring = Ring.create(inst, "submit", capacity(MAX_REQUEST_BYTES), role="writer", claim=True)
    reader = Channel(Ring.attach(ring.name, "reader"), "submit")
    gw.rings = {"submit": Channel(ring, "submit")}
    ids = [f"{i:05d}" + WIDE * 250 for i in range(10000)]  # 1 KB each: 10 MB in all
    gw.inflight = dict.fromkeys(ids, False)
    got: list[str] = []

    def drain() -> None:
        while len(got) < len(ids):
            msg = reader.recv(timeout=30)
            assert isinstance(msg, AbortRequest) and msg.message == "aborted by the test"
            got.extend(msg.req_ids)

    t = threading.Thread(target=drain)
    t.start()
    gw.abort(ids, "aborted by the test")
    t.join(60)
    assert got == ids
    reader.close()
    ring.close()


# ---- the daemon, on its real processes ----

@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.getbasetemp() / "e2e-tiny")  # one per session


class Raw:
    """A bare DEALER: the wire protocol, nothing of the client library."""

    def __init__(self, address: str) -> None:
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(address)

    def final(self, **gen) -> RequestResult:
        self.sock.send(P.encode(P.Generate(**gen)))
        while self.sock.poll(120_000):
            reply = P.decode_reply(self.sock.recv())
            if isinstance(reply, P.Final):
                assert reply.result.id == gen["id"]
                return reply.result
            assert not isinstance(reply, P.Error), reply
        raise TimeoutError(f"no final for {gen['id']}")

    def close(self) -> None:
        self.sock.close()
        self.ctx.term()


def test_daemon_refuses_requests_too_large_for_its_rings_and_keeps_serving(model):
    d = Daemon(model)
    try:
        deadline = time.monotonic() + 120
        while "serving on" not in d.output():
            assert d.proc.poll() is None and time.monotonic() < deadline, d.output()
            time.sleep(0.2)
        c = Raw(d.address)
        emoji = "\U0001F600" * (MAX_PROMPT_BYTES // 4 + 1)  # under the old character limit
        chat = [{"role": "user", "content": "y" * (1 << 20)}] * 5  # each under any limit
        huge_ids = [2**40] * MAX_PROMPT_TOKENS  # 9 bytes each in msgpack: over the request limit
        for rid, gen, needle in (
                ("emoji", {"prompt": emoji},
                 f"field `prompt`: {len(emoji.encode())} bytes (UTF-8), the limit is {MAX_PROMPT_BYTES} bytes"),
                ("chat", {"messages": chat}, "field `messages`: 5 messages of "),
                ("ids", {"prompt_token_ids": huge_ids},
                 f"the limit is {MAX_REQUEST_BYTES} bytes (MAX_REQUEST_BYTES); field `prompt_token_ids`")):
            res = c.final(id=rid, **gen)
            assert res.finish_reason == "error" and res.error is not None, res
            assert res.error.code == "invalid_request" and needle in res.error.message, res.error
        ok = c.final(id="after", prompt="The for statement", max_tokens=3, ignore_eos=True)
        assert ok.error is None and len(ok.token_ids) == 3
        c.close()
        assert d.proc.poll() is None, d.output()
    finally:
        rc = d.stop()
    assert rc == 0, d.output() if not d.log.closed else rc
    assert shm_entries(d.instance_id) == []


@pytest.mark.parametrize("hidden", [896, 4096])
def test_a_step_of_embeddings_fits_the_results_and_outputs_rings(hidden):
    """Every sequence of a step may be an embedding request whose prefill ends in it: the
    worker's and the engine's step messages then carry max_num_seqs vectors of hidden_size
    float32 (the 0.5B shape: 896), and the answer one of msgpack float64s."""
    from pipeline.messages import EngineOutput, EngineOutputs, ModelRunnerOutput
    from pipeline.messages.step import Pooled

    cfg = EngineConfig()
    seqs = cfg.scheduler_config.max_num_seqs
    vec = b"\xff" * 4 * hidden
    rid = WIDE * P.MAX_ID_LEN
    limits = message_limits(cfg, 2048, hidden)
    mro = ModelRunnerOutput(2**62, [], [], pooled=[Pooled(rid, vec) for _ in range(seqs)])
    assert encoded("results", mro) <= limits["results"]
    outs = EngineOutputs([EngineOutput(rid, [], "stop", None, None, 2**31 - 1, 2**31 - 1, 1e-300,
                                       embedding=vec) for _ in range(seqs)], 1e-300)
    assert encoded("outputs", outs) <= limits["outputs"]
    t = time.time()
    res = RequestResult(id=rid, text="", token_ids=[], finish_reason="stop", usage=Usage(1, 0, 0),
                        timings=Timings(t, t, t, t, 1e-300, 1e-300, 1e-300, []),
                        embedding=[-1e-300] * hidden)
    assert encoded("answers", res) <= limits["answers"]
