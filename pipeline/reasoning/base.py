"""``ReasoningParser``: one answer's text split into its reasoning part (inside
``<think>...</think>``) and its content part, whole (``extract``) or as it streams (``feed``,
then ``finish``).

Both parsers we ship (``parsers``) mark the reasoning with the same two tags and differ in
what an output that does not open with ``<think>`` is (``opens_in_reasoning``) and what an
output that never closes it is (``unclosed_is_reasoning``, for ``extract``): DeepSeek-R1's
template already opened the tag in the prompt, so both are reasoning; Qwen3's model writes
the tag itself when it thinks, so both are content. The tags
are matched as text, not as token ids: the detokenizer's deltas may cut a tag anywhere
(``</th`` + ``ink>``), so ``feed`` holds back a tail that could still become a tag and lets it
go once the next delta (or ``finish``) shows it is not one.

Rules (both parsers, as vLLM's ``deepseek_r1`` and ``qwen3``):
- only a ``<think>`` at the very start of the output opens the reasoning, and is dropped;
- the first ``</think>`` closes it and is dropped; everything after it, a second tag
  included, is content, verbatim: no newline or space is stripped (vLLM strips none; Qwen3's
  content usually begins with ``"\\n\\n"``);
- ``extract`` gives None for a part that is empty once the tags are dropped; ``feed`` and
  ``finish`` give ``""`` for a part with nothing new.

State: one instance per answer (choice): the stream's phase and the held-back text.
Owns nothing else; imports nothing of ours.
"""
from __future__ import annotations

from typing import ClassVar

THINK_OPEN = "<think>"
THINK_CLOSE = "</think>"

# The stream's phases: before the first characters show whether the output opens with the
# tag, inside the reasoning, after it (content, passed through as it comes).
_UNDECIDED, _REASONING, _CONTENT = "undecided", "reasoning", "content"


def partial_tag_tail(text: str, tag: str) -> int:
    """Length of the longest end of ``text`` that is a proper beginning of ``tag``: what must
    be held back because the next delta may complete the tag."""
    for n in range(min(len(text), len(tag) - 1), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


class ReasoningParser:
    """The think-tag reasoning parser; subclasses name themselves and choose
    ``opens_in_reasoning`` (what an output without a leading ``<think>`` is) and
    ``unclosed_is_reasoning`` (what ``extract`` makes of an output with no ``</think>``)."""

    name: ClassVar[str]
    # Streaming and extract: an output not starting with <think> is reasoning (until
    # </think>) rather than content.
    opens_in_reasoning: ClassVar[bool]
    # extract: an output with no </think> at all is all reasoning rather than all content.
    unclosed_is_reasoning: ClassVar[bool]

    def __init__(self) -> None:
        # Both parsers start undecided (deepseek_r1 drops a leading <think> too): they differ
        # only in where an output without the tag goes (_decide).
        self._phase = _UNDECIDED
        self._held = ""

    # -- whole output ------------------------------------------------------------------

    def extract(self, text: str) -> tuple[str | None, str | None]:
        """(reasoning, content) of a finished output; None for an empty part."""
        body = text[len(THINK_OPEN):] if text.startswith(THINK_OPEN) else text
        reasoning, tag, content = body.partition(THINK_CLOSE)
        if not tag:  # never closed
            return (body or None, None) if self.unclosed_is_reasoning else (None, body or None)
        return reasoning or None, content or None

    # -- streaming -----------------------------------------------------------------------

    @property
    def in_reasoning(self) -> bool:
        """Whether the stream is still before its content part: inside the reasoning, or (a
        qwen3 parser) not yet past the characters that show whether ``<think>`` opens the
        output, when nothing has been given out yet. False once content may flow."""
        return self._phase != _CONTENT

    def feed(self, delta: str) -> tuple[str, str]:
        """The next piece of the output -> (reasoning delta, content delta); a piece that may
        be the beginning of a tag is held back until the next call or ``finish``."""
        if self._phase == _CONTENT:
            return "", delta
        text = self._held + delta
        self._held = ""
        if self._phase == _UNDECIDED:
            if len(text) < len(THINK_OPEN) and THINK_OPEN.startswith(text):
                self._held = text  # "", "<", "<th", ...: may still become the opening tag
                return "", ""
            text = self._decide(text)
            if self._phase == _CONTENT:
                return "", text
        return self._reasoning(text)

    def finish(self) -> tuple[str, str]:
        """The output ended: what was held back, as the part it turned out to be (a tag that
        never completed is plain text)."""
        held, self._held = self._held, ""
        if self._phase == _UNDECIDED:
            self._decide(held)  # "<thi" at the end: not the tag
        if self._phase == _CONTENT:
            return "", held
        return held, ""

    def _decide(self, text: str) -> str:
        """Leave the undecided phase on ``text`` (no longer a proper beginning of the tag):
        drop the opening tag if it is there; returns the text that is left."""
        if text.startswith(THINK_OPEN):
            self._phase = _REASONING
            return text[len(THINK_OPEN):]
        self._phase = _REASONING if self.opens_in_reasoning else _CONTENT
        return text

    def _reasoning(self, text: str) -> tuple[str, str]:
        """Inside the reasoning: up to the closing tag, holding back a possible beginning of it."""
        reasoning, tag, content = text.partition(THINK_CLOSE)
        if tag:
            self._phase = _CONTENT
            return reasoning, content
        keep = partial_tag_tail(text, THINK_CLOSE)
        if keep:
            self._held = text[-keep:]
            text = text[:-keep]
        return text, ""
