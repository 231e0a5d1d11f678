"""The tokenizer stage: a long prompt does not hold up the requests behind it, and the stage
keeps its ordering guarantees (a request is registered with the token processor before the
engine sees it; an abort never overtakes the request it cancels, and a request aborted while
it is tokenized gets exactly one answer). Also the bound on one token's text that sizes
answers, against the real detokenizer.

The stage loop runs in a thread of the test over real rings; a gate in its tokenizer holds a
"long" prompt for as long as the test wants (what a multi-megabyte prompt does), so nothing
here depends on timing. The end-to-end test runs the real processes.
"""
from __future__ import annotations

import json
import subprocess
import threading
import time

import pytest
from e2e_helpers import ENGINE_FLAGS, PIPELINE, ROOT, env, make_tiny_model, shm_entries
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline.config import DEFAULT_MODEL, EngineConfig
from pipeline.ipc.ring import Ring
from pipeline.messages import AbortRequest, EngineRequest, GatewayRequest, OutputRegistration, RequestResult
from pipeline.messages.kv_layout import KVLayout
from pipeline.output.detokenizer import DetokenizerTable
from pipeline.runtime.ring_sizes import capacity
from pipeline.runtime.rings import Channel, message_limits
from pipeline.runtime.spec import ModelInfo, StageSpec
from pipeline.sampling_params import SamplingParams
from pipeline.tokenizer.stage import TokenizerLoop, clip, max_token_text_bytes
from pipeline.tokenizer.tokenizer import Tokenizer

MAX_LEN = 2048


class _Stop(Exception):
    pass


class Stage:
    """A TokenizerLoop in a thread, with the test holding the other end of its four rings."""

    def __init__(self, inst, capacities: dict[str, int] | None = None) -> None:
        cfg = EngineConfig.of(model=DEFAULT_MODEL, instance_id=inst.id)
        limits = message_limits(cfg, MAX_LEN)
        caps = {r: capacity(limits[r]) for r in ("submit", "rejects", "register", "requests")}
        caps |= capacities or {}
        ends = {"submit": "writer", "rejects": "reader", "register": "reader", "requests": "reader"}
        self.ch = {r: Channel(Ring.create(inst, r, caps[r], role=end, claim=True), r)
                   for r, end in ends.items()}
        spec = StageSpec(name="tokenizer", kind="tokenizer", config=cfg,
                         rings={r: c.ring.name for r, c in self.ch.items()}, ring_timeout_s=0.05,
                         model=ModelInfo(max_model_len=MAX_LEN, vocab_size=2048, eos_token_ids=[1],
                                         kv=KVLayout(num_layers=1, num_blocks=64, block_size=16,
                                                     num_kv_heads=1, head_dim=1, dtype="float32")))
        self.loop = TokenizerLoop(spec)
        self.gate = threading.Event()  # opens the tokenizer for prompts starting with "LONG"
        self.held = threading.Event()  # set once a LONG prompt waits at the gate
        encode = self.loop.tokenizer.encode

        def gated(text: str, add_special_tokens: bool = True) -> list[int]:
            if text.startswith("LONG"):
                self.held.set()
                assert self.gate.wait(60)
            return encode(text, add_special_tokens)

        self.loop.tokenizer.encode = gated  # type: ignore[method-assign]
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()
        self.registered: list[str] = []

    def _run(self) -> None:
        try:
            self.loop.run_forever()
        except _Stop:
            pass

    def send(self, msg) -> None:
        self.ch["submit"].send(msg, timeout=10)

    def next_request(self, timeout: float = 30) -> EngineRequest | AbortRequest:
        """The engine's next message; every request it names was registered before."""
        msg = self.ch["requests"].recv(timeout=timeout)
        while (reg := self.ch["register"].try_recv()) is not None:
            assert isinstance(reg, OutputRegistration)
            self.registered.append(reg.req_id)
        if isinstance(msg, EngineRequest):
            assert msg.req_id in self.registered, "the engine saw a request not registered yet"
        return msg

    def close(self) -> None:
        self.gate.set()
        self.loop.failure = _Stop()
        self.thread.join(10)
        self.loop.pool.shutdown(wait=True)
        for c in self.ch.values():
            c.close()


