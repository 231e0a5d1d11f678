"""The rings of an instance, declared once (`RINGS`), and `Channel`: one end of a ring
speaking its messages.

RINGS is the wiring diagram, one `RingDecl` per ring role: its producer and its consumer
stage; its kind (a single-producer/single-consumer ring; the engine -> workers broadcast ring,
one reader per TP rank; or the worker -> cache messager layer signal, a sequence per layer);
the instance roles that have it; what it carries (tag -> type, ``messages.tags.Tag``); and the
largest message it must carry (from ``runtime.ring_sizes``). The rest is derived from it: the
rings an instance creates (``ring_names``, ``ring_roles``), each ring's codec
(``RING_MESSAGES``) and size (``message_limits``, ``ring_sizes.capacity``), and the consumers
that read several rings, which block on one doorbell shared by them (``SHARED_DOORBELLS``,
``ipc.ring.wait_any``). The gateway creates every ring; stages attach their ends by the names
in their StageSpec. Owns no state.
"""
from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

from pipeline.config import EngineConfig
from pipeline.ipc.broadcast import BroadcastRing
from pipeline.ipc.codec import TaggedCodec
from pipeline.ipc.ring import Ring
from pipeline.messages.answers import RequestDelta, RequestResult
from pipeline.messages.engine_outputs import EngineOutputs, EngineStats
from pipeline.messages.kv import KVFinish, KVReady, TransferPlan, TransferReport
from pipeline.messages.kv_tier import TierPlan, TierReport
from pipeline.messages.requests import (
    MAX_REQUEST_BYTES,
    AbortRequest,
    EngineRequest,
    GatewayRequest,
    OutputRegistration,
)
from pipeline.messages.step import ModelRunnerOutput, SchedulerOutput
from pipeline.messages.tags import Tag
from pipeline.runtime.ring_sizes import KiB, MiB, Sizes
from pipeline.runtime.spec import StageSpec
from pipeline.sampling_params.limits import TRUSTED_DECODE

ROLES = frozenset({"mixed", "prefill", "decode"})  # EngineConfig.role
PREFILL, DECODE = frozenset({"prefill"}), frozenset({"decode"})


@dataclass(frozen=True, slots=True)
class RingDecl:
    name: str  # the ring role: the key of StageSpec.rings and the shared-memory name's tail
    producer: str
    consumer: str  # "worker": every TP rank of this node (the broadcast ring)
    messages: Mapping[int, type]  # tag -> type; empty for the layer signal (no messages)
    limit: Callable[[Sizes], int] | None  # the largest message in bytes; None: layer signal
    kind: Literal["ring", "broadcast", "layer_signal"] = "ring"
    roles: frozenset[str] = ROLES  # the instance roles that create it
    tier: bool = False  # also created by an instance with a KV tier (--kv-offload-dir)
    # False: carries what a client sent, not yet checked by the tokenizer stage.
    trusted: bool = True


