"""Chat options on every way in (issue 11's engine side): add_generation_prompt,
continue_final_message and chat_template_kwargs on the wire and in the tokenizer stage,
OpenAI's text-part content, ``--chat-template FILE`` and ``--max-queued-requests``.

The tokenizer stage is checked on its real processes (`pipeline run`): the prompt token ids
it produced come back as prompt logprobs and are compared with ``Tokenizer``'s. The queue
limit is checked on the gateway's real submit ring, with nothing reading it, so the requests
it accepted stay in flight for as long as the test wants.
"""
from __future__ import annotations

import argparse
import json
import re
import subprocess

import msgspec
import pytest
from e2e_helpers import ENGINE_FLAGS, PIPELINE, ROOT, env, make_tiny_model, run_pipe

from pipeline.config import DEFAULT_MODEL, MAX_CHAT_TEMPLATE_BYTES, EngineConfig
from pipeline.engine_args import add_engine_args, config_from_args
from pipeline.engine.fake_worker import FakeWorker
from pipeline.frontend import protocol as P
from pipeline.frontend.request_parser import gateway_request, request_from_json
from pipeline.gateway.gateway import Gateway, size_problem
from pipeline.ipc.ring import Ring
from pipeline.llm import LLM
from pipeline.messages import GatewayRequest, RequestResult, error_result
from pipeline.messages.requests import MAX_PROMPT_BYTES, MAX_REQUEST_BYTES
from pipeline.runtime.ring_sizes import capacity
from pipeline.runtime.rings import Channel
from pipeline.sampling_params import SamplingParams
from pipeline.tokenizer.tokenizer import Tokenizer, check_chat_options

# Uses a template variable (`tag`), one that fails with a template error when given a string
# (`deep`) and one that makes the template raise (`fail`).
TEMPLATE = ("{{ bos_token }}{% for m in messages %}[{{ m['role'] }}{{ tag | default('') }}] "
            "{{ m['content'] }}\n{% endfor %}{% if deep %}{{ deep.a.b }}{% endif %}"
            "{% if fail %}{{ raise_exception('asked to fail') }}{% endif %}"
            "{% if add_generation_prompt %}[assistant{{ tag | default('') }}] {% endif %}")
PARTS = [{"type": "text", "text": "Name a colour"}, {"type": "text", "text": "in one word"}]
CONV = [{"role": "user", "content": PARTS}, {"role": "assistant", "content": "The colour is"}]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.getbasetemp() / "e2e-tiny")  # one per session


@pytest.fixture(scope="module")
def template_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("tpl") / "chat.jinja"
    path.write_text(TEMPLATE)
    return path


# ---- the wire ----

def test_generate_carries_the_chat_options_and_text_parts_to_the_tokenizer_stage():
    fields = {"messages": CONV, "add_generation_prompt": False, "continue_final_message": True,
              "chat_template_kwargs": {"tag": "!", "n": [1, {"x": None}]}}
    frame = msgspec.msgpack.encode({"op": "generate", "v": P.PROTOCOL_VERSION, "id": "r", **fields})
    zmq_msg = P.decode_client(frame)
    pipe_msg, sp = request_from_json(json.dumps(fields))
    for gen in (zmq_msg, pipe_msg):
        assert isinstance(gen, P.Generate)
        req = gateway_request(gen, sp, "r")
        assert req.messages == CONV
        assert (req.add_generation_prompt, req.continue_final_message) == (False, True)
        assert req.chat_template_kwargs == fields["chat_template_kwargs"]
        # As the submit ring carries it.
        assert msgspec.msgpack.decode(msgspec.msgpack.encode(req), type=GatewayRequest) == req
    plain = gateway_request(*request_from_json('{"messages": [{"role": "user", "content": "hi"}]}'), "p")
    assert (plain.add_generation_prompt, plain.continue_final_message, plain.chat_template_kwargs) \
        == (True, False, None)


