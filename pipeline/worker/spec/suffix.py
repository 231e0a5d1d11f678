"""Speculative decoding: the suffix proposer (suffix decoding, as vLLM's ``suffix`` method and
Arctic Inference do it, reimplemented). Two indexes answer "what followed this context before":
one over this request's own prompt and output, one over the outputs of recently finished
requests, so an agent loop that repeats earlier answers with small changes gets long drafts.

A call matches the longest suffix of the sequence (up to max_tree_depth tokens) in each index,
then extends greedily: at each step the most frequent next token among the matched occurrences
still agreeing with the draft, while the product of those empirical probabilities stays >=
min_token_prob; at most k tokens and at most max_spec_factor * match length (a long match earns
a long draft). The index whose draft has the larger expected accepted length (the sum of those
probabilities) wins.

Index layout (instead of a suffix tree): for an anchor of the last A tokens (A = 4, else 1),
the positions of the token that followed each occurrence, chained latest first (_Chains); the
longest match is found among the anchor's latest CANDIDATES occurrences (so frequencies are
those of recent history) by comparing backwards, vectorised. A token costs O(1) to index (a
tree costs O(depth)); a call a few numpy operations.

Owns: the per-request indexes, the global index (a ring of the cached outputs, separated by -1,
and its anchor chains), FIFO-evicted by finish order.
State: per request: as the n-gram proposer's, with its chains. Global: the ring (4 bytes *
max_cached_tokens), the live requests (start, length), the chains (8 bytes per anchor per ring
slot, and one dict entry, ~100 bytes, per distinct live anchor: at most 2 per cached token).
Bounded by max_cached_tokens (and max_cached_requests) whatever the traffic; measured at the
default 2**17 tokens: ~4 MiB when outputs repeat (an agent loop), ~28 MiB for random ones. A
per-request index (~170 bytes per token) lives until remove().
"""
from __future__ import annotations

from array import array
from collections import Counter, deque

import numpy as np

from pipeline.worker.spec.proposer import tail_hashes, window_hashes

ANCHORS = (4, 1)  # anchor lengths, longest first: a 4-gram's occurrences are few and specific
CANDIDATES = 64  # latest occurrences of the anchor compared per call


class _Chains:
    """Occurrences by anchor, as chains through positions: per anchor length, a dict from the
    anchor's hash to the latest position that followed it, and per position the previous one
    that followed the same anchor. Ints in dicts and arrays only: nothing for the garbage
    collector to traverse, however large the index (Python lists of positions made gen-2
    collections of a full global index take ~100 ms)."""
    __slots__ = ("last", "prev", "ring")

    def __init__(self, ring: int = 0) -> None:
        self.ring = ring  # > 0: positions are absolute, slot = position % ring
        self.last: list[dict[int, int]] = [{} for _ in ANCHORS]
        self.prev = [array("q", [-1]) * ring for _ in ANCHORS]

    def add(self, i: int, keys: list[int], first: int) -> None:
        """Anchor ANCHORS[i] with hash keys[j] was followed by the token at position first + j."""
        last, prev, ring = self.last[i], self.prev[i], self.ring
        if not ring and len(prev) < first + len(keys):
            prev.extend(array("q", [-1]) * (first + len(keys) - len(prev)))
        for p, h in enumerate(keys, first):
            prev[p % ring if ring else p] = last.get(h, -1)
            last[h] = p

    def recent(self, i: int, key: int, low: int) -> list[int]:
        """The latest CANDIDATES positions (>= low) that followed the anchor, latest first."""
        prev, ring = self.prev[i], self.ring
        out: list[int] = []
        p = self.last[i].get(key, -1)
        while p >= low and len(out) < CANDIDATES:
            out.append(p)
            p = prev[p % ring if ring else p]
        return out


class _Local:
    __slots__ = ("chains", "first", "n", "num_prompt", "tail")

    def __init__(self, num_prompt: int) -> None:
        self.n = 0
        self.num_prompt = num_prompt
        self.first = -1
        self.tail: list[int] = []
        self.chains = _Chains()


