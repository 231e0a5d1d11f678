"""The speculative decoding proposers (pipeline/worker/spec): n-gram prompt lookup against a
brute-force reference, incremental vs fresh, re-sync after a shrink or a reused id; suffix
decoding within and across requests, its bounds (k, match length, min_token_prob), and the
global index's eviction bound and draft provenance (hypothesis)."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline.worker.spec.ngram import NgramProposer
from pipeline.worker.spec.proposer import make_proposer, ngram_window
from pipeline.worker.spec.suffix import SuffixProposer
from pipeline.worker.spec.suffix_index import ANCHORS


def _a(xs) -> np.ndarray:
    return np.asarray(xs, dtype=np.int32)


def _ngram_ref(seq: list[int], lo: int, hi: int, k: int) -> list[int]:
    """Prompt lookup by brute force: the latest earlier occurrence of the longest tail."""
    n_tok = len(seq)
    for n in range(min(hi, n_tok - 1), lo - 1, -1):
        tail = seq[n_tok - n:]
        for j in range(n_tok - n - 1, -1, -1):
            if seq[j:j + n] == tail:
                return seq[j + n:j + n + k]
    return []


def _occurs(needle: list[int], hay: list[int]) -> bool:
    return any(hay[i:i + len(needle)] == needle for i in range(len(hay) - len(needle) + 1))


# -- n-gram ---------------------------------------------------------------------------------

def test_ngram_latest_match_and_longer_pattern_first():
    p = NgramProposer(1, 3)
    # "1 2 3" is followed by 7 early; the 1-gram "3" is followed by 9 more recently.
    seq = [1, 2, 3, 7, 7, 5, 3, 9, 9, 1, 2, 3]
    assert p.propose("r", _a(seq), 2, 2) == [7, 7]
    q = NgramProposer(1, 1)
    assert q.propose("r", _a(seq), 2, 2) == [9, 9]  # the latest "3", not the first
    assert q.propose("s", _a([4, 3, 8, 3, 6, 3]), 1, 1) == [6]


def test_ngram_no_match_k_bound_and_short_tail():
    p = NgramProposer(2, 4)
    assert p.propose("a", _a([1, 2, 3, 4, 5]), 2, 5) == []
    assert p.propose("b", _a([1, 2, 3, 4, 5, 6, 1, 2]), 2, 3) == [3, 4, 5]
    assert p.propose("c", _a([1, 2, 3, 4, 5, 6, 1, 2]), 2, 0) == []
    # the continuation runs up to the sequence's end, no further
    assert p.propose("d", _a([5, 6, 5, 6]), 1, 8) == [5, 6]


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 3), min_size=1, max_size=120), st.integers(1, 3), st.integers(0, 2),
       st.integers(1, 6), st.randoms(use_true_random=False))
def test_ngram_incremental_equals_reference(seq, lo, extra, k, rnd):
    hi = lo + extra
    inc = NgramProposer(lo, hi)
    n = rnd.randint(1, len(seq))
    while True:  # grow by 1..k+1 tokens a call, as decode steps do
        got = inc.propose("r", _a(seq[:n]), 1, k)
        assert got == _ngram_ref(seq[:n], lo, hi, k) == NgramProposer(lo, hi).propose("x", _a(seq[:n]), 1, k)
        if n == len(seq):
            break
        n = min(len(seq), n + rnd.randint(1, k + 1))


def test_ngram_resyncs_after_shrink_and_reused_id():
    p = NgramProposer(1, 3)
    long = [1, 2, 3, 4, 1, 2, 3, 5, 1, 2, 3]
    assert p.propose("r", _a(long), 2, 2) == [5, 1]
    # preempted and recomputed shorter (or handed back truncated): the later "1 2 3 5" is gone
    assert p.propose("r", _a(long[:7]), 2, 2) == [4, 1]
    # the id reused by another request of the same length: nothing of the old index survives
    other = [9, 8, 7, 6, 9, 8, 7, 6, 0, 0, 7]
    assert p.propose("r", _a(other), 2, 2) == _ngram_ref(other, 1, 3, 2) == [6, 0]
    p.remove("r")
    assert len(p) == 0


def test_ngram_window_defaults_follow_vllm():
    assert ngram_window(None, None) == (5, 5)
    assert ngram_window(None, 4) == (4, 4) and ngram_window(2, None) == (2, 2)
    assert ngram_window(1, 3) == (1, 3)


def test_make_proposer_validates():
    kw = dict(num_speculative_tokens=4, prompt_lookup_min=1, prompt_lookup_max=3)
    assert isinstance(make_proposer("ngram", **kw), NgramProposer)
    sp = make_proposer("suffix", **kw, suffix_decoding_max_tree_depth=16, min_token_prob=0.2)
    assert isinstance(sp, SuffixProposer) and sp.depth == 16 and sp.min_token_prob == 0.2
    for bad in (lambda: make_proposer("eagle", **kw), lambda: make_proposer("ngram", **kw, foo=1),
                lambda: make_proposer("suffix", **kw, suffix_decoding_bogus=1),
                lambda: make_proposer("ngram", num_speculative_tokens=4, prompt_lookup_min=3, prompt_lookup_max=2)):
        with pytest.raises(ValueError):
            bad()


# -- suffix ---------------------------------------------------------------------------------

def test_suffix_learns_a_finished_requests_output():
    p = SuffixProposer(16)
    out = list(range(100, 140))
    p.finished("a", _a([1, 2, 3] + out), 3)
    p.remove("a")
    prompt = [7, 8, 9, 10]
    # matched 6 tokens: a draft of up to 6 (max_spec_factor 1.0), bounded by k
    assert p.propose("b", _a(prompt + out[:6]), 4, 16) == out[6:12]
    assert p.propose("b", _a(prompt + out[:20]), 4, 16) == out[20:36]
    assert p.propose("b", _a(prompt + out[:20]), 4, 3) == out[20:23]
    # an output that was never finished() is not learnt
    p.propose("c", _a([5] + list(range(300, 340))), 1, 4)
    p.remove("c")
    assert p.propose("d", _a([6] + list(range(300, 310))), 1, 4) == []


def test_suffix_within_a_request_and_remove():
    p = SuffixProposer(8)
    seq = [5, 6, 7, 8, 9, 5, 6, 7]
    assert p.propose("r", _a(seq), 2, 8) == [8, 9, 5]  # a 3-token match earns 3 tokens
    assert p.propose("r", _a(seq + [8, 9, 5, 6]), 2, 8) == [7, 8, 9, 5, 6]  # up to the known end
    assert p.stats()["local"] == 1
    p.remove("r")
    assert p.stats()["local"] == 0 and p.stats()["requests"] == 0
    # re-sync: a shrunk sequence drafts as a fresh proposer would
    q = SuffixProposer(8)
    q.propose("r", _a(seq + [8, 9, 5, 6]), 2, 8)
    assert q.propose("r", _a(seq), 2, 8) == SuffixProposer(8).propose("x", _a(seq), 2, 8)
    other = [9, 8, 7, 6, 5, 4, 9, 8]  # a reused id, same length: nothing of the old index survives
    assert q.propose("r", _a(other), 2, 8) == SuffixProposer(8).propose("x", _a(other), 2, 8) == [7, 6]


def test_suffix_most_frequent_branch_and_min_token_prob():
    p = SuffixProposer(8, min_token_prob=0.5)
    common = [11, 12, 13, 14, 15, 16]
    for i, tail in enumerate(([20, 21, 22], [20, 21, 22], [30, 31, 32])):
        p.finished(f"a{i}", _a([0] + common + tail), 1)
    # after "11..16": 20 two times in three (p=2/3), then certain
    assert p.propose("b", _a([9] + common), 1, 8) == [20, 21, 22]
    p.finished("a3", _a([0] + common + [30, 31, 32]), 1)
    p.finished("a4", _a([0] + common + [40, 41, 42]), 1)
    # now 2/5 for the best branch: below 0.5, nothing worth drafting past the match
    assert p.propose("c", _a([9] + common), 1, 8) == []


def test_suffix_evicts_oldest_outputs():
    p = SuffixProposer(8, max_cached_requests=2)
    outs = [list(range(100 * i, 100 * i + 20)) for i in range(1, 4)]
    for i, out in enumerate(outs):
        p.finished(f"a{i}", _a([0] + out), 1)
    assert p.stats()["requests"] == 2
    assert p.propose("b", _a([9] + outs[0][:8]), 1, 4) == []  # evicted
    assert p.propose("c", _a([9] + outs[2][:8]), 1, 4) == outs[2][8:12]
    q = SuffixProposer(8, max_cached_tokens=50)  # two outputs of 20 (+1 separator) fit
    for i, out in enumerate(outs):
        q.finished(f"a{i}", _a([0] + out), 1)
    assert q.stats()["requests"] == 2 and q.stats()["tokens"] == 42


@settings(max_examples=40, deadline=None)
@given(st.lists(st.lists(st.integers(0, 5), min_size=0, max_size=30), min_size=1, max_size=12),
       st.lists(st.integers(0, 5), min_size=1, max_size=30), st.integers(8, 64), st.integers(1, 4),
       st.integers(1, 8))
def test_suffix_bound_and_draft_provenance(outputs, seq, cap, max_reqs, k):
    p = SuffixProposer(8, max_tree_depth=6, max_cached_tokens=cap, max_cached_requests=max_reqs,
                       min_token_prob=0.0)
    live: list[list[int]] = []
    for i, out in enumerate(outputs):
        p.finished(f"a{i}", _a([9] + out), 1)
        out = out[:cap - 1]
        if out:  # the model of the index: FIFO, under both bounds
            live.append(out)
            while sum(len(o) + 1 for o in live) > cap or len(live) > max_reqs:
                live.pop(0)
        s = p.stats()
        assert s["requests"] == len(live) <= max_reqs and s["tokens"] <= cap
        assert s["tokens"] == sum(len(o) + 1 for o in live)
        assert s["positions"] == sum(max(0, len(o) - a) for o in live for a in ANCHORS)
        draft = p.propose("q", _a(seq), 0, k)
        assert len(draft) <= k
        if draft:  # the last token then the draft occurred, in the request or a live output
            assert any(_occurs(seq[-1:] + draft, h) for h in [seq] + live)
    p.remove("q")
    assert p.stats()["local"] == 0


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 4), min_size=1, max_size=120), st.lists(st.integers(0, 4), max_size=40),
       st.integers(1, 8), st.randoms(use_true_random=False))
def test_suffix_incremental_equals_fresh(seq, cached, k, rnd):
    """Grown a few tokens a call (the 4-gram chain every call, the 1-gram one only when a call
    falls back to it), a request drafts what a proposer seeing its whole sequence at once does."""
    inc, fresh = SuffixProposer(8, max_tree_depth=6), SuffixProposer(8, max_tree_depth=6)
    for p in (inc, fresh):
        p.finished("old", _a([9] + cached), 1)
    n = rnd.randint(1, len(seq))
    while True:
        assert inc.propose("r", _a(seq[:n]), 1, k) == fresh.propose(f"x{n}", _a(seq[:n]), 1, k)
        if n == len(seq):
            break
        n = min(len(seq), n + rnd.choice([1, 2, k + 1, 30]))
