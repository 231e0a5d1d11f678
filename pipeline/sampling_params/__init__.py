"""Shared by every stage: per-request sampling settings and their validation.

``limits`` holds the limits and the checks, ``structured`` the ``StructuredOutputsParams``.

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
from collections.abc import Callable

import msgspec

from pipeline.sampling_params.limits import (
    MAX_ALLOWED_TOKEN_IDS,
    MAX_BAD_WORD_BYTES,
    MAX_BAD_WORD_TOKENS,
    MAX_BAD_WORDS,
    MAX_LOGIT_BIAS,
    MAX_LOGIT_BIAS_VALUE,
    MAX_LOGPROBS,
    MAX_LOGPROBS_BYTES,
    MAX_N,
    MAX_STOP_STRING_BYTES,
    MAX_STOP_STRINGS,
    MAX_STOP_TOKEN_IDS,
    bad,
    check_ids,
    check_range,
    check_strings,
    logprob_entry_bytes,
    trusted,
)
from pipeline.sampling_params.structured import StructuredOutputsParams


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
        if trusted():  # checked and normalised where it came in
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

    def clone(self) -> SamplingParams:
        """A deep copy (vLLM's ``clone``): changing it leaves this one as it was."""
        import copy
        return copy.deepcopy(self)

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
                raise bad(f, "an integer", v)
        check_range("n", self.n, 1, MAX_N)
        check_range("max_tokens", self.max_tokens, 1, math.inf, ">= 1")
        check_range("min_tokens", self.min_tokens, 0, self.max_tokens, f"in [0, max_tokens={self.max_tokens}]")
        check_range("temperature", self.temperature, 0.0, 100.0)
        check_range("top_p", self.top_p, 0.0, 1.0, "in (0, 1]", open_low=True)
        check_range("top_k", self.top_k, -1, math.inf, "-1, 0 or >= 1")
        check_range("min_p", self.min_p, 0.0, 1.0)
        check_range("repetition_penalty", self.repetition_penalty, 0.0, 10.0, "in (0, 10]", open_low=True)
        check_range("presence_penalty", self.presence_penalty, -2.0, 2.0)
        check_range("frequency_penalty", self.frequency_penalty, -2.0, 2.0)
        if self.seed is not None:
            check_range("seed", self.seed, 0, 2**63 - 1, "in [0, 2**63)")
        check_strings("stop", self.stop, MAX_STOP_STRINGS, MAX_STOP_STRING_BYTES)
        check_ids("stop_token_ids", self.stop_token_ids, MAX_STOP_TOKEN_IDS)
        check_strings("bad_words", self.bad_words, MAX_BAD_WORDS, MAX_BAD_WORD_BYTES)
        if len(self.bad_words_token_ids) > 2 * MAX_BAD_WORDS:
            raise bad("bad_words_token_ids", f"at most {2 * MAX_BAD_WORDS} sequences",
                       len(self.bad_words_token_ids))
        for seq in self.bad_words_token_ids:
            if not seq:
                raise bad("bad_words_token_ids", "non-empty sequences", seq)
            check_ids("bad_words_token_ids", seq, MAX_BAD_WORD_TOKENS)
        if self.logit_bias is not None:
            check_ids("logit_bias", list(self.logit_bias), MAX_LOGIT_BIAS)
            for v in self.logit_bias.values():
                check_range("logit_bias", v, -MAX_LOGIT_BIAS_VALUE, MAX_LOGIT_BIAS_VALUE)
        if self.allowed_token_ids is not None:
            if not self.allowed_token_ids:
                raise bad("allowed_token_ids", "None or a non-empty list", [])
            check_ids("allowed_token_ids", self.allowed_token_ids, MAX_ALLOWED_TOKEN_IDS)
        for f in ("logprobs", "prompt_logprobs"):
            if getattr(self, f) is not None:
                check_range(f, getattr(self, f), 0, MAX_LOGPROBS, f"None or in [0, {MAX_LOGPROBS}]")
        if self.logprobs is not None:
            entry = logprob_entry_bytes(self.logprobs)
            size = self.n * self.max_tokens * entry
            if size > MAX_LOGPROBS_BYTES:
                raise bad("logprobs", f"at most {MAX_LOGPROBS_BYTES} bytes of logprobs per answer "
                           f"(n * max_tokens * {entry} bytes)", size)
        k = self.truncate_prompt_tokens
        if k is not None and k != -1 and k < 1:
            raise bad("truncate_prompt_tokens", "None, -1 or >= 1", k)

    def validate(self, vocab_size: int | None = None, max_model_len: int | None = None,
                 num_prompt_tokens: int | None = None) -> None:
        """The limits that need the model (and the prompt's length in tokens, if given);
        raise ValueError naming the field and its limit."""
        self.__post_init__()  # a caller may have changed fields since it was built
        if max_model_len is not None:
            if self.max_tokens > max_model_len:
                raise bad("max_tokens", f"<= max_model_len ({max_model_len})", self.max_tokens)
            k = self.truncate_prompt_tokens
            if k is not None and k > max_model_len:
                raise bad("truncate_prompt_tokens", f"-1 or in [1, max_model_len={max_model_len}]", k)
        if self.bad_words:
            raise bad("bad_words", "tokenized before validation (resolve_bad_words)", self.bad_words)
        if vocab_size is not None:
            limit = f"in [0, vocab_size={vocab_size})"
            if self.top_k > vocab_size:
                raise bad("top_k", f"-1, 0 or in [1, vocab_size={vocab_size}]", self.top_k)
            for field, ids in (("stop_token_ids", self.stop_token_ids),
                               ("allowed_token_ids", self.allowed_token_ids or ()),
                               ("logit_bias", list(self.logit_bias or ())),
                               *(("bad_words_token_ids", s) for s in self.bad_words_token_ids)):
                for t in ids:
                    if t >= vocab_size:
                        raise bad(field, limit, t)
        if self.prompt_logprobs is not None and num_prompt_tokens is not None:
            size = num_prompt_tokens * logprob_entry_bytes(self.prompt_logprobs)
            if size > MAX_LOGPROBS_BYTES:
                raise bad("prompt_logprobs", f"at most {MAX_LOGPROBS_BYTES} bytes of logprobs per "
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
# (``http.openai_convert``, ``http.openai_response``) derive theirs from it; pipe mode's JSON
# lines are ``Generate``s.
SAMPLING_FIELDS: tuple[str, ...] = SamplingParams.__struct_fields__
