"""How large a ring's messages may be: the bounds every ring size is derived from.

A ring message is at most half the ring (``capacity``). The bounds come from the request
limits (``messages.requests``), the sampling limits (``sampling_params``), max_model_len and
the batch size: ``Sizes`` holds those an instance's rings are sized by, which the ring table
(``runtime.rings.RINGS``) turns into one limit per ring. So a request that passes validation
fits every ring it crosses. Where a request could still outgrow a ring (an answer of many long
completions), the tokenizer stage refuses it up front with ``answer_bytes_bound`` (bound
against the answers ring's limit) instead of a stage failing on send. Owns no state.
"""
from __future__ import annotations

from dataclasses import dataclass

from pipeline.config import EngineConfig
from pipeline.messages.requests import MAX_PROMPT_TOKENS, MAX_REQUEST_BYTES
from pipeline.sampling_params import SamplingParams
from pipeline.sampling_params.limits import (
    ANSWER_FIXED_BYTES,
    COMPLETION_FIXED_BYTES,
    MAX_LOGPROBS,
    MAX_LOGPROBS_BYTES,
    logprob_entry_bytes,
)

KiB, MiB = 1 << 10, 1 << 20
# What the tokenizer stage adds to a request besides its prompt as int32 token ids: the
# model's eos ids and bad words as token sequences (at most 256 x 512 ids).
REQUEST_GROWTH_BYTES = 1 * MiB
# One scheduled sequence in a step's output (worker -> engine -> token processor): its id,
# sampled token, finish/error strings and one logprobs entry.
STEP_BYTES_PER_SEQ = 1 * KiB + logprob_entry_bytes(MAX_LOGPROBS)
# A final answer: what does not grow with its tokens (ANSWER_FIXED_BYTES: ids, usage,
# timings, error message) and per completion (COMPLETION_FIXED_BYTES: stop reason, finish
# reason, headers): in sampling_params.limits, with ``max_tokens_that_fit``, the inverse of
# ``answer_bytes_bound`` here...
# ...and what the answers ring is sized to carry per output token of max_model_len: the
# token id (5), its inter-token latency (9) and its text (at most 242 bytes here; the
# tokenizer stage checks each request against its tokenizer's actual longest token).
ANSWER_BYTES_PER_TOKEN = 256
# A step's embeddings (requests of task "embed" whose prefill ended): hidden_size float32 per
# sequence and its framing; without the model's hidden size, this one bounds it.
EMBED_BYTES_PER_FLOAT = 4
EMBED_FIXED_BYTES = 64
EMBED_HIDDEN_BOUND = 8192
# Beyond this (max_model_len over ~200k) the answers ring stops growing; requests whose
# answer could be larger are refused by the tokenizer stage, naming the limit.
MAX_ANSWER_BYTES = 64 * MiB


def request_bytes(max_model_len: int) -> int:
    """Upper bound of a tokenized request (register, requests and steps rings): what crossed
    the submit ring minus its prompt, the prompt as token ids (validation caps them at
    min(max_model_len - 1, MAX_PROMPT_TOKENS)), and what the tokenizer stage adds."""
    return MAX_REQUEST_BYTES + 4 * min(max_model_len, MAX_PROMPT_TOKENS) + REQUEST_GROWTH_BYTES


def answer_bytes_bound(sp: SamplingParams, num_prompt_tokens: int, token_text_bytes: int) -> int:
    """Upper bound of a request's encoded final answer (the largest message it puts on the
    answers ring; its deltas are parts of it). ``token_text_bytes``: the most text one token
    can add (see ``tokenizer.stage.max_token_text_bytes``).

    Per output token of each completion: its id (at most 5 bytes of msgpack), its text, its
    logprobs entry and an inter-token latency (a float64, 9 bytes); with n > 1 the top-level
    fields repeat completion 0; prompt logprobs add one entry per prompt token."""
    logprob = 0 if sp.logprobs is None else logprob_entry_bytes(sp.logprobs)
    copies = sp.n + 1 if sp.n > 1 else 1
    per_completion = COMPLETION_FIXED_BYTES + sp.max_tokens * (5 + token_text_bytes + logprob)
    prompt = 0 if sp.prompt_logprobs is None else \
        num_prompt_tokens * (1 + logprob_entry_bytes(sp.prompt_logprobs))
    return ANSWER_FIXED_BYTES + copies * per_completion + sp.n * sp.max_tokens * 9 + prompt


@dataclass(frozen=True, slots=True)
class Sizes:
    """What the rings of one instance are sized by: its config, an upper bound of its
    max_model_len, and the three message bounds several rings share."""
    config: EngineConfig
    max_model_len: int
    request: int  # a tokenized request (register, requests, steps)
    step: int  # a step's output (results, outputs, steps)
    answer: int  # a final answer (answers)

    @classmethod
    def of(cls, config: EngineConfig, max_model_len: int, hidden_size: int = 0) -> Sizes:
        # At least 4 MiB: the engine also reports aborted waiting requests in one message.
        # Every sequence of a step may be an embedding request whose prefill ends in it.
        embed = EMBED_FIXED_BYTES + EMBED_BYTES_PER_FLOAT * (hidden_size or EMBED_HIDDEN_BOUND)
        step = max(4 * MiB, config.scheduler_config.max_num_seqs * (STEP_BYTES_PER_SEQ + embed)
                   + config.scheduler_config.max_num_batched_tokens * logprob_entry_bytes(MAX_LOGPROBS))
        # Logprobs: the sampled ones of every completion, their copy in the top-level fields
        # (n > 1) and the prompt's, each capped at MAX_LOGPROBS_BYTES by SamplingParams.
        # (An embedding answer, at most 9 bytes per float as msgpack float64s, is far below.)
        answer = min(MAX_ANSWER_BYTES, ANSWER_FIXED_BYTES + 3 * MAX_LOGPROBS_BYTES
                     + max_model_len * ANSWER_BYTES_PER_TOKEN)
        return cls(config, max_model_len, request_bytes(max_model_len), step, answer)

    def kv_plan(self) -> int:
        """A transfer plan: per scheduled request its (local, remote) block pairs, 8 bytes
        each (the engine refuses a plan over this, failing the requests it names)."""
        c = self.config
        sc = c.scheduler_config
        return max(4 * MiB, sc.max_num_seqs * KiB + 8 * (
            sc.max_num_batched_tokens + sc.max_num_seqs * (self.max_model_len // 16 + 2)))


def capacity(limit: int) -> int:
    """The ring size whose messages may be ``limit`` bytes: twice it, in 64-byte units."""
    return -(-2 * limit // 64) * 64