@pytest.mark.parametrize("fields, error", [
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": "a", "url": "x"}]}]},
     r"field `messages\[0\]\.content\[0\]`: unknown field `url`"),
    ({"messages": [{"role": "user", "content": [{"text": "a"}]}]},
     r"field `messages\[0\]\.content\[0\]`: missing required field `type`"),
    ({"messages": [{"role": "user", "content": 3}]}, r"field `messages\[0\]\.content`"),
    ({"messages": [{"role": "user", "content": "a"}], "chat_template_kwargs": ["tag"]},
     r"field `chat_template_kwargs`: expected `object \| null`, got `array`"),
    ({"messages": [{"role": "user", "content": "a"}],
      "chat_template_kwargs": {str(i): 0 for i in range(P.MAX_TEMPLATE_KWARGS + 1)}},
     rf"field `chat_template_kwargs`: expected `object` of length <= {P.MAX_TEMPLATE_KWARGS}"),
    ({"messages": [{"role": "user", "content": "a"}], "continue_final_message": "yes"},
     r"field `continue_final_message`: expected `bool`"),
])
def test_bad_chat_fields_are_refused_when_decoded_naming_the_field(fields, error):
    with pytest.raises(P.ProtocolError, match=error):
        request_from_json(json.dumps(fields))


def test_the_size_check_counts_text_parts_and_template_kwargs():
    sp = SamplingParams()
    half = "x" * (MAX_PROMPT_BYTES // 2)
    parts = [{"type": "text", "text": half}, {"type": "text", "text": half}]
    req = GatewayRequest(req_id="a", sampling_params=sp, messages=[{"role": "user", "content": parts}])
    problem = size_problem(req, len(msgspec.msgpack.encode(req)), MAX_REQUEST_BYTES)
    assert problem is not None and problem.startswith("field `messages`: 1 messages of ")
    req = GatewayRequest(req_id="b", sampling_params=sp, messages=[{"role": "user", "content": "hi"}],
                         chat_template_kwargs={"docs": "y" * MAX_REQUEST_BYTES})
    problem = size_problem(req, len(msgspec.msgpack.encode(req)), MAX_REQUEST_BYTES)
    assert problem is not None and "field `chat_template_kwargs` takes" in problem


@pytest.mark.parametrize("options, error", [
    ({"continue_final_message": True}, "field `continue_final_message`: only valid with `messages`"),
    ({"add_generation_prompt": False}, "field `add_generation_prompt`: only valid with `messages`"),
    ({"chat_template_kwargs": {}}, "field `chat_template_kwargs`: only valid with `messages`"),
])
def test_chat_options_without_messages_are_refused(options, error):
    args = {"add_generation_prompt": True, "continue_final_message": False,
            "chat_template_kwargs": None} | options
    with pytest.raises(ValueError, match=error):
        check_chat_options(has_messages=False, **args)
    assert check_chat_options(has_messages=True, **args)["continue_final_message"] \
        == args["continue_final_message"]


# ---- the tokenizer stage, on its real processes ----

def _line(rid: str, **fields) -> str:
    return json.dumps({"id": rid, "max_tokens": 1, "temperature": 0, **fields})


def _prompt_ids(answer: dict) -> list[int]:
    """The prompt's token ids the stage produced, from prompt_logprobs (the first has none)."""
    lps = answer["prompt_logprobs"]
    assert lps[0] is None
    return [lp[0] for lp in lps[1:]]


def test_pipe_mode_renders_chats_with_the_options_and_the_template_file(model, template_file):
    tok = Tokenizer(model, chat_template=TEMPLATE)
    ok = {
        "default": ({"messages": CONV}, {}),
        "no_gen": ({"messages": CONV, "add_generation_prompt": False}, {"add_generation_prompt": False}),
        "continue": ({"messages": CONV, "add_generation_prompt": False, "continue_final_message": True,
                      "chat_template_kwargs": {"tag": "*"}},
                     {"add_generation_prompt": False, "continue_final_message": True, "tag": "*"}),
    }
    refused = {
        "both": ({"messages": CONV, "continue_final_message": True},
                 "field `continue_final_message`: add_generation_prompt and continue_final_message"),
        "clash": ({"messages": CONV, "chat_template_kwargs": {"messages": []}},
                  "field `chat_template_kwargs`: `messages` cannot be set here"),
        "template_pick": ({"messages": CONV, "chat_template_kwargs": {"chat_template": "{{ 1 }}"}},
                          "field `chat_template_kwargs`: `chat_template` cannot be set here"),
        "raises": ({"messages": CONV, "chat_template_kwargs": {"fail": True}}, "chat template: asked to fail"),
        "undefined": ({"messages": CONV, "chat_template_kwargs": {"deep": "str"}},
                      "chat template: UndefinedError"),
        "prompt": ({"prompt": "hi", "continue_final_message": True},
                   "field `continue_final_message`: only valid with `messages`"),
        "image": ({"messages": [{"role": "user", "content": [PARTS[0], {"type": "image_url", "text": ""}]}]},
                  r"field `messages[0].content[1]`: only {\"type\": \"text\""),
    }
    lines = [_line(rid, prompt_logprobs=0, **fields) for rid, (fields, _) in ok.items()]
    lines += [_line(rid, **fields) for rid, (fields, _) in refused.items()]
    rc, answers, err = run_pipe(model, lines, "--chat-template", str(template_file))
    assert rc == 1, err  # some requests failed (on purpose)
    by_id = {a["id"]: a for a in answers}
    assert sorted(by_id) == sorted([*ok, *refused]), err
    for rid, (fields, options) in ok.items():
        assert by_id[rid]["error"] is None, by_id[rid]
        args = dict(options)
        want = tok.apply_chat_template(fields["messages"], args.pop("add_generation_prompt", True), **args)
        assert by_id[rid]["usage"]["prompt_tokens"] == len(want)
        assert _prompt_ids(by_id[rid]) == want[1:], rid
    assert tok.render_chat(CONV, False, continue_final_message=True, tag="*").endswith(
        "[assistant*] The colour is")
    for rid, (_, message) in refused.items():
        error = by_id[rid]["error"]
        assert error["code"] == "invalid_request" and message.replace("\\", "") in error["message"], (rid, error)


def test_llm_takes_the_template_file_and_a_request_dicts_chat_options(template_file):
    worker = FakeWorker(num_blocks=64, block_size=4, max_model_len=256, vocab_size=2048,
                        eos_token_ids=[1])
    llm = LLM(DEFAULT_MODEL, worker=worker, chat_template=str(template_file))
    assert llm.config.model_config.chat_template == TEMPLATE
    tok = Tokenizer(DEFAULT_MODEL, chat_template=TEMPLATE)
    greedy = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)
    (chat,) = llm.chat(CONV, greedy, add_generation_prompt=False, continue_final_message=True,
                       chat_template_kwargs={"tag": "*"})
    assert chat.prompt_token_ids == tok.apply_chat_template(CONV, False, continue_final_message=True, tag="*")
    (same,) = llm.generate({"messages": CONV, "add_generation_prompt": False, "continue_final_message": True,
                            "chat_template_kwargs": {"tag": "*"}}, greedy)
    assert same.prompt_token_ids == chat.prompt_token_ids
    assert same.outputs[0].token_ids == chat.outputs[0].token_ids
    with pytest.raises(ValueError, match="field `add_generation_prompt`: only valid with `messages`"):
        llm.generate({"prompt": "hi", "add_generation_prompt": False}, greedy)


