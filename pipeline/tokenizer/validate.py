"""The one request validator: every way in (ZMQ, pipe mode, in-process `LLM`) passes here.

The gateway only decodes (types, transport bounds); whatever needs the model's limits
(vocab size, max_model_len) is checked here, once the prompt is token ids: by the
tokenizer stage for served requests, by `LLM.generate` in-process. Every error is an
`InvalidRequest` whose message names the field and the limit. What only the engine can
know (whether the request fits in the KV cache at all) stays with the engine. Owns no state.
"""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from pipeline.messages import MAX_PROMPT_CHARS
from pipeline.sampling_params import SamplingParams

PROMPT_FIELDS = ("prompt", "prompt_token_ids", "messages")


class InvalidRequest(ValueError):
    """A request that cannot be served as sent; the message names the field and the limit."""


def one_prompt_field(**given: object) -> str:
    """The name of the one prompt field set among prompt / prompt_token_ids / messages."""
    names = [f for f in PROMPT_FIELDS if given.get(f) is not None]
    if len(names) != 1:
        raise InvalidRequest("exactly one of `prompt`, `prompt_token_ids`, `messages` must be "
                             f"given, got {names or 'none'}")
    return names[0]


def check_prompt_text(text: str) -> None:
    if len(text) > MAX_PROMPT_CHARS:
        raise InvalidRequest(f"field `prompt`: at most {MAX_PROMPT_CHARS} characters, "
                             f"got {len(text)}")


def check_sampling(sp: SamplingParams, vocab_size: int, max_model_len: int) -> None:
    try:
        sp.validate(vocab_size=vocab_size, max_model_len=max_model_len)
    except ValueError as exc:  # "<field> must be <limit>, got <value>"
        name, _, rest = str(exc).partition(" ")
        raise InvalidRequest(f"field `{name}`: {rest}") from None


def check_prompt_ids(ids: Sequence[int], field: str, vocab_size: int, max_model_len: int) -> None:
    n = len(ids)
    if n == 0:
        raise InvalidRequest(f"field `{field}`: must not be empty")
    if n >= max_model_len:
        raise InvalidRequest(f"field `{field}`: {n} tokens, must be < max_model_len "
                             f"({max_model_len}) to leave room for output")
    arr = np.asarray(ids, dtype=np.int64)
    bad = np.flatnonzero((arr < 0) | (arr >= vocab_size))
    if bad.size:
        i = int(bad[0])
        where = f"{field}[{i}]" if field == "prompt_token_ids" else field
        raise InvalidRequest(f"field `{where}`: token ids must be in [0, vocab_size={vocab_size}), "
                             f"got {int(arr[i])}")


def validate_request(ids: Sequence[int], sp: SamplingParams, *, field: str, vocab_size: int,
                     max_model_len: int) -> None:
    """All of a request's checks, given its prompt as token ids (`field`: where they came from)."""
    check_sampling(sp, vocab_size, max_model_len)
    check_prompt_ids(ids, field, vocab_size, max_model_len)
    need = len(ids) + sp.max_tokens
    if need > max_model_len:
        raise InvalidRequest(f"field `max_tokens`: {len(ids)} prompt tokens + max_tokens "
                             f"{sp.max_tokens} = {need} exceeds max_model_len ({max_model_len})")
