"""The one request validator: every way in (ZMQ, pipe mode, in-process `LLM`) passes here.

The gateway only decodes (types) and checks the byte limits of the transport
(``check_prompt_text`` / ``check_messages_bytes`` here, then the whole encoded request);
whatever needs the model's limits (vocab size, max_model_len) is checked here, once the
prompt is token ids: by the tokenizer stage for served requests, by `LLM.generate`
in-process. Every error is an `InvalidRequest` whose message names the field and the limit.
What only the engine can know (whether the request fits in the KV cache at all) stays with
the engine. Owns no state.

Prompt length and max_tokens, one rule: a prompt takes at most max_model_len - 1 tokens (at
least one output token must fit) and at most MAX_PROMPT_TOKENS; max_tokens is then cut to the
room left (max_model_len - prompt tokens), as vLLM's engine does, so such a request ends with
finish_reason "length" at max_model_len. ``min_tokens`` is a promise, so a request whose
min_tokens does not fit is refused. An embedding request (task "embed") outputs no token: its
prompt may take all of max_model_len, and of its sampling fields only
``truncate_prompt_tokens`` counts (``embed_params``).
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import msgspec
import numpy as np

from pipeline.messages.kv import KVTransferParams
from pipeline.messages.requests import MAX_PROMPT_BYTES, MAX_PROMPT_TOKENS
from pipeline.runtime.ring_sizes import answer_bytes_bound
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
    """A text prompt is at most MAX_PROMPT_BYTES of UTF-8."""
    # A char is 1..4 bytes: only the middle needs the (copying) encode.
    if len(text) * 4 <= MAX_PROMPT_BYTES:
        return
    size = len(text.encode("utf-8", "surrogatepass"))
    if size > MAX_PROMPT_BYTES:
        raise InvalidRequest(f"field `prompt`: {size} bytes (UTF-8), the limit is "
                             f"{MAX_PROMPT_BYTES} bytes")


def check_messages_bytes(messages: list[dict[str, Any]]) -> None:
    """A chat's messages together are at most MAX_PROMPT_BYTES, encoded as they travel."""
    size = len(msgspec.msgpack.encode(messages))
    if size > MAX_PROMPT_BYTES:
        raise InvalidRequest(f"field `messages`: {len(messages)} messages of {size} bytes "
                             f"together (encoded), the limit is {MAX_PROMPT_BYTES} bytes")


def check_sampling(sp: SamplingParams, vocab_size: int, max_model_len: int,
                   num_prompt_tokens: int | None = None) -> None:
    try:
        sp.validate(vocab_size=vocab_size, max_model_len=max_model_len,
                    num_prompt_tokens=num_prompt_tokens)
    except ValueError as exc:  # "<field> must be <limit>, got <value>"
        name, _, rest = str(exc).partition(" ")
        raise InvalidRequest(f"field `{name}`: {rest}") from None


def max_prompt_tokens(max_model_len: int) -> int:
    return min(max_model_len - 1, MAX_PROMPT_TOKENS)


def embed_params(sp: SamplingParams) -> SamplingParams:
    """What an embedding request runs with: it samples nothing, so nothing but
    ``truncate_prompt_tokens`` (-1: the last max_model_len - 1 tokens) carries over."""
    return SamplingParams(max_tokens=1, truncate_prompt_tokens=sp.truncate_prompt_tokens)


def check_prompt_ids(ids: Sequence[int], field: str, vocab_size: int, max_model_len: int,
                     embed: bool = False) -> None:
    n = len(ids)
    if n == 0:
        raise InvalidRequest(f"field `{field}`: must not be empty")
    limit = min(max_model_len, MAX_PROMPT_TOKENS) if embed else max_prompt_tokens(max_model_len)
    if n > limit:
        why = (f"max_model_len ({max_model_len})" if embed and limit < MAX_PROMPT_TOKENS
               else f"max_model_len ({max_model_len}) minus one, to leave room for output"
               if limit < MAX_PROMPT_TOKENS else f"MAX_PROMPT_TOKENS ({MAX_PROMPT_TOKENS})")
        raise InvalidRequest(f"field `{field}`: {n} tokens, at most {limit} ({why})")
    arr = np.asarray(ids, dtype=np.int64)
    bad = np.flatnonzero((arr < 0) | (arr >= vocab_size))
    if bad.size:
        i = int(bad[0])
        where = f"{field}[{i}]" if field == "prompt_token_ids" else field
        raise InvalidRequest(f"field `{where}`: token ids must be in [0, vocab_size={vocab_size}), "
                             f"got {int(arr[i])}")


