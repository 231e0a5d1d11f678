"""vLLM's prompt types (``vllm.inputs``): ``TextPrompt`` and ``TokensPrompt``, the dicts
``LLM.generate`` takes, typed for the caller's checker; at run time they are plain dicts, read
by ``llm_prompts``. Owns no state.
"""
from __future__ import annotations

from typing import Any, TypedDict


class _Text(TypedDict):
    prompt: str


class _Tokens(TypedDict):
    prompt_token_ids: list[int]


# The optional keys by total=False (typing.NotRequired needs Python 3.11; we run on 3.10).
class TextPrompt(_Text, total=False):
    """A text prompt, tokenized by the model's tokenizer."""
    multi_modal_data: Any  # refused: text-only models
    mm_processor_kwargs: dict[str, Any]  # refused with it
    cache_salt: str


class TokensPrompt(_Tokens, total=False):
    """A prompt of token ids, given as they are."""
    multi_modal_data: Any
    mm_processor_kwargs: dict[str, Any]
    cache_salt: str


# What generate takes for one prompt (vLLM's ``PromptType``).
PromptType = str | TextPrompt | TokensPrompt | list[int]

__all__ = ["PromptType", "TextPrompt", "TokensPrompt"]
