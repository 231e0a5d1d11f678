"""Shared by every stage: per-request sampling settings and their validation.

Owns no state. A ``SamplingParams`` is checked when it is built, whether by a caller or by
msgspec decoding it (``__post_init__`` runs on both; not when a stage decodes what another
stage of its instance sent: ``TRUSTED_DECODE``): every limit that does not need the
model raises ValueError naming the field and the limit. ``validate`` adds the limits that
need the model (vocab size, max_model_len) and is called once, by the request validator
(``tokenizer.validate``). Where the prompt becomes token ids, ``truncate_prompt`` and
``resolve_bad_words`` turn the text-level fields into token ids; afterwards the params
travel unchanged (msgspec-encoded) to the engine, the worker and the token processor.

Field names and meanings follow vLLM's ``SamplingParams``; ``stop``, ``stop_token_ids`` and
``bad_words`` also take a single value (or None) and are normalised to lists.
"""
from __future__ import annotations

import math
import threading
from collections.abc import Callable, Sequence

import msgspec

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
# structured_outputs: the spec (a schema, regex, grammar or the choices) in UTF-8 bytes, and
# the choices' count. The grammar compiles in the tokenizer stage and the worker (ms for
# specs this size; structured_outputs.py) and travels with the request through every ring.
MAX_STRUCTURED_BYTES = 64 << 10
MAX_CHOICES = 256
# A JSON schema's nesting (objects and arrays): xgrammar's compile time grows faster than
# linearly with it (measured: 129 levels 0.07 s, ~900 over 100 s), and it runs on a thread
# of the tokenizer stage; 64 levels (~30 nested objects) compile in ~20 ms.
MAX_SCHEMA_DEPTH = 64
STRUCTURED_KINDS = ("json", "regex", "choice", "grammar", "json_object")


# Set (per thread) while a stage decodes a message another stage of its instance encoded
# (``runtime.rings.Channel``): its SamplingParams were checked where the request came in (the
# gateway, the tokenizer stage's validator) and were encoded normalised, so decoding them
# again skips the checks: ~7 µs a request, 2 ms of a step plan that admits 233 requests.
TRUSTED_DECODE = threading.local()


def _trusted() -> bool:
    return getattr(TRUSTED_DECODE, "on", False)


def logprob_entry_bytes(k: int) -> int:
    """Upper bound of one encoded TokenLogprobs with ``k`` top entries (msgpack: array
    headers, a uint32 id and a float64 each)."""
    return 20 + 14 * k


def _bad(field: str, limit: str, value: object) -> ValueError:
    # "<field> must be <limit>, got <value>": tokenizer.validate and the wire protocol turn
    # it into "field `<field>`: must be ...".
    return ValueError(f"{field} must be {limit}, got {value!r}")


def _range(field: str, v: object, lo: float, hi: float, limit: str = "",
           open_low: bool = False) -> None:
    # NaN fails every comparison, so it is out of any range.
    ok = (not isinstance(v, bool) and isinstance(v, int | float)
          and (lo < v if open_low else lo <= v) and v <= hi)
    if not ok:
        raise _bad(field, limit or f"in [{lo:g}, {hi:g}]", v)


def _ids(field: str, ids: Sequence[int], limit: int) -> None:
    if len(ids) > limit:
        raise _bad(field, f"at most {limit} token ids", len(ids))
    for t in ids:
        if not isinstance(t, int) or t < 0:
            raise _bad(field, "token ids >= 0", t)


def _strings(field: str, items: Sequence[str], count: int, size: int) -> None:
    if len(items) > count:
        raise _bad(field, f"at most {count} strings", len(items))
    for s in items:
        if not isinstance(s, str) or not s or len(s.encode()) > size:
            raise _bad(field, f"non-empty strings of at most {size} UTF-8 bytes", s)


def _json_depth(value: object) -> int:
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


