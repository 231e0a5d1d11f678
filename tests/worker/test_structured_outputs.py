"""Structured outputs on the embedded default model (it babbles: only the grammar can make its
output valid), through the whole pipeline (`pipeline run`): every greedy and sampled output of
a set of JSON schemas parses and validates, regex outputs full-match, choice outputs are a
choice, EBNF outputs parse; free requests in a batch with constrained ones decode exactly what
they decode beside free ones; preempted constrained requests stay valid; two tensor-parallel
ranks give what one gives; a bad spec is a request error naming the field and the instance
keeps serving; pipe mode, in-process LLM and the grammar cache (structured_outputs.py)."""
from __future__ import annotations

import json
import math
import re

import jsonschema
import pytest
from e2e_helpers import run_pipe

from pipeline.config import DEFAULT_MODEL
from pipeline.sampling_params import SamplingParams
from pipeline.sampling_params.structured import StructuredOutputsParams

MODEL = DEFAULT_MODEL
PROMPTS = ["The for statement", "Name:", "In Python, a list", "{", "Answer:"]
SCHEMAS = {
    "nested": {"type": "object", "properties": {
        "user": {"type": "object", "properties": {
            "name": {"type": "string", "maxLength": 10},
            "age": {"type": "integer", "minimum": 0, "maximum": 99}}, "required": ["name", "age"]},
        "active": {"type": "boolean"}}, "required": ["user", "active"]},
    "array": {"type": "object", "properties": {
        "tags": {"type": "array", "items": {"type": "string", "enum": ["red", "green", "blue"]},
                 "minItems": 1, "maxItems": 3}}, "required": ["tags"]},
    "enum_range": {"type": "object", "properties": {
        "level": {"enum": ["low", "mid", "high"]},
        "score": {"type": "integer", "minimum": -5, "maximum": 5}}, "required": ["level", "score"]},
    "optional": {"type": "object", "properties": {
        "id": {"type": "integer", "minimum": 1, "maximum": 1000},
        "note": {"type": "string", "maxLength": 8}}, "required": ["id"]},
    "pattern": {"type": "object", "properties": {
        "code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{2}$"}}, "required": ["code"]},
}
REGEX = r"[a-z]{3,8}@[a-z]{2,6}\.(com|org)"
CHOICES = ["yes", "no", "it depends"]
# Bounded: a babbling model would otherwise grow an unbounded expression until max_tokens.
GRAMMAR = '''root ::= term (op term)?
term ::= num | "(" num op num ")"
op ::= "+" | "-" | "*"
num ::= [1-9] [0-9]?'''
GRAMMAR_RE = re.compile(r"(\d+|\(\d+[-+*]\d+\))([-+*](\d+|\(\d+[-+*]\d+\)))?")


def line(rid: str, prompt: str, so: dict, **sampling) -> str:
    return json.dumps({"id": rid, "prompt": prompt, "max_tokens": 160, "temperature": 0,
                       "structured_outputs": so, **sampling})


def constrained_lines() -> list[str]:
    out = []
    for name, schema in SCHEMAS.items():
        for i, prompt in enumerate(PROMPTS[:3]):
            sampled = {} if i == 0 else {"temperature": 0.9, "seed": 11 * i}
            out.append(line(f"json-{name}-{i}", prompt, {"json": schema}, **sampled))
    out.append(line("object-0", PROMPTS[3], {"json_object": True}))
    for i, prompt in enumerate(PROMPTS[:3]):
        sampled = {} if i == 0 else {"temperature": 1.0, "seed": i}
        out.append(line(f"regex-{i}", prompt, {"regex": REGEX}, **sampled))
        out.append(line(f"choice-{i}", prompt, {"choice": CHOICES}, **sampled))
        out.append(line(f"grammar-{i}", prompt, {"grammar": GRAMMAR}, **sampled))
    return out


def check(answer: dict) -> None:
    rid, text = answer["id"], answer["text"]
    if rid.startswith("object-"):
        # Any object: a babbling model may never close it, so check every token was the
        # grammar's, whether or not the object closed within max_tokens.
        from pipeline.structured_outputs import Grammars
        g = Grammars(MODEL, 2048, [1])
        m = g.matcher(g.compile(StructuredOutputsParams(json_object=True)))
        assert text.startswith("{") and all(m.accept_token(t) for t in answer["token_ids"]), answer
        if answer["finish_reason"] == "stop":
            assert isinstance(json.loads(text), dict)
        return
    assert answer["error"] is None and answer["finish_reason"] == "stop", answer
    if rid.startswith("json-"):
        jsonschema.validate(json.loads(text), SCHEMAS[rid.split("-")[1]])
    elif rid.startswith("regex-"):
        assert re.fullmatch(REGEX, text), text
    elif rid.startswith("choice-"):
        assert text in CHOICES
    elif rid.startswith("grammar-"):
        assert GRAMMAR_RE.fullmatch(text), text


