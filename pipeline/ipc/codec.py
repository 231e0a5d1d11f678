"""Transport message codec (every stage): one tag byte, then a msgspec struct as msgpack.

A `TaggedCodec` is built from one ring's tag -> type map (``pipeline.runtime.rings.RING_MESSAGES``)
and encodes/decodes exactly the types that ring may carry; an unknown tag or a payload that
does not match its tag's type raises instead of decoding garbage. Token id arrays travel
inside the structs as raw little-endian int32 ``bytes`` fields, which msgpack carries as one
bin blob. `pipeline bench ipc` measures this codec against pickle on the engine's messages;
msgspec msgpack won there (see docs/benchmarks.md), so it is the one every ring uses.
State: one shared encoder; per codec, one decoder per tag (all reentrant).
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import msgspec

_encoder = msgspec.msgpack.Encoder()


class TaggedCodec:
    def __init__(self, types: Mapping[int, type]) -> None:
        if not types or any(not 0 <= int(t) < 256 for t in types):
            raise ValueError(f"tags must be 0..255, got {sorted(map(int, types))}")
        self._tags = {cls: int(tag) for tag, cls in types.items()}
        self._decoders: list[msgspec.msgpack.Decoder | None] = [None] * 256
        for tag, cls in types.items():
            self._decoders[int(tag)] = msgspec.msgpack.Decoder(cls)

    def encode(self, obj: Any) -> bytearray:
        tag = self._tags.get(type(obj))
        if tag is None:
            raise TypeError(f"{type(obj).__name__} is not carried here "
                            f"(only {', '.join(c.__name__ for c in self._tags)})")
        buf = bytearray(1)
        buf[0] = tag
        _encoder.encode_into(obj, buf, 1)
        return buf

    def decode(self, data: bytes | bytearray | memoryview) -> Any:
        """The struct `data` holds; ValueError for an unknown tag, msgspec.ValidationError
        (naming the field) for a payload that is not its tag's type."""
        mv = memoryview(data)
        if not len(mv):
            raise ValueError("empty message")
        dec = self._decoders[mv[0]]
        if dec is None:
            raise ValueError(f"unknown message tag {mv[0]}")
        return dec.decode(mv[1:])