class StructuredOutputsParams(msgspec.Struct, kw_only=True, omit_defaults=True):
    """vLLM's names: exactly one of ``json`` (a JSON schema, as an object or its text),
    ``regex``, ``choice``, ``grammar`` (EBNF, xgrammar's dialect of GBNF) or
    ``json_object=True`` (any JSON object)."""
    json: str | dict | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None

    def __post_init__(self) -> None:
        if _trusted():
            return
        given = [k for k in STRUCTURED_KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise _bad("structured_outputs", f"exactly one of {', '.join(STRUCTURED_KINDS)}",
                       given or None)
        kind = given[0]
        if kind == "json_object" and self.json_object is not True:
            raise _bad("structured_outputs.json_object", "true", self.json_object)
        if kind == "choice":
            assert self.choice is not None
            if not isinstance(self.choice, list) or not self.choice:
                raise _bad("structured_outputs.choice", "a non-empty list of strings", self.choice)
            _strings("structured_outputs.choice", self.choice, MAX_CHOICES, MAX_STRUCTURED_BYTES)
        size = len(self.spec_text().encode("utf-8", "surrogatepass"))
        if size > MAX_STRUCTURED_BYTES:
            raise _bad(f"structured_outputs.{kind}", f"at most {MAX_STRUCTURED_BYTES} UTF-8 bytes",
                       f"{size} bytes")
        if kind in ("regex", "grammar", "json") and not self.spec_text().strip():
            raise _bad(f"structured_outputs.{kind}", "non-empty", getattr(self, kind))
        if kind == "json":
            depth = _json_depth(self.json)
            if depth > MAX_SCHEMA_DEPTH:
                raise _bad("structured_outputs.json", f"nested at most {MAX_SCHEMA_DEPTH} levels "
                           f"deep (objects and arrays)", f"{depth} levels")

    @property
    def kind(self) -> str:
        return next(k for k in STRUCTURED_KINDS if getattr(self, k) not in (None, False))

    def spec_text(self) -> str:
        """The spec as one string (a schema object as JSON with sorted keys; choices as a JSON
        array): what identifies it, with ``kind`` (the grammar compiles from the schema as
        given, whose key order the output follows)."""
        import json as _json
        kind = self.kind
        value = getattr(self, kind)
        if kind == "json_object":
            return ""
        if kind == "choice" or isinstance(value, dict):
            return _json.dumps(value, sort_keys=True, ensure_ascii=False, separators=(",", ":"))
        return str(value)


class SamplingParams(msgspec.Struct, kw_only=True, omit_defaults=True):
    n: int = 1  # completions of the one prompt (one prefill, n samples)
    max_tokens: int = 16
    min_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: disabled
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    stop: str | list[str] = []
    stop_token_ids: list[int] = []
    bad_words: str | list[str] = []  # text; the tokenizer stage turns it into bad_words_token_ids
    bad_words_token_ids: list[list[int]] = []  # token sequences never generated
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit
    allowed_token_ids: list[int] | None = None  # None: all
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    logprobs: int | None = None  # None: none; 0: sampled token only; N: plus top-N
    prompt_logprobs: int | None = None  # same, for every prompt token after the first
    skip_special_tokens: bool = True
    truncate_prompt_tokens: int | None = None  # keep the last k prompt tokens; -1: what fits
    # Output constrained to a JSON schema, regex, choice or grammar (structured_outputs.py).
    structured_outputs: StructuredOutputsParams | None = None

    def __post_init__(self) -> None:
        if _trusted():  # checked and normalised where it came in
            return
        # A single value is a one-element list (iterating a str would stop on every char).
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        elif self.stop is None:
            self.stop = []
        if isinstance(self.bad_words, str):
            self.bad_words = [self.bad_words]
        elif self.bad_words is None:
            self.bad_words = []
        sti: object = self.stop_token_ids
        if isinstance(sti, int):
            self.stop_token_ids = [sti]
        elif sti is None:
            self.stop_token_ids = []
        self._check()

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def _check(self) -> None:
        """The limits that need no model; raise ValueError naming the field and its limit."""
        for f in ("n", "max_tokens", "min_tokens", "top_k", "seed", "logprobs", "prompt_logprobs",
                  "truncate_prompt_tokens"):
            v = getattr(self, f)
            # bool is an int in Python, but True is not a count.
            if v is not None and (isinstance(v, bool) or not isinstance(v, int)):
                raise _bad(f, "an integer", v)
        _range("n", self.n, 1, MAX_N)
        _range("max_tokens", self.max_tokens, 1, math.inf, ">= 1")
        _range("min_tokens", self.min_tokens, 0, self.max_tokens, f"in [0, max_tokens={self.max_tokens}]")
        _range("temperature", self.temperature, 0.0, 100.0)
        _range("top_p", self.top_p, 0.0, 1.0, "in (0, 1]", open_low=True)
        _range("top_k", self.top_k, -1, math.inf, "-1, 0 or >= 1")
        _range("min_p", self.min_p, 0.0, 1.0)
        _range("repetition_penalty", self.repetition_penalty, 0.0, 10.0, "in (0, 10]", open_low=True)
        _range("presence_penalty", self.presence_penalty, -2.0, 2.0)
        _range("frequency_penalty", self.frequency_penalty, -2.0, 2.0)
        if self.seed is not None:
            _range("seed", self.seed, 0, 2**63 - 1, "in [0, 2**63)")
        _strings("stop", self.stop, MAX_STOP_STRINGS, MAX_STOP_STRING_BYTES)
        _ids("stop_token_ids", self.stop_token_ids, MAX_STOP_TOKEN_IDS)
        _strings("bad_words", self.bad_words, MAX_BAD_WORDS, MAX_BAD_WORD_BYTES)
        if len(self.bad_words_token_ids) > 2 * MAX_BAD_WORDS:
            raise _bad("bad_words_token_ids", f"at most {2 * MAX_BAD_WORDS} sequences",
                       len(self.bad_words_token_ids))
        for seq in self.bad_words_token_ids:
            if not seq:
                raise _bad("bad_words_token_ids", "non-empty sequences", seq)
            _ids("bad_words_token_ids", seq, MAX_BAD_WORD_TOKENS)
        if self.logit_bias is not None:
            _ids("logit_bias", list(self.logit_bias), MAX_LOGIT_BIAS)
            for v in self.logit_bias.values():
                _range("logit_bias", v, -MAX_LOGIT_BIAS_VALUE, MAX_LOGIT_BIAS_VALUE)
        if self.allowed_token_ids is not None:
            if not self.allowed_token_ids:
                raise _bad("allowed_token_ids", "None or a non-empty list", [])
            _ids("allowed_token_ids", self.allowed_token_ids, MAX_ALLOWED_TOKEN_IDS)
        for f in ("logprobs", "prompt_logprobs"):
            if getattr(self, f) is not None:
                _range(f, getattr(self, f), 0, MAX_LOGPROBS, f"None or in [0, {MAX_LOGPROBS}]")
        if self.logprobs is not None:
            entry = logprob_entry_bytes(self.logprobs)
            size = self.n * self.max_tokens * entry
            if size > MAX_LOGPROBS_BYTES:
                raise _bad("logprobs", f"at most {MAX_LOGPROBS_BYTES} bytes of logprobs per answer "
                           f"(n * max_tokens * {entry} bytes)", size)
        k = self.truncate_prompt_tokens
        if k is not None and k != -1 and k < 1:
            raise _bad("truncate_prompt_tokens", "None, -1 or >= 1", k)

    def validate(self, vocab_size: int | None = None, max_model_len: int | None = None,
                 num_prompt_tokens: int | None = None) -> None:
        """The limits that need the model (and the prompt's length in tokens, if given);
        raise ValueError naming the field and its limit."""
        self.__post_init__()  # a caller may have changed fields since it was built
        if max_model_len is not None:
            if self.max_tokens > max_model_len:
                raise _bad("max_tokens", f"<= max_model_len ({max_model_len})", self.max_tokens)
            k = self.truncate_prompt_tokens
            if k is not None and k > max_model_len:
                raise _bad("truncate_prompt_tokens", f"-1 or in [1, max_model_len={max_model_len}]", k)
        if self.bad_words:
            raise _bad("bad_words", "tokenized before validation (resolve_bad_words)", self.bad_words)
        if vocab_size is not None:
            limit = f"in [0, vocab_size={vocab_size})"
            if self.top_k > vocab_size:
                raise _bad("top_k", f"-1, 0 or in [1, vocab_size={vocab_size}]", self.top_k)
            for field, ids in (("stop_token_ids", self.stop_token_ids),
                               ("allowed_token_ids", self.allowed_token_ids or ()),
                               ("logit_bias", list(self.logit_bias or ())),
                               *(("bad_words_token_ids", s) for s in self.bad_words_token_ids)):
                for t in ids:
                    if t >= vocab_size:
                        raise _bad(field, limit, t)
        if self.prompt_logprobs is not None and num_prompt_tokens is not None:
            size = num_prompt_tokens * logprob_entry_bytes(self.prompt_logprobs)
            if size > MAX_LOGPROBS_BYTES:
                raise _bad("prompt_logprobs", f"at most {MAX_LOGPROBS_BYTES} bytes of logprobs per "
                           f"answer ({num_prompt_tokens} prompt tokens * "
                           f"{logprob_entry_bytes(self.prompt_logprobs)} bytes)", size)

    # -- where the prompt becomes token ids (tokenizer stage, in-process LLM) ------------
    def truncate_prompt(self, ids: list[int], max_model_len: int) -> list[int]:
        """The prompt's last ``truncate_prompt_tokens`` tokens (-1: the most that leave room
        for ``max_tokens`` within max_model_len); the prompt itself when unset."""
        k = self.truncate_prompt_tokens
        if k is None:
            return ids
        if k == -1:
            k = max(max_model_len - self.max_tokens, 1)
        return ids[-k:] if len(ids) > k else ids

    def resolve_bad_words(self, encode: Callable[[str], list[int]]) -> SamplingParams:
        """A copy whose ``bad_words`` are token sequences in ``bad_words_token_ids``.

        ``encode`` is the tokenizer without special tokens. Like vLLM, each word is banned
        at the start of the text and, where the tokenizer has a distinct token for it, after
        a space."""
        if not self.bad_words:
            return self
        seqs = [list(s) for s in self.bad_words_token_ids]
        for word in self.bad_words:
            plain = encode(word.lstrip())
            if not plain:
                continue
            seqs.append(plain)
            spaced = encode(" " + word.lstrip())
            if spaced and spaced[0] != plain[0] and len(spaced) == len(plain):
                seqs.append(spaced)
        return msgspec.structs.replace(self, bad_words=[], bad_words_token_ids=seqs)


# The one declaration of the sampling fields (SamplingParams's): the wire's ``Generate``
# (``frontend.protocol``), the OpenAI bodies (``http.openai_api``) and their conversion
# (``http.openai_convert``, ``http.openai_response``) derive theirs from it; pipe mode's JSON lines are ``Generate``s.
SAMPLING_FIELDS: tuple[str, ...] = SamplingParams.__struct_fields__
