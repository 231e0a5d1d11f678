"""The streaming property of the tool-call parsers, shared by their tests: a stream of deltas,
reassembled, equals ``extract`` of the whole text, for any split of the text; and the stream
is well formed OpenAI (each call's first delta has its id and name, later ones neither; calls
in index order; a call's fragments only while it is the latest)."""
from __future__ import annotations

import re
from collections.abc import Callable, Iterable

from hypothesis import strategies as st

from pipeline.tool_parsers.base import ExtractedToolCalls, StreamDelta, ToolParser

Factory = Callable[[], ToolParser]


def assemble(deltas: Iterable[StreamDelta], id_re: str = r"call_[A-Za-z0-9]{24}") -> tuple[str, list[tuple[str, str]]]:
    """(content, [(name, arguments)]) of a stream, checking its form on the way."""
    content = ""
    calls: list[list[str]] = []
    ids: list[str] = []
    for d in deltas:
        content += d.content
        for t in d.tool_calls:
            if t.index == len(calls):  # a new call: its first delta
                assert t.id is not None and t.name, t
                assert re.fullmatch(id_re, t.id), t.id
                ids.append(t.id)
                calls.append([t.name, t.arguments])
            else:
                assert t.index == len(calls) - 1, (t, len(calls))  # only the latest call grows
                assert t.id is None and t.name is None, t  # id and name once per call
                assert t.arguments, t  # no empty items
                calls[-1][1] += t.arguments
    assert len(set(ids)) == len(ids)
    return content, [(n, a) for n, a in calls]


def stream(factory: Factory, pieces: Iterable[str], id_re: str = r"call_[A-Za-z0-9]{24}"):
    p = factory()
    deltas = [p.feed(x) for x in pieces] + [p.finish()]
    content, calls = assemble(deltas, id_re)
    assert p.called == bool(calls)
    return content, calls


def flat(e: ExtractedToolCalls) -> tuple[str, list[tuple[str, str]]]:
    assert e.content is None or e.content.strip(), e.content
    return e.content or "", [(c.name, c.arguments) for c in e.calls]


def split_at(text: str, cuts: Iterable[int]) -> list[str]:
    cuts = sorted(set(cuts))
    bounds = [0, *cuts, len(text)]
    return [text[a:b] for a, b in zip(bounds, bounds[1:])]


def check_every_split(factory: Factory, text: str, id_re: str = r"call_[A-Za-z0-9]{24}") -> None:
    """Two pieces split at every position, and one character per delta."""
    want = flat(factory().extract(text))
    for i in range(len(text) + 1):
        assert stream(factory, [text[:i], text[i:]], id_re) == want, (i, text[:i], text[i:])
    assert stream(factory, list(text), id_re) == want


def cuts_for(text: str) -> st.SearchStrategy[list[int]]:
    return st.lists(st.integers(0, len(text)), max_size=max(1, len(text)))


def check_split(factory: Factory, text: str, cuts: list[int], id_re: str = r"call_[A-Za-z0-9]{24}") -> None:
    want = flat(factory().extract(text))
    assert stream(factory, split_at(text, cuts), id_re) == want


# Text from the pieces of every format, for fuzzing: whatever it is, the stream must agree
# with extract (the pieces make near-misses likely: partial tags, broken JSON, stray braces).
FUZZ_PIECES = ["<tool_call>", "</tool_call>", "<tool_", "[TOOL_CALLS]", "[ARGS]", "[TOOL", "<|python_tag|>",
               "{", "}", "[", "]", "(", ")", '"name"', '"arguments"', '"parameters"', ": ", ", ", ",", ";",
               '"f"', '"g h"', '"\\""', '"é✓"', "f", "g_1", "=", "1", "null", "true", "'x'", "'''", '"',
               " ", "\n", "\\", "x", "Hi."]
fuzz_text = st.lists(st.sampled_from(FUZZ_PIECES), max_size=24).map("".join)