RINGS: tuple[RingDecl, ...] = (
    RingDecl("submit", "gateway", "tokenizer",
             {Tag.GATEWAY_REQUEST: GatewayRequest, Tag.ABORT: AbortRequest},
             lambda s: MAX_REQUEST_BYTES, trusted=False),
    # Error answers; the tokenizer stage clips their messages.
    RingDecl("rejects", "tokenizer", "gateway", {Tag.RESULT: RequestResult}, lambda s: 1 * MiB),
    RingDecl("register", "tokenizer", "output", {Tag.REGISTRATION: OutputRegistration},
             lambda s: s.request),
    RingDecl("requests", "tokenizer", "engine",
             {Tag.ENGINE_REQUEST: EngineRequest, Tag.ABORT: AbortRequest}, lambda s: s.request),
    RingDecl("steps", "engine", "worker", {Tag.STEP: SchedulerOutput},
             lambda s: max(16 * MiB, s.request + s.step), kind="broadcast"),
    RingDecl("results", "worker", "engine", {Tag.RUNNER_OUTPUT: ModelRunnerOutput},
             lambda s: s.step),
    RingDecl("outputs", "engine", "output", {Tag.ENGINE_OUTPUTS: EngineOutputs}, lambda s: s.step),
    RingDecl("stops", "output", "engine", {Tag.ABORT: AbortRequest}, lambda s: 512 * KiB),
    RingDecl("answers", "output", "gateway", {Tag.DELTA: RequestDelta, Tag.RESULT: RequestResult},
             lambda s: s.answer),
    RingDecl("stats", "engine", "gateway", {Tag.STATS: EngineStats}, lambda s: 128 * KiB),
    # Disaggregation only. Prefill: the engine's transfer plans and the messager's reports;
    # worker rank 0 publishes each layer's "KV written" on the layer signal, sized by the
    # gateway in layers (every rank's when the ranks share one KV segment, worker.kv_cache).
    # A KV tier (any role): the engine's TierPlans (loads, saves) and the messager's reports,
    # beside a prefill instance's plans and reports on the same two rings.
    RingDecl("kv_plans", "engine", "messager",
             {Tag.TRANSFER_PLAN: TransferPlan, Tag.KV_FINISH: KVFinish, Tag.TIER_PLAN: TierPlan},
             Sizes.kv_plan, roles=PREFILL, tier=True),
    RingDecl("kv_reports", "messager", "engine",
             {Tag.TRANSFER_REPORT: TransferReport, Tag.TIER_REPORT: TierReport},
             lambda s: max(1 * MiB, s.config.scheduler_config.max_num_seqs * 2 * KiB), roles=PREFILL,
             tier=True),
    RingDecl("layers", "worker", "messager", {}, None, kind="layer_signal", roles=PREFILL),
    # Decode: one KVReady per request, its error clipped to 8 KiB.
    RingDecl("kv_ready", "messager", "engine", {Tag.KV_READY: KVReady}, lambda s: 64 * KiB,
             roles=DECODE),
)
BY_NAME = {r.name: r for r in RINGS}
STEPS_ROLE = "steps"  # engine -> every worker rank (broadcast)
LAYERS_ROLE = "layers"  # worker -> cache messager (layer signal), prefill only
# The consumers that read several rings: each parks on one doorbell shared by its rings.
SHARED_DOORBELLS = tuple(c for c, n in Counter(r.consumer for r in RINGS if r.kind == "ring").items()
                         if n > 1)
# ring role -> {tag: message type}: what TaggedCodec encodes and decodes on it.
RING_MESSAGES: dict[str, dict[int, type]] = {r.name: dict(r.messages) for r in RINGS if r.messages}


def _check_role(role: str) -> None:
    if role not in ROLES:
        raise ValueError(f"instance role={role!r} must be one of {sorted(ROLES)}")


def _has(r: RingDecl, role: str, tier: bool) -> bool:
    return role in r.roles or (tier and r.tier)


def ring_names(role: str, tier: bool = False) -> list[str]:
    """Every ring (and the layer signal) an instance of ``role`` (``tier``: with a KV tier)
    creates: StageSpec.rings' keys."""
    _check_role(role)
    return [r.name for r in RINGS if _has(r, role, tier)]


def ring_roles(role: str, tier: bool = False) -> dict[str, tuple[str, str]]:
    """The single-producer/single-consumer rings of an instance of ``role`` (mixed | prefill |
    decode; ``tier``: with a KV tier): ring role -> (producer, consumer)."""
    _check_role(role)
    return {r.name: (r.producer, r.consumer) for r in RINGS if r.kind == "ring" and _has(r, role, tier)}


def message_limits(config: EngineConfig, max_model_len: int, hidden_size: int = 0) -> dict[str, int]:
    """Ring role -> the largest message (bytes) its ring must carry. ``max_model_len`` may be
    an upper bound of the model's (the gateway sizes the rings before the worker says);
    ``hidden_size`` sizes the embeddings a step may carry (0: EMBED_HIDDEN_BOUND)."""
    sizes = Sizes.of(config, max_model_len, hidden_size)
    return {r.name: r.limit(sizes) for r in RINGS if r.limit is not None}


End = Literal["reader", "writer"]


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
        self._decode = _trusted(codec.decode) if BY_NAME[role].trusted else codec.decode

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
