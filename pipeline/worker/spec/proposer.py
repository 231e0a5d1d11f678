"""Speculative decoding proposers: the interface, and a plain n-gram lookup."""
from __future__ import annotations

from typing import Protocol

import numpy as np


class Proposer(Protocol):
    def propose(self, req_id: str, tokens: np.ndarray, num_prompt: int, k: int) -> list[int]: ...
    def remove(self, req_id: str) -> None: ...
    def finished(self, req_id: str, tokens: np.ndarray, num_prompt: int) -> None: ...


class _Ngram:
    def __init__(self, lo: int, hi: int) -> None:
        self.lo, self.hi = lo, hi

    def propose(self, req_id, tokens, num_prompt, k):
        t = tokens.tolist()
        for n in range(self.hi, self.lo - 1, -1):
            if len(t) <= n:
                continue
            pat = t[-n:]
            for i in range(len(t) - n - 1, -1, -1):
                if t[i:i + n] == pat:
                    return t[i + n:i + n + k]
        return []

    def remove(self, req_id):
        pass

    def finished(self, req_id, tokens, num_prompt):
        pass


def make_proposer(method, *, num_speculative_tokens, prompt_lookup_min, prompt_lookup_max, **extra):
    return _Ngram(prompt_lookup_min, prompt_lookup_max)
