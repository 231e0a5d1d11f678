"""Sampling params: the limits every request field is held to, and the checks that name the
field and the limit in their ValueError. Owns no state but ``TRUSTED_DECODE`` (per thread).
"""
from __future__ import annotations

import threading
from collections.abc import Sequence

MAX_N = 64
MAX_LOGPROBS = 20
MAX_STOP_STRINGS = 16
MAX_STOP_STRING_BYTES = 256  # UTF-8
MAX_STOP_TOKEN_IDS = 1024
MAX_BAD_WORDS = 128
MAX_BAD_WORD_BYTES = 256  # UTF-8
MAX_BAD_WORD_TOKENS = 512
MAX_LOGIT_BIAS = 1024
MAX_LOGIT_BIAS_VALUE = 100.0
MAX_ALLOWED_TOKEN_IDS = 1 << 18
# Logprobs are the one part of an answer whose size the request fixes up front; the answers
# ring is sized for three such parts plus the text and token ids (runtime/ring_sizes.py,
# Sizes).
MAX_LOGPROBS_BYTES = 4 << 20
# Of a final answer, what does not grow with its tokens (ids, usage, timings, error message),
# and per completion (stop reason, finish reason, headers): see runtime.ring_sizes.
ANSWER_FIXED_BYTES = 64 << 10
COMPLETION_FIXED_BYTES = 1 << 10
# Set (per thread) while a stage decodes a message another stage of its instance encoded
# (``runtime.rings.Channel``): its SamplingParams were checked where the request came in (the
# gateway, the tokenizer stage's validator) and were encoded normalised, so decoding them
# again skips the checks: ~7 µs a request, 2 ms of a step plan that admits 233 requests.
TRUSTED_DECODE = threading.local()


def trusted() -> bool:
    return getattr(TRUSTED_DECODE, "on", False)


def logprob_entry_bytes(k: int) -> int:
    """Upper bound of one encoded TokenLogprobs with ``k`` top entries (msgpack: array
    headers, a uint32 id and a float64 each)."""
    return 20 + 14 * k


def max_tokens_that_fit(n: int, logprobs: int | None, token_text_bytes: int, limit: int) -> int:
    """The largest max_tokens whose answer fits ``limit`` (``runtime.ring_sizes.answer_bytes_bound`` solved for
    max_tokens, without prompt logprobs) and whose logprobs fit MAX_LOGPROBS_BYTES: what a
    request that did not set max_tokens gets (as many as fit, not a refusal over limits the
    client never set). At least 1."""
    lp = 0 if logprobs is None else logprob_entry_bytes(logprobs)
    copies = n + 1 if n > 1 else 1
    per_token = copies * (5 + token_text_bytes + lp) + 9 * n
    fit = (limit - ANSWER_FIXED_BYTES - copies * COMPLETION_FIXED_BYTES) // per_token
    if logprobs is not None:
        fit = min(fit, MAX_LOGPROBS_BYTES // (n * lp))
    return max(1, fit)


def bad(field: str, limit: str, value: object) -> ValueError:
    # "<field> must be <limit>, got <value>": tokenizer.validate and the wire protocol turn
    # it into "field `<field>`: must be ...".
    return ValueError(f"{field} must be {limit}, got {value!r}")


def check_range(field: str, v: object, lo: float, hi: float, limit: str = "",
           open_low: bool = False) -> None:
    # NaN fails every comparison, so it is out of any range.
    ok = (not isinstance(v, bool) and isinstance(v, int | float)
          and (lo < v if open_low else lo <= v) and v <= hi)
    if not ok:
        raise bad(field, limit or f"in [{lo:g}, {hi:g}]", v)


def check_ids(field: str, ids: Sequence[int], limit: int) -> None:
    if len(ids) > limit:
        raise bad(field, f"at most {limit} token ids", len(ids))
    for t in ids:
        if not isinstance(t, int) or t < 0:
            raise bad(field, "token ids >= 0", t)


def check_strings(field: str, items: Sequence[str], count: int, size: int) -> None:
    if len(items) > count:
        raise bad(field, f"at most {count} strings", len(items))
    for s in items:
        if not isinstance(s, str) or not s or len(s.encode()) > size:
            raise bad(field, f"non-empty strings of at most {size} UTF-8 bytes", s)


def json_depth(value: object) -> int:
    """Nesting depth of a JSON value (or of JSON text; 0 if it does not parse: the compiler
    then names what is wrong), without recursion."""
    if isinstance(value, str):
        import json as _json
        try:
            value = _json.loads(value)
        except RecursionError:  # deeper than Python's parser goes: far beyond the limit
            return 1 << 20
        except ValueError:
            return 0
    deepest, stack = 0, [(value, 1)]
    while stack:
        v, d = stack.pop()
        if isinstance(v, dict | list):
            deepest = max(deepest, d)
            stack.extend((c, d + 1) for c in (v.values() if isinstance(v, dict) else v))
    return deepest
