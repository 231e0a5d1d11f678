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

The index: worker/spec/suffix_index.py.

Cost per call (it runs once per request per decode step, on the step's critical path): plain
Python over array('i') token stores, no numpy -- numpy's ~1 us per operation on arrays of a few
dozen tokens was most of the old cost. Anchors are keyed exactly (a token; four tokens packed in
128 bits), rolled by one shift per token. The longest match costs one C-level slice comparison
per candidate (is it at least as long as the best so far?) plus token steps that sum to at most
the depth over all candidates; the draft is then built over a handful of short rows. A
request's 1-gram chain is caught up only when a call falls back to it, and the global index is
not walked when the request's own draft already scores the most a draft could.

Owns: the per-request indexes, the global index (a ring of the cached outputs, separated by -1,
and its anchor chains), FIFO-evicted by finish order.
State: per request: its tokens (4 bytes each) and its chains. Global: the ring (4 bytes *
max_cached_tokens), the live requests (start, length), the chains (8 bytes per anchor per ring
slot, and one dict entry, ~110 bytes, per distinct live anchor: at most 2 per cached token).
Bounded by max_cached_tokens (and max_cached_requests) whatever the traffic; measured at the
default 2**17 tokens: ~4 MiB when outputs repeat (an agent loop), ~25-30 MiB for random ones. A
per-request index (~210 bytes per token with both chains) lives until remove().
"""
from __future__ import annotations

from array import array
from collections import deque

import numpy as np

from pipeline.worker.spec.suffix_index import ANCHORS, CANDIDATES, Chains, Local, continues, pack


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
        self._local: dict[str, Local] = {}
        self._ring = array("i", [-1]) * max_cached_tokens
        self._head = 0  # absolute positions: ring slot = position % len(ring)
        self._cached: deque[tuple[int, int]] = deque()  # live global requests: (start, length)
        self._chains = Chains(max_cached_tokens)

    # -- the Proposer interface ---------------------------------------------------------------

    def propose(self, req_id: str, tokens: np.ndarray, num_prompt: int, k: int) -> list[int]:
        length = len(tokens)
        st = self._sync(req_id, tokens, num_prompt)
        if k <= 0 or length < 1:
            return []
        d = min(self.depth, length)  # no match is longer than the sequence
        tail = st.toks[length - d:]
        # an anchor longer than d never counts: its matches would be capped below its length
        keys = [pack(tail[-a:]) if d >= a else -1 for a in ANCHORS]
        draft, score = self._draft(st.chains, st.toks, 0, tail, keys, k, st)
        # the global draft wins only with a larger score, and a score is at most its draft's
        # length: when the request's own draft has the most any could, skip the global walk
        if self._cached and score < min(k, int(d * self.factor + 1e-9)):
            other, s = self._draft(self._chains, self._ring, self._low(), tail, keys, k, None)
            if s > score:
                return other
        return draft if score > 0 else []

    def remove(self, req_id: str) -> None:
        self._local.pop(req_id, None)

    def finished(self, req_id: str, tokens: np.ndarray, num_prompt: int) -> None:
        if self.max_requests == 0:
            return
        ring = self._ring
        out = tokens[num_prompt:][:len(ring) - 1].tolist()
        n = len(out)
        if n == 0:
            return
        while self._cached and (self._head + n + 1 - self._low() > len(ring)
                                or 0 < self.max_requests <= len(self._cached)):
            self._evict()
        start = self._head
        self._write(start, out + [-1])
        for i in range(len(ANCHORS)):
            self._chains.add(i, out[:-1], start, start, start)
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

    def _draft(self, chains: Chains, src: array, lo: int, tail: array, keys: list[int], k: int,
               local: Local | None) -> tuple[list[int], float]:
        """The draft from one index (src: its tokens by position, or by ring slot): the latest
        occurrences of the longest anchor the tail has, narrowed to those matching the longest
        suffix, then extended greedily."""
        ring, d = chains.ring, len(tail)
        for i, a in enumerate(ANCHORS):
            if keys[i] < 0:
                continue
            if local is not None:
                local.index(i)
            p, prev = chains.last[i].get(keys[i], -1), chains.prev[i]
            # The longest match among the candidates and those that have it, latest first: a
            # candidate shorter than the best so far fails one C-level slice comparison, and
            # the token steps past it sum to at most d over all candidates.
            best, rows, want = 0, [], tail[d:]
            for _ in range(CANDIDATES):
                if p < lo:
                    break
                s = p % ring if ring else p
                cap = p - lo  # the tokens before p: positions below lo match nothing
                if cap > d:
                    cap = d
                if cap >= best and (not best or want == (src[s - best:s] if s >= best else
                                                         src[s - best:] + src[:s])):
                    n = best  # at least as long: count on (a ring slot below 0 wraps to its end)
                    while n < cap and src[s - 1 - n] == tail[d - 1 - n]:
                        n += 1
                    if n > best:
                        best, rows, want = n, [p], tail[d - n:]
                    elif n:
                        rows.append(p)
                p = prev[s]
            if best < a:  # no occurrence (or, at the ring's low edge, too short to count)
                continue
            limit = min(k, int(best * self.factor + 1e-9))
            if limit <= 0:
                return [], 0.0
            ahead = []
            for p in rows:
                s = p % ring if ring else p
                seq = (src[s:s + limit] if not ring or s + limit <= ring
                       else src[s:] + src[:s + limit - ring]).tolist()
                if ring and -1 in seq:  # an occurrence ends with its output
                    seq = seq[:seq.index(-1)]
                ahead.append(seq)
            return self._extend(ahead, limit)
        return [], 0.0

    def _extend(self, rows: list[list[int]], width: int) -> tuple[list[int], float]:
        """Follow the most frequent continuation of ``rows`` (one occurrence each, latest
        first, shorter once it ended); returns (draft, expected accepted tokens = sum of path
        probabilities)."""
        draft: list[int] = []
        prob, score = 1.0, 0.0
        i = 0
        while i < width:
            rows = [r for r in rows if len(r) > i]  # ended occurrences drop out
            if len(rows) <= 1:  # one occurrence left: the rest of it, at the same probability
                rest = rows[0][i:] if rows else []
                draft += rest
                score += prob * len(rest)
                break
            # the run all live occurrences agree on: added at the current probability
            first, end = rows[0], len(rows[0])
            for r in rows[1:]:
                end = min(end, len(r))
                j = i
                while j < end and r[j] == first[j]:
                    j += 1
                end = j
                if end == i:
                    break
            if end > i:
                draft += first[i:end]
                score += prob * (end - i)
                i = end
                continue
            counts: dict[int, int] = {}
            for r in rows:
                counts[r[i]] = counts.get(r[i], 0) + 1
            # rows are latest first and max keeps the first of equals: ties go to recency
            tok = max(counts, key=counts.__getitem__)
            prob *= counts[tok] / len(rows)
            if prob < self.min_token_prob:
                break
            draft.append(tok)
            score += prob
            rows = [r for r in rows if r[i] == tok]
            i += 1
        return draft, score

    # -- index upkeep -------------------------------------------------------------------------

    def _sync(self, req_id: str, tokens: np.ndarray, num_prompt: int) -> Local:
        st = self._local.get(req_id)
        if st is None or not continues(st, tokens, num_prompt):
            st = self._local[req_id] = Local(num_prompt)  # new, or shrunk/replaced: rebuild
        n = len(st.toks)
        if len(tokens) > n:
            st.toks.extend(tokens[n:].tolist())
            st.index(0)  # the longest anchor's chain, which every call walks
        return st

    def _low(self) -> int:
        return self._cached[0][0] if self._cached else self._head

    def _write(self, start: int, vals: list[int]) -> None:
        ring, size = self._ring, len(self._ring)
        s = start % size
        cut = min(len(vals), size - s)
        ring[s:s + cut] = array("i", vals[:cut])
        ring[:len(vals) - cut] = array("i", vals[cut:])

    def _evict(self) -> None:
        start, n = self._cached.popleft()
        ring, size = self._ring, len(self._ring)
        s = start % size
        out = (ring[s:s + n] if s + n <= size else ring[s:] + ring[:s + n - size]).tolist()
        low = self._low()
        for a, last in zip(ANCHORS, self._chains.last):
            # chains stop below low by themselves; an anchor whose latest is gone goes too
            for h in {pack(out[j:j + a]) for j in range(n - a)}:
                if last.get(h, low) < low:
                    del last[h]