class SuffixProposer:
    def __init__(self, num_speculative_tokens: int, max_tree_depth: int = 24,
                 max_cached_requests: int = 10000, max_cached_tokens: int = 1 << 17,
                 max_spec_factor: float = 1.0, min_token_prob: float = 0.1) -> None:
        if max_tree_depth < 1 or max_cached_tokens < 2 or max_spec_factor <= 0:
            raise ValueError("need max_tree_depth >= 1, max_cached_tokens >= 2, max_spec_factor > 0")
        self.max_k = num_speculative_tokens  # the configured K; each call's k bounds its draft
        self.depth = max_tree_depth
        self.max_requests = max_cached_requests  # 0: no global index; < 0: bounded by tokens only
        self.factor = max_spec_factor
        self.min_token_prob = min_token_prob
        self._local: dict[str, _Local] = {}
        self._ring = np.full(max_cached_tokens, -1, dtype=np.int32)
        self._head = 0  # absolute positions: ring slot = position % len(ring)
        self._cached: deque[tuple[int, int]] = deque()  # live global requests: (start, length)
        self._chains = _Chains(max_cached_tokens)

    # -- the Proposer interface ---------------------------------------------------------------

    def propose(self, req_id: str, tokens: np.ndarray, num_prompt: int, k: int) -> list[int]:
        length = len(tokens)
        st = self._sync(req_id, tokens, num_prompt)
        if k <= 0 or length < 1:
            return []
        pat = np.full(self.depth, -2, dtype=np.int64)  # reversed tail; -2 matches nothing
        tail = tokens[max(0, length - self.depth):][::-1]
        pat[:len(tail)] = tail
        hashes = tail_hashes(tokens, length, max(ANCHORS))
        best, best_score = [], 0.0
        for chains, src, lo, hi in ((st.chains, tokens, 0, length),
                                    (self._chains, self._ring, self._low(), self._head)):
            draft, score = self._draft(chains, hashes, pat, k, src, lo, hi)
            if score > best_score:
                best, best_score = draft, score
        return best

    def remove(self, req_id: str) -> None:
        self._local.pop(req_id, None)

    def finished(self, req_id: str, tokens: np.ndarray, num_prompt: int) -> None:
        if self.max_requests == 0:
            return
        out = np.ascontiguousarray(tokens[num_prompt:], dtype=np.int32)[:len(self._ring) - 1]
        n = len(out)
        if n == 0:
            return
        while self._cached and (self._head + n + 1 - self._low() > len(self._ring)
                                or 0 < self.max_requests <= len(self._cached)):
            self._evict()
        start = self._head
        self._ring[np.arange(start, start + n + 1) % len(self._ring)] = np.append(out, -1)
        for i, a in enumerate(ANCHORS):
            # the anchor out[e-a+1 : e+1] was followed by out[e+1], at position start + e + 1
            self._chains.add(i, window_hashes(out, a, a - 1, n - 1), start + a)
        self._cached.append((start, n))
        self._head = start + n + 1

    def stats(self) -> dict[str, int]:
        """The global index's size: requests, ring tokens in use (separators included), anchor
        keys, live chained positions (walks every chain: for tests); live per-request indexes."""
        low, ch = self._low(), self._chains
        positions = 0
        for i, last in enumerate(ch.last):
            for p in last.values():
                while p >= low:
                    positions += 1
                    p = ch.prev[i][p % ch.ring]
        return {"requests": len(self._cached), "tokens": self._head - low, "positions": positions,
                "keys": sum(len(last) for last in ch.last), "local": len(self._local)}

    # -- matching and drafting ----------------------------------------------------------------

    def _draft(self, chains: _Chains, hashes: list[int], pat: np.ndarray, k: int,
               src: np.ndarray, lo: int, hi: int) -> tuple[list[int], float]:
        """The draft from one index: the latest occurrences of the longest anchor the tail has,
        narrowed to those matching the longest suffix, then extended greedily."""
        ring = chains.ring > 0
        for i, a in enumerate(ANCHORS):
            if len(hashes) < a or not (hits := chains.recent(i, hashes[a - 1], lo)):
                continue
            cand = np.array(hits, dtype=np.int64)  # positions that followed the anchor
            back = _gather(src, cand[:, None] - np.arange(1, self.depth + 1), lo, hi, ring)
            match = np.logical_and.accumulate(back == pat, axis=1).sum(axis=1)
            longest = int(match.max())
            if longest < a:  # a hash collision: this anchor never occurred
                continue
            limit = min(k, int(longest * self.factor + 1e-9))
            if limit <= 0:
                return [], 0.0
            rows = cand[match == longest]
            ahead = _gather(src, rows[:, None] + np.arange(limit), lo, hi, ring)
            # an occurrence ends at its first -1 (its output's end, or the sequence's)
            ahead[np.logical_or.accumulate(ahead < 0, axis=1)] = -1
            return self._extend(ahead)
        return [], 0.0

    def _extend(self, rows: np.ndarray) -> tuple[list[int], float]:
        """Follow the most frequent continuation of ``rows`` (one occurrence per row, -1 once
        it ended); returns (draft, expected accepted tokens = sum of path probabilities)."""
        draft: list[int] = []
        prob, score = 1.0, 0.0
        i, width = 0, rows.shape[1]
        while i < width:
            rows = rows[rows[:, i] >= 0]  # ended occurrences drop out of the distribution
            if len(rows) <= 1:  # one occurrence left: the rest of it, at the same probability
                rest = rows[0, i:].tolist() if len(rows) else []
                rest = rest[:rest.index(-1)] if -1 in rest else rest
                draft += rest
                score += prob * len(rest)
                break
            # the run all live occurrences agree on costs one comparison, not one per token
            same = (rows[:, i:] == rows[0, i:]).all(axis=0) & (rows[0, i:] >= 0)
            run = width - i if same.all() else int(np.argmin(same))
            if run:
                draft += rows[0, i:i + run].tolist()
                score += prob * run
                i += run
                continue
            col = rows[:, i]
            # rows are latest first, and most_common keeps first-seen order: ties go to recency
            tok, count = Counter(col.tolist()).most_common(1)[0]
            prob *= count / len(col)
            if prob < self.min_token_prob:
                break
            draft.append(tok)
            score += prob
            rows = rows[col == tok]
            i += 1
        return draft, score

    # -- index upkeep -------------------------------------------------------------------------

    def _sync(self, req_id: str, tokens: np.ndarray, num_prompt: int) -> _Local:
        length = len(tokens)
        st = self._local.get(req_id)
        if st is None or not _continues(st, tokens, num_prompt):
            st = self._local[req_id] = _Local(num_prompt)  # new, or shrunk/replaced: rebuild
        if length > st.n:
            for i, a in enumerate(ANCHORS):
                lo = max(st.n, a)  # continuation positions lo..length-1 are new
                st.chains.add(i, window_hashes(tokens, a, lo - 1, length - 1), lo)
            st.n = length
            st.first = int(tokens[0])
            st.tail = tokens[max(0, length - max(ANCHORS)):].tolist()
        return st

    def _low(self) -> int:
        return self._cached[0][0] if self._cached else self._head

    def _evict(self) -> None:
        start, n = self._cached.popleft()
        out = self._ring[np.arange(start, start + n) % len(self._ring)]
        low = self._low()
        for i, a in enumerate(ANCHORS):
            # chains stop below low by themselves; an anchor whose latest is gone goes too
            last = self._chains.last[i]
            for h in set(window_hashes(out, a, a - 1, n - 1)):
                if last.get(h, low) < low:
                    del last[h]


def _gather(src: np.ndarray, pos: np.ndarray, lo: int, hi: int, ring: bool) -> np.ndarray:
    """src at positions ``pos``, -1 outside [lo, hi); a ring maps a position to pos % len."""
    idx = pos % len(src) if ring else np.clip(pos, 0, len(src) - 1)
    return np.where((pos >= lo) & (pos < hi), src[idx], -1)


def _continues(st: _Local, tokens: np.ndarray, num_prompt: int) -> bool:
    n = st.n
    if len(tokens) < n or num_prompt != st.num_prompt:
        return False
    return n == 0 or (int(tokens[0]) == st.first and tokens[n - len(st.tail):n].tolist() == st.tail)
