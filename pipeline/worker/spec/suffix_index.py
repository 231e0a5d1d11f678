"""Speculative decoding, the suffix proposer's index (worker/spec/suffix.py).

Index layout (instead of a suffix tree): for an anchor of the last A tokens (A = 4, else 1),
the positions of the token that followed each occurrence, chained latest first (Chains); the
longest match is found among the anchor's latest CANDIDATES occurrences (so frequencies are
those of recent history). A token costs O(1) to index (a tree costs O(depth)).

Owns nothing itself: ``Chains`` (an index's anchor chains) and ``Local`` (one request's
tokens and chains) are owned by the SuffixProposer that makes them.
"""
from __future__ import annotations

from array import array
from itertools import chain

import numpy as np

ANCHORS = (4, 1)  # anchor lengths, longest first: a 4-gram's occurrences are few and specific
CANDIDATES = 64  # latest occurrences of the anchor compared per call


def pack(w: array | list[int]) -> int:
    """An anchor's key: its tokens (each < 2**31) packed 32 bits apiece, exact, as Chains.add
    rolls it; an int (36-44 bytes), like the 64-bit hash it replaced, not a GC-tracked tuple."""
    key = 0
    for t in w:
        key = (key << 32) | t
    return key


def _slots(lo: int, end: int, ring: int) -> range | chain[int]:
    """The slots of positions lo..end-1 (fewer than ``ring`` of them); ring 0: the positions."""
    if not ring:
        return range(lo, end)
    s = lo % ring
    if s + end - lo <= ring:
        return range(s, s + end - lo)
    return chain(range(s, ring), range(0, s + end - lo - ring))


class Chains:
    """Occurrences by anchor, as chains through positions: per anchor length, a dict from the
    anchor's key to the latest position that followed it, and per position the previous one
    that followed the same anchor. Ints in dicts and arrays only: nothing for the garbage
    collector to traverse, however large the index (Python lists of positions made gen-2
    collections of a full global index take ~100 ms)."""
    __slots__ = ("last", "prev", "ring")

    def __init__(self, ring: int = 0) -> None:
        self.ring = ring  # > 0: positions are absolute, slot = position % ring
        self.last: list[dict[int, int]] = [{} for _ in ANCHORS]
        self.prev = [array("q", [-1]) * ring for _ in ANCHORS]

    def add(self, i: int, vals: list[int], pos: int, start: int, lo: int) -> None:
        """Chain anchor ANCHORS[i]'s continuation positions lo..pos+len(vals) of one sequence
        that begins at position ``start``; vals: its tokens at positions pos.. but for the
        last, pos <= max(start, lo - ANCHORS[i]) (the anchor before lo is in them). A token
        costs a few interpreter steps: one shift to roll the key, a get and two stores."""
        a, ring = ANCHORS[i], self.ring
        end = pos + len(vals) + 1  # continuation positions below end
        lo = max(lo, start + a)  # a continuation needs a whole anchor before it
        if end <= lo:
            return
        last, prev = self.last[i], self.prev[i]
        if not ring and len(prev) < end:
            prev.extend(array("q", [-1]) * (end - len(prev)))
        get = last.get
        ahead = zip(_slots(lo, end, ring), range(lo, end), vals[lo - 1 - pos:])
        if a == 1:  # the key is the token
            for s, p, t in ahead:
                prev[s] = get(t, -1)
                last[t] = p
            return
        key, mask = pack(vals[lo - a - pos:lo - 1 - pos]), (1 << 32 * a) - 1
        for s, p, t in ahead:
            key = ((key << 32) | t) & mask
            prev[s] = get(key, -1)
            last[key] = p


class Local:
    """One request's index: its tokens (position -> token) and their chains. Only the longest
    anchor's chain is kept up to date on every call; a shorter one catches up when a call falls
    back to it (``upto``: its continuation positions below this are chained), so a request
    whose 4-gram anchors keep hitting never pays for its 1-gram chain."""
    __slots__ = ("chains", "num_prompt", "toks", "upto")

    def __init__(self, num_prompt: int) -> None:
        self.num_prompt = num_prompt
        self.toks = array("i")
        self.upto = [0] * len(ANCHORS)
        self.chains = Chains()

    def index(self, i: int) -> None:
        lo, end = self.upto[i], len(self.toks)
        if end > lo:
            pos = max(0, lo - ANCHORS[i])
            self.chains.add(i, self.toks[pos:end - 1].tolist(), pos, 0, lo)
            self.upto[i] = end


def continues(st: Local, tokens: np.ndarray, num_prompt: int) -> bool:
    n = len(st.toks)
    if len(tokens) < n or num_prompt != st.num_prompt:
        return False
    lo = max(0, n - max(ANCHORS))
    return n == 0 or (int(tokens[0]) == st.toks[0]
                      and tokens[lo:n].tolist() == st.toks[lo:n].tolist())