def validate_request(ids: Sequence[int], sp: SamplingParams, *, field: str, vocab_size: int,
                     max_model_len: int, embed: bool = False) -> SamplingParams:
    """All of a request's checks, given its prompt as token ids (`field`: where they came
    from); returns the params to run it with (max_tokens cut to the room left)."""
    check_sampling(sp, vocab_size, max_model_len, len(ids))
    check_prompt_ids(ids, field, vocab_size, max_model_len, embed)
    if embed:
        return sp
    room = max_model_len - len(ids)
    if sp.max_tokens <= room:
        return sp
    if sp.min_tokens > room:
        raise InvalidRequest(f"field `min_tokens`: {sp.min_tokens}, but only {room} tokens fit "
                             f"after the {len(ids)}-token prompt (max_model_len {max_model_len})")
    return msgspec.structs.replace(sp, max_tokens=room)


def check_answer_fits(sp: SamplingParams, num_prompt_tokens: int, token_text_bytes: int,
                      limit: int) -> None:
    """The request's final answer, at its largest, fits one message of ``limit`` bytes (the
    answers ring's); else name what makes it large."""
    size = answer_bytes_bound(sp, num_prompt_tokens, token_text_bytes)
    if size > limit:
        parts = [f"n={sp.n}"] if sp.n > 1 else []
        parts += [f"max_tokens={sp.max_tokens}"]
        parts += [f"logprobs={sp.logprobs}"] if sp.logprobs is not None else []
        parts += [f"prompt_logprobs={sp.prompt_logprobs}"] if sp.prompt_logprobs is not None else []
        raise InvalidRequest(
            f"field `max_tokens`: an answer with {', '.join(parts)} may take up to {size} bytes "
            f"({token_text_bytes} bytes of text per token at most with this tokenizer), more "
            f"than the limit of {limit} bytes per answer; lower {' or '.join(p.split('=')[0] for p in parts)}")


def prepare_request(ids: list[int], sp: SamplingParams, *, field: str, vocab_size: int,
                    max_model_len: int, encode: Callable[[str], list[int]] | None,
                    embed: bool = False) -> tuple[list[int], SamplingParams]:
    """Once a prompt is token ids, the one sequence every way in runs (the tokenizer stage
    and the in-process LLM): keep its last ``truncate_prompt_tokens``, tokenize ``bad_words``
    (``encode``: the tokenizer without special tokens; None when there is none), then every
    check. Returns the prompt and the params to run it with (``embed``: an embedding
    request's, ``embed_params``)."""
    if embed:
        sp = embed_params(sp)
    ids = sp.truncate_prompt(ids, max_model_len)
    if sp.bad_words:
        if encode is None:
            raise InvalidRequest("field `bad_words`: needs a tokenizer (give bad_words_token_ids)")
        sp = sp.resolve_bad_words(encode)
    return ids, validate_request(ids, sp, field=field, vocab_size=vocab_size,
                                 max_model_len=max_model_len, embed=embed)


def check_kv_transfer(kv: KVTransferParams | None, role: str, *, num_prompt_tokens: int,
                      sp: SamplingParams, stream: bool, block_size: int) -> None:
    """A disaggregated request (``kv_transfer``, set by `pipeline router`) against this
    instance's role: a mixed instance refuses it; a decode instance takes role "decode", a
    prefill instance role "prefill" with a block table that covers exactly the prompt."""
    if kv is None:
        return
    if kv.role != role:
        raise InvalidRequest(f"field `kv_transfer.role`: {kv.role!r} on an instance of role "
                             f"{role!r} (only `pipeline router` sets kv_transfer, on prefill/decode "
                             "instances)")
    if sp.n != 1 or sp.prompt_logprobs is not None:
        raise InvalidRequest("field `kv_transfer`: a disaggregated request has n=1 and no "
                             "prompt_logprobs (the router runs other requests on one instance)")
    if role == "decode":
        if not stream:
            raise InvalidRequest("field `stream`: a kv_transfer decode request must stream (its "
                                 "reservation comes back in a delta)")
        return
    need = -(-num_prompt_tokens // block_size)
    if len(kv.remote_block_ids) != need:
        raise InvalidRequest(f"field `kv_transfer.remote_block_ids`: {len(kv.remote_block_ids)} "
                             f"blocks, the prompt's {num_prompt_tokens} tokens need {need} of "
                             f"{block_size}")
    cached = kv.remote_num_cached_tokens
    if cached % block_size or cached >= num_prompt_tokens:
        raise InvalidRequest(f"field `kv_transfer.remote_num_cached_tokens`: {cached} must be a "
                             f"multiple of {block_size} below the prompt's {num_prompt_tokens} tokens")
    if not kv.peer.startswith(("tcp://", "ipc://")) or not kv.remote_req_id:
        raise InvalidRequest("field `kv_transfer.peer`/`remote_req_id`: a prefill request needs "
                             "the decode instance's KV endpoint (tcp:// or ipc://) and its request id")