def test_every_constrained_output_is_valid_in_a_mixed_batch_with_logprobs():
    lines = constrained_lines()
    free = [json.dumps({"id": f"free-{i}", "prompt": p, "max_tokens": 24, "temperature": 0})
            for i, p in enumerate(PROMPTS)]
    rc, answers, err = run_pipe(MODEL, lines[:4] + free + lines[4:] + [
        line("lp", PROMPTS[0], {"choice": CHOICES}, logprobs=3)])
    assert rc == 0, err[-2000:]
    by_id = {a["id"]: a for a in answers}
    assert len(by_id) == len(lines) + len(free) + 1
    for a in answers:
        if a["id"].startswith(("json", "object", "regex", "choice", "grammar")):
            check(a)
    # The free requests are free: the model's babble, not JSON or a choice.
    assert not any(by_id[f"free-{i}"]["text"] in CHOICES for i in range(len(PROMPTS)))
    # Logprobs are of the masked distribution: masked tokens are -inf (null in JSON), and once
    # the choice is complete the stop token is the only one left, with probability 1.
    lp = by_id["lp"]
    assert lp["text"] in CHOICES
    for token_id, logprob, top_ids, top_vals in lp["logprobs"]:
        assert logprob is not None and logprob <= 0.0 and token_id in top_ids
        finite = [v for v in top_vals if v is not None]
        assert sum(math.exp(v) for v in finite) <= 1.0 + 1e-5
    assert lp["logprobs"][-1][0] == 1 and lp["logprobs"][-1][1] == 0.0
    assert lp["logprobs"][-1][3][1:] == [None, None]


def test_free_requests_decode_the_same_beside_constrained_ones():
    """Same batch shapes (ignore_eos keeps every request to max_tokens): the free rows'
    floats cannot depend on what the constrained rows sample."""
    def run(constrain: bool) -> dict:
        lines = [json.dumps({"id": f"free-{i}", "prompt": p, "max_tokens": 40, "temperature": 0,
                             "ignore_eos": True}) for i, p in enumerate(PROMPTS)]
        lines += [json.dumps({"id": f"other-{i}", "prompt": p, "max_tokens": 40, "temperature": 0,
                              "ignore_eos": True,
                              **({"structured_outputs": {"json": SCHEMAS["enum_range"]}} if constrain else {})})
                  for i, p in enumerate(PROMPTS)]
        rc, answers, err = run_pipe(MODEL, lines, "--max-num-seqs", "16")
        assert rc == 0, err[-2000:]
        return {a["id"]: a["token_ids"] for a in answers}
    mixed, plain = run(True), run(False)
    for i in range(len(PROMPTS)):
        assert mixed[f"free-{i}"] == plain[f"free-{i}"]
    assert any(mixed[f"other-{i}"] != plain[f"other-{i}"] for i in range(len(PROMPTS)))


def test_preempted_constrained_requests_stay_valid(tmp_path):
    stats = tmp_path / "stats.json"
    lines = [line(f"json-nested-{i}", PROMPTS[i % 5], {"json": SCHEMAS["nested"]},
                  temperature=0.8, seed=i) for i in range(10)]
    rc, answers, err = run_pipe(MODEL, lines, "--num-blocks", "24", "--stats-json", str(stats))
    assert rc == 0, err[-2000:]
    assert json.loads(stats.read_text())["num_preemptions"] > 0
    assert len(answers) == 10
    for a in answers:
        check(a)


def test_two_ranks_constrain_like_one():
    lines = [line(f"json-enum_range-{i}", p, {"json": SCHEMAS["enum_range"]}) for i, p in enumerate(PROMPTS)]
    lines += [line(f"regex-{i}", p, {"regex": REGEX}, temperature=0.9, seed=i) for i, p in enumerate(PROMPTS)]
    got = {}
    for tp in ("1", "2"):
        rc, answers, err = run_pipe(MODEL, lines, "--tensor-parallel-size", tp, "--worker-threads", "1")
        assert rc == 0, err[-2000:]
        for a in answers:
            check(a)
        got[tp] = {a["id"]: a["token_ids"] for a in answers}
    assert got["1"] == got["2"]


