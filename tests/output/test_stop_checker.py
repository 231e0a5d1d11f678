"""Stop strings: found across arbitrary delta splits, never streamed, result independent of
the split, held-back text released when no stop string can start there."""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline.output.stop_checker import StopChecker

ALPHA = "ab c\n😀"


def reference(text: str, stops: list[str], include: bool) -> tuple[str, str | None]:
    """Whole-text answer: the stop string that completes first (ties: the longer)."""
    best = None
    for s in stops:
        i = text.find(s)
        if i >= 0:
            key = (i + len(s), -len(s))
            if best is None or key < best[0]:
                best = (key, i, s)
    if best is None:
        return text, None
    _, i, s = best
    return text[: i + len(s)] if include else text[:i], s


def run(chunks: list[str], stops: list[str], include: bool) -> tuple[list[str], str | None]:
    sc = StopChecker(stops, include)
    sent: list[str] = []
    for c in chunks:
        out, hit = sc.feed(c)
        sent.append(out)
        # Nothing streamed so far may end with the beginning of a stop string that could
        # still complete, unless it is the stop string itself (include=True).
        if hit is not None:
            return sent, hit
        assert len(sc.held) < max(map(len, stops))
    sent.append(sc.flush())
    return sent, None


@settings(max_examples=300, deadline=None)
@given(text=st.text(alphabet=ALPHA, max_size=40),
       stops=st.lists(st.text(alphabet=ALPHA, min_size=1, max_size=5), min_size=1, max_size=4),
       cuts=st.lists(st.integers(0, 40), max_size=12), include=st.booleans())
def test_any_split_matches_whole_text(text, stops, cuts, include):
    bounds = sorted({0, len(text), *[c for c in cuts if c <= len(text)]})
    chunks = [text[a:b] for a, b in zip(bounds, bounds[1:])]
    sent, hit = run(chunks, stops, include)
    assert ("".join(sent), hit) == reference(text, stops, include)


@settings(max_examples=200, deadline=None)
@given(text=st.text(alphabet=ALPHA, max_size=30),
       stops=st.lists(st.text(alphabet=ALPHA, min_size=1, max_size=4), min_size=1, max_size=3))
def test_stop_string_never_streamed_char_by_char(text, stops):
    sc = StopChecker(stops)
    streamed = ""
    for ch in text:
        out, hit = sc.feed(ch)
        streamed += out
        for s in stops:
            assert s not in streamed
        if hit:
            break


def test_split_across_tokens_is_held_then_released():
    sc = StopChecker(["</answer>"])
    assert sc.feed("The result</an") == ("The result", None)
    assert sc.held == "</an"
    assert sc.feed("swer> trailing") == ("", "</answer>")


def test_false_alarm_released():
    sc = StopChecker(["STOP"])
    assert sc.feed("ST") == ("", None)
    assert sc.feed("ART") == ("START", None)
    assert sc.feed("ST") == ("", None)
    assert sc.flush() == "ST"


def test_include_stop_str():
    sc = StopChecker(["\n\n"], include_stop_str_in_output=True)
    assert sc.feed("a\n") == ("a", None)
    assert sc.feed("\nb") == ("a\n\n"[1:], "\n\n")


def test_min_tokens_disables_matching():
    sc = StopChecker(["x"])
    assert sc.feed("axb", check=False) == ("axb", None)
    assert sc.feed("cx", check=True) == ("c", "x")
    with pytest.raises(RuntimeError):
        sc.feed("more")


def test_no_stops_passthrough():
    sc = StopChecker([])
    assert sc.feed("anything") == ("anything", None)
    assert sc.flush() == ""
