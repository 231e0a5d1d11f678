"""Issue 28: a reasoning model's structured answer — the grammar starts after ``</think>``
(``StructuredOutputsParams.reasoning_end``), unless the prompt already closed the reasoning
(a template with thinking off), for the OpenAI front end's response_format and forced tool
choices."""
from __future__ import annotations

import json
import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline import LLM, SamplingParams
from pipeline.config import DEFAULT_MODEL
from pipeline.sampling_params.structured import StructuredOutputsParams
from pipeline.structured_outputs import Grammars, text_until

MARK = "</think>"
SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
          "additionalProperties": False}


@settings(max_examples=400, deadline=None)
@given(st.text(alphabet=st.sampled_from(list("</think>x \n")), max_size=24))
def test_the_free_part_ends_at_the_first_marker(text):
    """text_until matches exactly: no marker before the end, then the marker, then blanks."""
    at = text.find(MARK)
    want = at >= 0 and text[at + len(MARK):].strip() == ""
    assert (re.fullmatch(text_until(MARK), text) is not None) == want


def accepts(so: StructuredOutputsParams, text: str) -> bool:
    g = Grammars(DEFAULT_MODEL, 2048, [1])
    m = g.matcher(g.compile(so))
    return m.accept_string(text) and m.is_completed()


def test_the_grammar_waits_for_the_end_of_the_reasoning():
    deferred = StructuredOutputsParams(json=SCHEMA, reasoning_end=MARK)
    assert accepts(deferred, '<think>\nis it? a < b </th and {"x"\n</think>\n\n{"ok": true}')
    assert accepts(deferred, '</think>{"ok": false}')
    assert not accepts(deferred, '{"ok": true}')  # the reasoning must end first
    assert not accepts(deferred, '<think>hm</think> and then prose')  # then the grammar holds
    plain = StructuredOutputsParams(json=SCHEMA)
    assert accepts(plain, '{"ok": true}') and not accepts(plain, '</think>{"ok": true}')
    with pytest.raises(ValueError, match="reasoning_end"):
        StructuredOutputsParams(json=SCHEMA, reasoning_end="")


def test_a_prompt_that_closed_the_reasoning_starts_the_grammar_at_once():
    so = StructuredOutputsParams(json=SCHEMA, reasoning_end=MARK)
    assert so.after_prompt("<|im_start|>assistant\n<think>\n\n</think>\n\n").reasoning_end is None
    assert so.after_prompt("<|im_start|>assistant\n").reasoning_end == MARK
    assert so.after_prompt("assistant\n<think>\n").reasoning_end == MARK  # deepseek_r1's template
    # End to end (in-process): the prompt continues an assistant turn whose thinking is closed,
    # as Qwen3's template writes it with enable_thinking false: the answer is the JSON at once.
    with LLM(DEFAULT_MODEL, reasoning_parser="qwen3") as llm:
        turn = [{"role": "user", "content": "ok?"}, {"role": "assistant", "content": "<think>\n\n</think>\n\n"}]
        (out,) = llm.chat(turn, SamplingParams(max_tokens=32, temperature=0, structured_outputs=so),
                          add_generation_prompt=False, continue_final_message=True)
        assert out.outputs[0].finish_reason == "stop" and json.loads(out.outputs[0].text)["ok"] in (True, False)
