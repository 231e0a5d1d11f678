"""The reasoning parsers by name (``--reasoning-parser``): ``deepseek_r1`` and ``qwen3``, the
two decisions of ``base.ReasoningParser`` each makes, and the lookup.

deepseek_r1 (DeepSeek-R1 and its distills, QwQ): the chat template ends the prompt with
``<think>\\n``, so the output is reasoning from its first character up to ``</think>`` and
content after it; an output that does write ``<think>`` first drops it; an output with no
``</think>`` (cut by ``max_tokens``) is all reasoning, content None. Streamed and whole agree
on every output.

qwen3 (Qwen3 with ``enable_thinking``, the default): the model writes ``<think>`` itself.
Whole (``extract``): the text before the first ``</think>``, less a leading ``<think>``, is
reasoning, the text after it content; with no ``</think>`` (``enable_thinking`` false: the
template put an empty think block in the prompt) everything is content, reasoning None.
Streamed (``feed``): as vLLM's, the first characters decide: an output that opens with
``<think>`` is reasoning until ``</think>``, one that does not is content, all of it, so the
stream never holds more than a partial tag. The two disagree on two kinds of output only:
- opened with ``<think>`` and never closed (the reasoning cut by ``max_tokens``): streamed as
  reasoning, whole as content (the tag dropped either way);
- not opened with ``<think>`` but with a ``</think>`` later (a template that put ``<think>`` in
  the prompt, as Qwen3's "Thinking-2507" ones do: use ``deepseek_r1`` for those): streamed as
  content, the tag included, whole as reasoning and content.
No other output differs (tests/reasoning: every split of every reference output).

State: none (the classes); each answer gets its own instance.
"""
from __future__ import annotations

from pipeline.reasoning.base import ReasoningParser


class DeepSeekR1ReasoningParser(ReasoningParser):
    name = "deepseek_r1"
    opens_in_reasoning = True
    unclosed_is_reasoning = True


class Qwen3ReasoningParser(ReasoningParser):
    name = "qwen3"
    opens_in_reasoning = False
    unclosed_is_reasoning = False


REASONING_PARSERS: dict[str, type[ReasoningParser]] = {
    cls.name: cls for cls in (DeepSeekR1ReasoningParser, Qwen3ReasoningParser)}


def get_reasoning_parser(name: str) -> type[ReasoningParser]:
    """The parser class named ``name`` (``--reasoning-parser``); ValueError naming the known
    ones otherwise. Instantiate it once per answer."""
    try:
        return REASONING_PARSERS[name]
    except KeyError:
        known = ", ".join(sorted(REASONING_PARSERS))
        raise ValueError(f"unknown reasoning parser {name!r}: known parsers are {known}") from None