# ---- --chat-template FILE ----

def _config(*flags: str) -> EngineConfig:
    p = argparse.ArgumentParser()
    add_engine_args(p)
    return config_from_args(p.parse_args(list(flags)))


def test_chat_template_file_errors_name_the_flag(tmp_path):
    assert _config().model_config.chat_template is None
    good = tmp_path / "good.jinja"
    good.write_text(TEMPLATE)
    assert _config("--chat-template", str(good)).model_config.chat_template == TEMPLATE
    big = tmp_path / "big.jinja"
    big.write_text("x" * (MAX_CHAT_TEMPLATE_BYTES + 1))
    latin1 = tmp_path / "latin1.jinja"
    latin1.write_bytes(b"caf\xe9 {{ messages }}")
    broken = tmp_path / "broken.jinja"
    broken.write_text("{% for m in messages %}{{ m }}")
    for path, error in ((tmp_path / "missing.jinja", "cannot read it: No such file"),
                        (tmp_path, "cannot read it: Is a directory"),
                        (big, f"larger than the limit of {MAX_CHAT_TEMPLATE_BYTES} bytes"),
                        (latin1, "not UTF-8 (byte offset 3)"),
                        (broken, "not a valid Jinja template: line 1")):
        with pytest.raises(ValueError, match="^" + re.escape(f"--chat-template {path}: {error}")):
            _config("--chat-template", str(path))
    with pytest.raises(ValueError, match=f"--chat-template: {MAX_CHAT_TEMPLATE_BYTES + 1} bytes"):
        EngineConfig.of(chat_template="x" * (MAX_CHAT_TEMPLATE_BYTES + 1)).check()


