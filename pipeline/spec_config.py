"""Speculative decoding's configuration (``--speculative-config JSON``,
``LLM(speculative_config={...})``), with vLLM's names (docs/speculative.md).

``SpeculativeConfig.parse`` takes the JSON text or a dict and checks every field, naming it
and its limit; an unknown key is refused (a misspelled one would otherwise silently do
nothing). Owns no state.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import msgspec

METHODS = ("ngram", "suffix", "draft_model")
MAX_SPECULATIVE_TOKENS = 16  # drafts per step: the verify step computes K + 1 positions
MAX_PATTERN = 64  # n-gram lengths and the suffix index's depth
MAX_CONFIG_BYTES = 4096


class SpeculativeConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    method: str = "ngram"
    num_speculative_tokens: int = 0  # K: required
    # ngram: the longest and shortest tail of the sequence looked up earlier in it (vLLM:
    # when one is given the other defaults to it, when neither both are 5).
    prompt_lookup_min: int = 0
    prompt_lookup_max: int = 0
    # draft_model: its checkpoint (same tokenizer as the target).
    model: str = ""
    # suffix: the index's depth (longest pattern matched), the finished requests whose outputs
    # it keeps, how many drafts a match of length m may give (m * factor), and the lowest
    # empirical probability of a drafted token.
    suffix_decoding_max_tree_depth: int = 24
    suffix_decoding_max_cached_requests: int = 10000
    suffix_decoding_max_spec_factor: float = 1.0
    suffix_decoding_min_token_prob: float = 0.1
    # Draft only the positions that pay at this machine's measured price of a token and of a
    # proposal (engine.spec_decode); false: up to K always (the per-request adaptation stays).
    cost_aware: bool = True

    @classmethod
    def parse(cls, v: str | dict[str, Any] | SpeculativeConfig) -> SpeculativeConfig:
        """From ``--speculative-config``'s JSON text, a dict or itself; ValueError naming the
        field and its limit."""
        if isinstance(v, SpeculativeConfig):
            cfg = v
        else:
            if isinstance(v, str):
                if len(v.encode("utf-8", "surrogatepass")) > MAX_CONFIG_BYTES:
                    raise ValueError(f"--speculative-config: at most {MAX_CONFIG_BYTES} bytes")
                try:
                    v = json.loads(v)
                except json.JSONDecodeError as e:
                    raise ValueError(f"--speculative-config is not JSON: {e}") from None
            if not isinstance(v, dict):
                raise ValueError("--speculative-config must be a JSON object, e.g. "
                                 '{"method": "ngram", "num_speculative_tokens": 4}')
            try:
                cfg = msgspec.convert(v, cls)
            except msgspec.ValidationError as e:
                raise ValueError(f"--speculative-config: {e}") from None
        cfg.check()
        return cfg

    def check(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"--speculative-config method must be one of {', '.join(METHODS)}, "
                             f"got {self.method!r}")
        if not 1 <= self.num_speculative_tokens <= MAX_SPECULATIVE_TOKENS:
            raise ValueError(f"--speculative-config num_speculative_tokens must be in "
                             f"[1, {MAX_SPECULATIVE_TOKENS}], got {self.num_speculative_tokens}")
        if self.method == "ngram":
            lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
            if not lo and not hi:
                self.prompt_lookup_min = self.prompt_lookup_max = 5
            elif not lo:
                self.prompt_lookup_min = hi
            elif not hi:
                self.prompt_lookup_max = lo
            if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max <= MAX_PATTERN:
                raise ValueError(f"--speculative-config needs 1 <= prompt_lookup_min <= "
                                 f"prompt_lookup_max <= {MAX_PATTERN}, got {self.prompt_lookup_min} "
                                 f"and {self.prompt_lookup_max}")
        if self.method == "draft_model" and not self.model:
            raise ValueError('--speculative-config method "draft_model" needs "model": the draft '
                             "checkpoint's directory")
        if self.method == "draft_model" and not (Path(self.model) / "config.json").is_file():
            raise ValueError(f'--speculative-config "model": {self.model} is not a checkpoint '
                             f"directory (no config.json)")
        if self.method != "draft_model" and self.model:
            raise ValueError(f'--speculative-config "model" is for method "draft_model", not '
                             f"{self.method!r}")
        if not 1 <= self.suffix_decoding_max_tree_depth <= MAX_PATTERN:
            raise ValueError(f"--speculative-config suffix_decoding_max_tree_depth must be in "
                             f"[1, {MAX_PATTERN}], got {self.suffix_decoding_max_tree_depth}")
        if not 0 <= self.suffix_decoding_max_cached_requests <= 1 << 20:
            raise ValueError(f"--speculative-config suffix_decoding_max_cached_requests must be in "
                             f"[0, {1 << 20}], got {self.suffix_decoding_max_cached_requests}")
        if not 0.0 < self.suffix_decoding_max_spec_factor <= 64.0:
            raise ValueError(f"--speculative-config suffix_decoding_max_spec_factor must be in "
                             f"(0, 64], got {self.suffix_decoding_max_spec_factor}")
        if not 0.0 <= self.suffix_decoding_min_token_prob <= 1.0:
            raise ValueError(f"--speculative-config suffix_decoding_min_token_prob must be in "
                             f"[0, 1], got {self.suffix_decoding_min_token_prob}")