def req(rid: str, prompt: str, **sp) -> GatewayRequest:
    return GatewayRequest(req_id=rid, prompt=prompt, sampling_params=SamplingParams(**sp),
                          arrival_time=1.0)


@pytest.fixture
def stage(inst):
    s = Stage(inst)
    yield s
    s.close()


def test_long_prompt_does_not_hold_up_the_requests_behind_it(stage):
    stage.send(req("long", "LONG prompt"))
    assert stage.held.wait(30)
    for i in range(3):
        stage.send(req(f"small{i}", f"small prompt {i}"))
    # While "long" is still being tokenized, the small ones reach the engine, registered
    # (in the order their tokenization ends).
    assert sorted(stage.next_request().req_id for _ in range(3)) == ["small0", "small1", "small2"]
    stage.gate.set()
    assert stage.next_request().req_id == "long"
    assert stage.ch["rejects"].try_recv() is None


def test_abort_of_a_request_being_tokenized_answers_it_once_and_it_never_runs(stage):
    stage.send(req("long", "LONG prompt"))
    assert stage.held.wait(30)
    stage.send(AbortRequest(req_ids=["long"], message="aborted by the client"))
    answer = stage.ch["rejects"].recv(timeout=30)
    assert isinstance(answer, RequestResult) and answer.id == "long"
    assert answer.finish_reason == "abort" and answer.token_ids == []
    assert answer.error is not None and answer.error.code == "aborted"
    assert answer.error.message.startswith("aborted by the client")
    stage.gate.set()
    stage.loop.pool.shutdown(wait=True)  # its tokenization has ended, and was dropped
    assert stage.ch["requests"].try_recv() is None
    assert stage.ch["register"].try_recv() is None
    assert stage.ch["rejects"].try_recv() is None


def test_abort_after_the_request_left_follows_it_to_the_engine(stage):
    stage.send(req("a", "hello"))
    first = stage.next_request()
    assert isinstance(first, EngineRequest) and first.req_id == "a"
    stage.send(AbortRequest(req_ids=["a", "unknown"], message="aborted by the client"))
    assert stage.next_request() == AbortRequest(req_ids=["a", "unknown"], reason="abort",
                                                message="aborted by the client")


def test_an_abort_right_behind_its_request_never_overtakes_it(stage):
    """Whichever way the race between tokenizing and the abort goes, each request ends one
    way only: aborted here (one answer, never sent on), or sent on and then aborted."""
    n = 30
    for i in range(n):
        stage.send(req(f"r{i}", f"prompt {i}"))
        stage.send(AbortRequest(req_ids=[f"r{i}"], message="aborted by the client"))
    answered, sent, aborted = set(), [], []
    deadline = time.monotonic() + 60
    while len(answered) + len(aborted) < n:
        assert time.monotonic() < deadline, (answered, sent, aborted)
        try:
            msg = stage.next_request(timeout=0.05)
        except TimeoutError:
            msg = None
        if isinstance(msg, EngineRequest):
            sent.append(msg.req_id)
        elif isinstance(msg, AbortRequest):
            assert msg.req_ids[0] in sent, "an abort overtook its request"
            aborted += msg.req_ids
        while (r := stage.ch["rejects"].try_recv()) is not None:
            assert r.finish_reason == "abort" and r.error.code == "aborted" and r.id not in answered
            answered.add(r.id)
    assert sorted(answered | set(aborted)) == sorted(f"r{i}" for i in range(n))
    assert not answered & set(sent) and sorted(sent) == sorted(aborted)


