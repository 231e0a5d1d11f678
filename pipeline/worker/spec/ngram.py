"""Speculative decoding: the n-gram proposer (vLLM's ``ngram`` method, prompt lookup). For the
sequence's last n tokens, n from prompt_lookup_max down to prompt_lookup_min, find their most
recent earlier occurrence in the request's own tokens (prompt and output) and draft the up to k
tokens that followed it. The first n that has an occurrence wins, so a longer pattern is
preferred over a more recent shorter one.

Incremental: per request and per n, a dict from the hash of every n-token window to the end
position of its latest occurrence, updated with the windows the accepted tokens complete. A
call costs O(max - min + 1 + new tokens) dict operations whatever the history's length; only a
new (or re-synced) request pays O(length), vectorised.

Owns: the per-request window indexes.
State: per request: the indexed length, the tail it was indexed with (to detect a shrink or a
replaced sequence), one dict per n. Memory: at most one entry per window per n, i.e.
(max - min + 1) * length entries (~100 bytes each) for a live request, nothing after remove().
"""
from __future__ import annotations

import numpy as np

from pipeline.worker.spec.proposer import tail_hashes, window_hashes


class _State:
    __slots__ = ("first", "index", "n", "num_prompt", "tail")

    def __init__(self, orders: int, num_prompt: int) -> None:
        self.n = 0  # tokens seen; the index holds the windows ending at positions <= n-2
        self.num_prompt = num_prompt
        self.first = -1  # tokens[0], checked with the tail on every call
        self.tail: list[int] = []  # tokens[n-len(tail):n] as seen
        self.index: list[dict[int, int]] = [{} for _ in range(orders)]  # per n: hash -> end pos


class NgramProposer:
    def __init__(self, prompt_lookup_min: int, prompt_lookup_max: int) -> None:
        if not 1 <= prompt_lookup_min <= prompt_lookup_max <= 256:
            raise ValueError(f"need 1 <= prompt_lookup_min <= prompt_lookup_max <= 256, got "
                             f"{prompt_lookup_min}..{prompt_lookup_max}")
        self.min_n = prompt_lookup_min
        self.max_n = prompt_lookup_max
        self._reqs: dict[str, _State] = {}

    def __len__(self) -> int:
        return len(self._reqs)

    def propose(self, req_id: str, tokens: np.ndarray, num_prompt: int, k: int) -> list[int]:
        length = len(tokens)
        self._sync(req_id, tokens, num_prompt)
        if k <= 0 or length < 2:
            return []
        index = self._reqs[req_id].index
        hashes = tail_hashes(tokens, length, self.max_n)
        for n in range(min(self.max_n, length - 1), self.min_n - 1, -1):
            end = index[n - self.min_n].get(hashes[n - 1])
            # A hash hit is verified: a collision must cost a miss, never a wrong match.
            if end is not None and tokens[end - n + 1:end + 1].tolist() == tokens[length - n:].tolist():
                return tokens[end + 1:min(length, end + 1 + k)].tolist()
        return []

    def remove(self, req_id: str) -> None:
        self._reqs.pop(req_id, None)

    def finished(self, req_id: str, tokens: np.ndarray, num_prompt: int) -> None:
        """Prompt lookup has no cross-request index: nothing to learn."""

    def _sync(self, req_id: str, tokens: np.ndarray, num_prompt: int) -> None:
        length = len(tokens)
        st = self._reqs.get(req_id)
        if st is None or not _continues(st, tokens, num_prompt):
            # New, or shrunk/replaced (preemption, a reused id): index from scratch.
            st = self._reqs[req_id] = _State(self.max_n - self.min_n + 1, num_prompt)
        if length <= st.n:
            return
        lo, hi = max(st.n - 1, 0), length - 1  # the window ending at length-1 is the pattern
        if hi - lo > 8:  # a new request or a prefill's worth: vectorised, per n
            for i, index in enumerate(st.index):
                n = self.min_n + i
                start = max(lo, n - 1)
                # Later positions overwrite earlier ones: each window keeps its latest end.
                index.update(zip(window_hashes(tokens, n, start, hi), range(start, hi)))
        else:  # a decode step's 1..k+1 tokens: every n from one pass per position
            for p in range(lo, hi):
                hashes = tail_hashes(tokens, p + 1, self.max_n)
                for n in range(self.min_n, len(hashes) + 1):
                    st.index[n - self.min_n][hashes[n - 1]] = p
        st.n = length
        st.first = int(tokens[0])
        st.tail = tokens[max(0, length - self.max_n):length].tolist()


def _continues(st: _State, tokens: np.ndarray, num_prompt: int) -> bool:
    """Whether ``tokens`` extends what ``st`` indexed: same prompt length and first token, and
    the tail it was indexed with (the windows the next tokens complete start there) unchanged."""
    n = st.n
    if len(tokens) < n or num_prompt != st.num_prompt:
        return False
    return n == 0 or (int(tokens[0]) == st.first and tokens[n - len(st.tail):n].tolist() == st.tail)
