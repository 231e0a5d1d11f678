"""Shared by every stage: per-request sampling settings and their validation.

The tokenizer stage validates them once at admission; afterwards they travel unchanged
(msgspec-encoded) to the engine, the worker and the token processor.
"""
from __future__ import annotations

import msgspec

MAX_LOGPROBS = 20
MAX_STOP_STRINGS = 16
MAX_STOP_STRING_LEN = 256


class SamplingParams(msgspec.Struct, kw_only=True, omit_defaults=True):
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
    stop: list[str] = []
    stop_token_ids: list[int] = []
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    logprobs: int | None = None  # None: none; 0: sampled token only; N: plus top-N
    skip_special_tokens: bool = True

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def validate(self, vocab_size: int | None = None, max_model_len: int | None = None) -> None:
        """Raise ValueError naming the field and its limit."""
        def bad(field: str, limit: str, value: object) -> None:
            raise ValueError(f"{field} must be {limit}, got {value!r}")

        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            bad("max_tokens", ">= 1", self.max_tokens)
        if max_model_len is not None and self.max_tokens > max_model_len:
            bad("max_tokens", f"<= max_model_len ({max_model_len})", self.max_tokens)
        if self.min_tokens < 0 or self.min_tokens > self.max_tokens:
            bad("min_tokens", f"in [0, max_tokens={self.max_tokens}]", self.min_tokens)
        if not 0.0 <= self.temperature <= 100.0:
            bad("temperature", "in [0, 100]", self.temperature)
        if not 0.0 < self.top_p <= 1.0:
            bad("top_p", "in (0, 1]", self.top_p)
        if self.top_k < -1 or (vocab_size is not None and self.top_k > vocab_size):
            bad("top_k", f"-1, 0 or in [1, vocab_size={vocab_size}]", self.top_k)
        if not 0.0 <= self.min_p <= 1.0:
            bad("min_p", "in [0, 1]", self.min_p)
        if not 0.0 < self.repetition_penalty <= 10.0:
            bad("repetition_penalty", "in (0, 10]", self.repetition_penalty)
        if not -2.0 <= self.presence_penalty <= 2.0:
            bad("presence_penalty", "in [-2, 2]", self.presence_penalty)
        if not -2.0 <= self.frequency_penalty <= 2.0:
            bad("frequency_penalty", "in [-2, 2]", self.frequency_penalty)
        if self.seed is not None and not 0 <= self.seed < 2**63:
            bad("seed", "in [0, 2**63)", self.seed)
        if len(self.stop) > MAX_STOP_STRINGS:
            bad("stop", f"at most {MAX_STOP_STRINGS} strings", len(self.stop))
        for s in self.stop:
            if not s or len(s) > MAX_STOP_STRING_LEN:
                bad("stop", f"non-empty strings of at most {MAX_STOP_STRING_LEN} chars", s)
        for t in self.stop_token_ids:
            if t < 0 or (vocab_size is not None and t >= vocab_size):
                bad("stop_token_ids", f"in [0, vocab_size={vocab_size})", t)
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            bad("logprobs", f"in [0, {MAX_LOGPROBS}]", self.logprobs)