@pytest.mark.parametrize("so, names", [
    ({"json": {"type": "objekt"}}, "structured_outputs.json: not a valid JSON schema"),
    ({"json": "{not json"}, "structured_outputs.json: not a valid JSON schema"),
    ({"regex": "[a-"}, "structured_outputs.regex: not a valid regex"),
    ({"grammar": "root ::= undefined_rule"}, "structured_outputs.grammar: not a valid EBNF grammar"),
    ({"regex": "a", "choice": ["a"]}, "structured_outputs must be exactly one of"),
    ({"choice": []}, "structured_outputs.choice must be a non-empty list"),
    ({"regex": "a" * (65 << 10)}, "structured_outputs.regex must be at most 65536 UTF-8 bytes"),
])
def test_a_bad_spec_is_a_request_error_naming_the_field(so, names):
    rc, answers, err = run_pipe(MODEL, [line("bad", "x", so), line("choice-0", "x", {"choice": CHOICES})])
    assert rc == 1, err[-2000:]  # pipe mode: 1 when a line failed
    by_id = {a["id"]: a for a in answers}
    assert by_id["bad"]["error"]["code"] == "invalid_request"
    assert names in by_id["bad"]["error"]["message"], by_id["bad"]["error"]
    check(by_id["choice-0"])  # the instance kept serving


def test_in_process_llm_constrains_and_refuses_bad_specs():
    from pipeline import LLM

    with LLM(MODEL, device="cpu", dtype="float32", max_model_len=256, num_blocks=64) as llm:
        out = llm.generate(["Name:"], SamplingParams(max_tokens=100, temperature=0, structured_outputs=
                                                     StructuredOutputsParams(json=SCHEMAS["optional"])))
        jsonschema.validate(json.loads(out[0].outputs[0].text), SCHEMAS["optional"])
        with pytest.raises(ValueError, match="structured_outputs.regex: not a valid regex"):
            llm.generate(["x"], SamplingParams(structured_outputs=StructuredOutputsParams(regex="(")))


def test_grammar_specs_are_canonical_and_choices_escaped():
    from tokenizers import Tokenizer

    from pipeline.structured_outputs import Grammars

    # Key order does not make a new spec (the cache is keyed by spec_text).
    a = StructuredOutputsParams(json={"type": "object", "properties": {"b": {"type": "integer"}, "a": {}}})
    b = StructuredOutputsParams(json={"properties": {"a": {}, "b": {"type": "integer"}}, "type": "object"})
    assert a.spec_text() == b.spec_text()
    # Quotes and backslashes in choices are literal text, not grammar syntax.
    g = Grammars(MODEL, 2048, [1])
    tok = Tokenizer.from_file(f"{MODEL}/tokenizer.json")
    choices = ['say "hi"', "a\\b"]
    for text in choices:
        m = g.matcher(g.compile(StructuredOutputsParams(choice=choices)))
        assert all(m.accept_token(t) for t in tok.encode(text, add_special_tokens=False).ids)
        assert m.accept_token(1) and m.is_terminated()  # then only the stop token
    m = g.matcher(g.compile(StructuredOutputsParams(choice=choices)))
    assert not all(m.accept_token(t) for t in tok.encode('say \\"hi', add_special_tokens=False).ids)


def test_a_schema_nested_past_the_limit_is_refused_before_it_compiles():
    from pipeline.sampling_params.structured import MAX_SCHEMA_DEPTH

    def nested(n: int) -> dict:
        s: dict = {"type": "string"}
        for _ in range(n):
            s = {"type": "object", "properties": {"a": s}}
        return s
    StructuredOutputsParams(json=nested(MAX_SCHEMA_DEPTH // 2 - 1))  # 63 levels: allowed
    for too_deep in (nested(MAX_SCHEMA_DEPTH // 2), json.dumps(nested(400)), "[" * 5000 + "]" * 5000):
        with pytest.raises(ValueError, match=f"structured_outputs.json must be nested at most "
                                             f"{MAX_SCHEMA_DEPTH} levels deep"):
            StructuredOutputsParams(json=too_deep)