def test_invalid_requests_are_answered_and_max_tokens_is_cut_to_the_room_left(stage):
    stage.send(GatewayRequest(req_id="ids", prompt_token_ids=[5] * (MAX_LEN - 1),
                              sampling_params=SamplingParams(max_tokens=50)))
    stage.send(GatewayRequest(req_id="vocab", prompt_token_ids=[5, 4096],
                              sampling_params=SamplingParams()))
    er = stage.next_request()
    assert isinstance(er, EngineRequest) and er.sampling_params.max_tokens == 1
    bad = stage.ch["rejects"].recv(timeout=30)
    assert bad.id == "vocab" and bad.error.code == "invalid_request"
    assert "prompt_token_ids[1]" in bad.error.message


def test_a_request_too_large_for_a_ring_once_tokenized_is_refused_and_the_stage_lives(inst):
    """Both messages are measured before either is sent: never registered without reaching
    the engine, never a stage failing on a send."""
    s = Stage(inst, {"register": 8 << 10})  # 4 KiB messages: 1k int32 token ids at most
    try:
        s.send(GatewayRequest(req_id="big", prompt_token_ids=[5] * 1500,
                              sampling_params=SamplingParams(max_tokens=1)))
        s.send(req("next", "still serving"))
        bad = s.ch["rejects"].recv(timeout=30)
        assert bad.id == "big" and bad.error.code == "invalid_request"
        assert "the limit is 4096 bytes (ring register)" in bad.error.message
        assert s.next_request().req_id == "next"
        assert s.registered == ["next"]
    finally:
        s.close()


@settings(max_examples=100, deadline=None)
@given(text=st.text(), limit=st.integers(4, 64))
def test_clip_keeps_valid_utf8_within_the_limit(text, limit):
    out = clip(text, limit)
    assert len(out.encode()) <= limit
    if len(text.encode("utf-8", "replace")) <= limit:
        assert out == text.encode("utf-8", "replace").decode()


TOK = Tokenizer(DEFAULT_MODEL)
TABLE = DetokenizerTable(f"{DEFAULT_MODEL}/tokenizer.json")
MOST = max_token_text_bytes(TOK.tok)


@settings(max_examples=300, deadline=None)
@given(ids=st.lists(st.integers(0, TOK.vocab_size - 1), min_size=1, max_size=40),
       prompt=st.lists(st.integers(0, TOK.vocab_size - 1), max_size=4),
       skip=st.booleans())
def test_no_token_adds_more_text_than_the_bound(ids, prompt, skip):
    """What the answers ring is checked against: the token processor's text for n tokens is
    at most n x max_token_text_bytes, whatever the tokens (partial characters included)."""
    d = TABLE.detokenizer(skip_special_tokens=skip, prompt_token_ids=prompt)
    text = "".join(d.add_token(t) for t in ids) + d.flush()
    assert len(text.encode()) <= len(ids) * MOST


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.getbasetemp() / "e2e-tiny")  # one per session


def test_small_requests_overtake_a_multi_megabyte_prompt_end_to_end(model):
    """Real processes: a ~3 MB prompt is the slowest thing to tokenize here (and is then
    refused: too many tokens); the requests sent after it are answered before it. Needs the
    tokenizer to release the GIL while it encodes (``Tokenizer.encode`` via encode_batch)."""
    lines = [json.dumps({"id": "huge", "prompt": "lorem ipsum dolor sit amet " * 120_000}),
             *(json.dumps({"id": f"s{i}", "prompt": "hi", "max_tokens": 1}) for i in range(3))]
    p = subprocess.Popen([*PIPELINE, "run", "--model", str(model), *ENGINE_FLAGS],
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True, cwd=ROOT, env=env())
    try:
        out, err = p.communicate("\n".join(lines) + "\n", timeout=300)
    finally:
        if p.poll() is None:  # a hung run: leave nothing behind
            p.kill()
            p.wait()
    finals = [json.loads(x) for x in out.splitlines()]
    assert sorted(a["id"] for a in finals) == ["huge", "s0", "s1", "s2"], err
    assert finals[-1]["id"] == "huge", [a["id"] for a in finals]
    assert finals[-1]["error"]["code"] == "invalid_request"
    assert all(a["error"] is None for a in finals[:-1])
    assert shm_entries(f"{p.pid:x}") == []