def test_pipeline_run_refuses_a_missing_template_file_before_starting(tmp_path):
    p = subprocess.run([*PIPELINE, "run", *ENGINE_FLAGS, "--chat-template", str(tmp_path / "none.jinja")],
                       input="", capture_output=True, text=True, timeout=120, cwd=ROOT, env=env())
    assert p.returncode != 0 and "--chat-template" in p.stderr and "cannot read it" in p.stderr, p.stderr


# ---- --max-queued-requests ----

def test_max_queued_requests_must_not_be_negative():
    with pytest.raises(ValueError, match="--max-queued-requests must be >= 0, got -1"):
        _config("--max-queued-requests", "-1")
    assert _config("--max-queued-requests", "3").scheduler_config.max_queued_requests == 3


def test_gateway_answers_queue_full_beyond_max_num_seqs_plus_the_queue(inst):
    answers: list = []
    gw = Gateway(EngineConfig.of(max_num_seqs=2, max_queued_requests=1), answers.append)
    ring = Ring.create(inst, "submit", capacity(MAX_REQUEST_BYTES), role="writer", claim=True)
    reader = Channel(Ring.attach(ring.name, "reader"), "submit")
    gw.rings = {"submit": Channel(ring, "submit")}
    gw.accepting = True
    try:
        def req(rid: str) -> GatewayRequest:
            return GatewayRequest(req_id=rid, sampling_params=SamplingParams(), prompt="hi")

        assert [gw.submit(req(f"r{i}")) for i in range(3)] == [True] * 3  # 2 running + 1 queued
        assert answers == []
        assert gw.submit(req("r3")) is False
        (full,) = answers
        assert isinstance(full, RequestResult) and full.id == "r3" and full.finish_reason == "error"
        assert full.error is not None and full.error.code == "queue_full"
        assert ("3 requests in flight, the limit is 3 (--max-num-seqs 2 + --max-queued-requests 1)"
                in full.error.message)
        assert gw.num_inflight() == 3
        gw._deliver(error_result("r0", "aborted", "done", finish_reason="abort"))  # one final
        assert gw.submit(req("r4")) is True  # room again
        assert [reader.recv(timeout=5).req_id for _ in range(4)] == ["r0", "r1", "r2", "r4"]
    finally:
        reader.close()
        ring.close()


def test_null_content_passes_the_wire_and_is_refused_by_the_tokenizer_naming_the_message():
    gen, sp = request_from_json('{"messages": [{"role": "user", "content": "hi"}, '
                                  '{"role": "user", "content": null}]}')
    req = gateway_request(gen, sp, "n")
    with pytest.raises(ValueError, match=r"field `messages\[1\]\.content`: must be a string or a list "
                                         r"of text parts, got NoneType"):
        Tokenizer(DEFAULT_MODEL).apply_chat_template(req.messages or [])
