"""Speculative decoding: the proposer interface the worker drives, its factory, and the token
window hashing the n-gram and suffix proposers share.

A proposer drafts up to ``k`` tokens continuing a request's known tokens; the target model then
verifies them in one forward. Proposers here need no weights: they look the sequence's tail up
in what the request (and, for suffix decoding, recently finished requests) already said.

Owns: nothing (the interface, the factory, pure hash helpers).
State: none.
"""
from __future__ import annotations

from typing import Any, Protocol

import numpy as np

# vLLM's rule for the n-gram window: both unset -> 5..5; one unset -> it copies the other.
DEFAULT_PROMPT_LOOKUP = 5

# Token windows hash to 64-bit ints (polynomial in an odd multiplier, mod 2**64) so a window of
# any length is one dict key; callers verify the tokens on a hit, so a collision costs a miss.
_MUL = 0x9E3779B97F4A7C15
_MASK = (1 << 64) - 1
_POW = [pow(_MUL, i, 1 << 64) for i in range(257)]  # _MUL**i mod 2**64, i <= max window length
_NUMPY_MIN = 24  # below this many windows a Python loop beats numpy's per-call overhead


class Proposer(Protocol):
    def propose(self, req_id: str, tokens: np.ndarray, num_prompt: int, k: int) -> list[int]:
        """Up to k draft tokens continuing ``tokens`` (int32, every known token of the request:
        prompt then output, the last one just sampled); [] when it has none worth drafting.
        Called once per decode step per request, with ``tokens`` grown by the tokens accepted
        since the last call (1..k+1 of them) -- or shrunk/replaced after a preemption or when the
        request is new (then the proposer must re-sync: detect by length/identity, never assume)."""
        ...

    def remove(self, req_id: str) -> None:
        """The request left this worker's batch (finished, aborted, preempted). Its output
        stays in any cross-request index (suffix) only if finished(...) was called first."""
        ...

    def finished(self, req_id: str, tokens: np.ndarray, num_prompt: int) -> None:
        """The request finished normally: a cross-request index may learn its output."""
        ...


def ngram_window(prompt_lookup_min: int | None, prompt_lookup_max: int | None) -> tuple[int, int]:
    """(min, max) n-gram lengths from a config where either may be unset, as vLLM fills them."""
    lo = prompt_lookup_min if prompt_lookup_min is not None else prompt_lookup_max
    hi = prompt_lookup_max if prompt_lookup_max is not None else prompt_lookup_min
    return (DEFAULT_PROMPT_LOOKUP, DEFAULT_PROMPT_LOOKUP) if lo is None or hi is None else (lo, hi)


def make_proposer(method: str, *, num_speculative_tokens: int, prompt_lookup_min: int,
                  prompt_lookup_max: int, **extra: Any) -> Proposer:
    """"ngram" or "suffix". ``extra`` takes the suffix proposer's knobs, by their vLLM config
    names (``suffix_decoding_max_tree_depth``, ...) or without the ``suffix_decoding_`` prefix;
    an unknown one is an error rather than silently ignored."""
    if num_speculative_tokens < 1:
        raise ValueError(f"num_speculative_tokens must be >= 1, got {num_speculative_tokens}")
    # Lazy: the implementations import this module's hash helpers.
    if method == "ngram":
        from pipeline.worker.spec.ngram import NgramProposer
        if extra:
            raise ValueError(f"ngram proposer: unknown options {sorted(extra)}")
        return NgramProposer(prompt_lookup_min, prompt_lookup_max)
    if method == "suffix":
        from pipeline.worker.spec.suffix import SuffixProposer
        opts = {key.removeprefix("suffix_decoding_"): v for key, v in extra.items()}
        try:
            return SuffixProposer(num_speculative_tokens, **opts)
        except TypeError as e:  # an unknown keyword
            raise ValueError(f"suffix proposer: {e}") from None
    raise ValueError(f"unknown speculative method {method!r} (expected 'ngram' or 'suffix')")


def window_hashes(tokens: np.ndarray, n: int, lo: int, hi: int) -> list[int]:
    """Hashes of the n-token windows ending at positions lo..hi-1 (inclusive ends: window p is
    ``tokens[p-n+1 : p+1]``); needs lo >= n-1. Equal to tail_hashes' n-th entry."""
    if hi <= lo:
        return []
    if hi - lo < _NUMPY_MIN:
        vals = tokens[lo - n + 1:hi].tolist()
        out = []
        for j in range(hi - lo):
            h = 0
            for t in vals[j:j + n]:
                h = (h * _MUL + t) & _MASK
            out.append(h)
        return out
    t = tokens[lo - n + 1:hi].astype(np.uint64)
    acc = np.zeros(hi - lo, dtype=np.uint64)
    mul = np.uint64(_MUL)
    for i in range(n):  # uint64 arithmetic wraps: mod 2**64, as the Python path masks
        acc = acc * mul + t[i:i + hi - lo]
    return acc.tolist()


def tail_hashes(tokens: np.ndarray, end: int, max_n: int) -> list[int]:
    """[h_1, ..., h_max_n]: hashes of the windows of length 1..max_n ending at position end-1
    (shorter list when fewer tokens precede)."""
    vals = tokens[max(0, end - max_n):end].tolist()
    out, h = [], 0
    for i, t in enumerate(reversed(vals)):  # h_n = t[end-n] * MUL**(n-1) + h_(n-1)
        h = (h + t * _POW[i]) & _MASK
        out.append(h)
    return out
