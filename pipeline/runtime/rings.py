"""The ring roles of an instance, their sizes, and `Channel`: one end of a ring speaking its
messages.

RING_ROLES is the wiring diagram: for each single-producer/single-consumer ring, its producer
and its consumer. The engine -> workers step ring is a broadcast ring (one reader per TP
rank). A consumer that reads several rings blocks on one doorbell shared by them
(``SHARED_DOORBELLS``, ``ipc.ring.wait_any``). The gateway creates every ring; stages attach
their ends by the names in their StageSpec. Owns no state.

Sizes: a ring message is at most half the ring. ``message_limits`` says, per role, the
largest message the ring must carry, derived from the request limits
(``messages.requests``), the sampling limits (``sampling_params``), max_model_len and the
batch size; ``capacity`` turns a limit into a ring size. So a request that passes validation
fits every ring it crosses. Where a request could still outgrow a ring (an answer of many
long completions), the tokenizer stage refuses it up front with ``answer_bytes_bound``
(bound against ``message_limits(...)["answers"]``) instead of a stage failing on send.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal

from pipeline.config import EngineConfig
from pipeline.ipc.broadcast import BroadcastRing
from pipeline.ipc.codec import TaggedCodec
from pipeline.ipc.ring import Ring
from pipeline.messages import RING_MESSAGES
from pipeline.messages.requests import MAX_PROMPT_TOKENS, MAX_REQUEST_BYTES
from pipeline.runtime.spec import StageSpec
from pipeline.sampling_params import (
    MAX_LOGPROBS,
    MAX_LOGPROBS_BYTES,
    TRUSTED_DECODE,
    SamplingParams,
    logprob_entry_bytes,
)

KiB, MiB = 1 << 10, 1 << 20
# role -> (producer, consumer)
RING_ROLES: dict[str, tuple[str, str]] = {
    "submit": ("gateway", "tokenizer"),
    "rejects": ("tokenizer", "gateway"),
    "register": ("tokenizer", "output"),
    "requests": ("tokenizer", "engine"),
    "results": ("worker", "engine"),
    "outputs": ("engine", "output"),
    "stops": ("output", "engine"),
    "answers": ("output", "gateway"),
    "stats": ("engine", "gateway"),
    # Disaggregation only: created for the roles that use them (``PD_RINGS``).
    "kv_plans": ("engine", "messager"),
    "kv_reports": ("messager", "engine"),
    "kv_ready": ("messager", "engine"),
}
# Instance role -> the rings of RING_ROLES it creates beyond the mixed role's.
PD_RINGS: dict[str, tuple[str, ...]] = {"mixed": (), "prefill": ("kv_plans", "kv_reports"),
                                        "decode": ("kv_ready",)}
SHARED_DOORBELLS = ("gateway", "engine", "output")
STEPS_ROLE = "steps"  # engine -> every worker rank (broadcast)

# What the tokenizer stage adds to a request besides its prompt as int32 token ids: the
# model's eos ids and bad words as token sequences (at most 256 x 512 ids).
REQUEST_GROWTH_BYTES = 1 * MiB
# One scheduled sequence in a step's output (worker -> engine -> token processor): its id,
# sampled token, finish/error strings and one logprobs entry.
STEP_BYTES_PER_SEQ = 1 * KiB + logprob_entry_bytes(MAX_LOGPROBS)
# A final answer: what does not grow with its tokens (ids, usage, timings, error message) and
# per completion (stop reason, finish reason, headers)...
ANSWER_FIXED_BYTES = 64 * KiB
COMPLETION_FIXED_BYTES = 1 * KiB
# ...and what the answers ring is sized to carry per output token of max_model_len: the
# token id (5), its inter-token latency (9) and its text (at most 242 bytes here; the
# tokenizer stage checks each request against its tokenizer's actual longest token).
ANSWER_BYTES_PER_TOKEN = 256
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


def message_limits(config: EngineConfig, max_model_len: int) -> dict[str, int]:
    """Role -> the largest message (bytes) its ring must carry. ``max_model_len`` may be an
    upper bound of the model's (the gateway sizes the rings before the worker says)."""
    request = request_bytes(max_model_len)
    # At least 4 MiB: the engine also reports aborted waiting requests in one message.
    step = max(4 * MiB, config.max_num_seqs * STEP_BYTES_PER_SEQ
               + config.max_num_batched_tokens * logprob_entry_bytes(MAX_LOGPROBS))
    # Logprobs: the sampled ones of every completion, their copy in the top-level fields
    # (n > 1) and the prompt's, each capped at MAX_LOGPROBS_BYTES by SamplingParams.
    answer = min(MAX_ANSWER_BYTES, ANSWER_FIXED_BYTES + 3 * MAX_LOGPROBS_BYTES
                 + max_model_len * ANSWER_BYTES_PER_TOKEN)
    return {
        "submit": MAX_REQUEST_BYTES,
        "rejects": 1 * MiB,  # error answers; the tokenizer stage clips their messages
        "register": request,
        "requests": request,
        "results": step,
        "outputs": step,
        "stops": 512 * KiB,
        "answers": answer,
        "stats": 128 * KiB,
        # A plan: per scheduled request its (local, remote) block pairs, 8 bytes each (the
        # engine refuses a plan over this, failing the requests it names).
        "kv_plans": max(4 * MiB, config.max_num_seqs * KiB + 8 * (
            config.max_num_batched_tokens + config.max_num_seqs * (max_model_len // 16 + 2))),
        "kv_reports": max(1 * MiB, config.max_num_seqs * 2 * KiB),
        "kv_ready": 64 * KiB,  # one KVReady, its error clipped to 8 KiB
        STEPS_ROLE: max(16 * MiB, request + step),
    }


def ring_roles(role: str) -> dict[str, tuple[str, str]]:
    """The rings an instance of ``role`` (mixed | prefill | decode) creates."""
    skip = {r for rs in PD_RINGS.values() for r in rs} - set(PD_RINGS[role])
    return {k: v for k, v in RING_ROLES.items() if k not in skip}


def capacity(limit: int) -> int:
    """The ring size whose messages may be ``limit`` bytes: twice it, in 64-byte units."""
    return -(-2 * limit // 64) * 64


End = Literal["reader", "writer"]


# Rings whose messages carry what a client sent, not yet checked by the tokenizer stage.
UNTRUSTED_ROLES = frozenset({"submit"})


def _trusted(decode: Callable[[Any], Any]) -> Callable[[Any], Any]:
    def trusted_decode(buf: Any) -> Any:
        TRUSTED_DECODE.on = True
        try:
            return decode(buf)
        finally:
            TRUSTED_DECODE.on = False
    return trusted_decode


class Channel:
    """A ring end plus the codec of the role it plays: send and receive structs, not bytes.

    ``ring`` is the underlying Ring/BroadcastRing (for ``wait_any`` and ``close``)."""
    __slots__ = ("ring", "role", "_encode", "_decode")

    def __init__(self, ring: Ring | BroadcastRing, role: str) -> None:
        codec = TaggedCodec(RING_MESSAGES[role])
        self.ring, self.role = ring, role
        self._encode = codec.encode
        # Past the submit ring a request's SamplingParams were checked (sampling_params.
        # TRUSTED_DECODE): only the gateway's messages are decoded with every check.
        self._decode = codec.decode if role in UNTRUSTED_ROLES else _trusted(codec.decode)

    @property
    def max_message_bytes(self) -> int:
        """The largest encoded message this ring takes (half its capacity)."""
        return self.ring.capacity // 2

    def send(self, msg: Any, timeout: float | None = None) -> None:
        """Blocks while the ring is full (back-pressure); PeerDied if its reader died."""
        self.ring.send(self._encode(msg), timeout)

    def encode(self, msg: Any) -> bytearray:
        """``msg`` as this ring carries it: to check its size before ``send_encoded``."""
        return self._encode(msg)

    def send_encoded(self, buf: bytes | bytearray, timeout: float | None = None) -> None:
        self.ring.send(buf, timeout)

    def recv(self, timeout: float | None = None) -> Any:
        return self._decode(self.ring.recv(timeout))

    def try_recv(self) -> Any:
        buf = self.ring.try_recv()
        return None if buf is None else self._decode(buf)

    def close(self) -> None:
        self.ring.close()


def attach(spec: StageSpec, role: str, end: End = "reader") -> Channel:
    """This stage's `end` of ring `role` (for the step ring, a reader attaches as its rank)."""
    name = spec.rings[role]
    if role == STEPS_ROLE:
        ring: Ring | BroadcastRing = (BroadcastRing.attach_writer(name) if end == "writer"
                                      else BroadcastRing.attach(name, spec.rank))
    else:
        ring = Ring.attach(name, end)
    return Channel(ring, role)
