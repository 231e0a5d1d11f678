"""Transport message codec (every stage): typed msgspec structs as msgpack bytes.

Token id arrays travel inside the structs as raw little-endian int32 `bytes` fields
(`pipeline.engine.sched_output.ids_to_bytes`), which msgpack carries as one bin blob.
`pipeline bench ipc` measures this codec against pickle on the engine's messages; msgspec
msgpack won there (see docs/benchmarks.md), so it is the one every ring uses.
State: one shared encoder and one cached decoder per message type (both are reentrant).
"""
from __future__ import annotations

from typing import Any, TypeVar

import msgspec

T = TypeVar("T")

_encoder = msgspec.msgpack.Encoder()
_decoders: dict[Any, msgspec.msgpack.Decoder] = {}


def encode(obj: Any) -> bytes:
    return _encoder.encode(obj)


def decode(data: bytes | memoryview, type: type[T]) -> T:
    """Decode `data` as `type`; a mismatch raises msgspec.ValidationError naming the field."""
    dec = _decoders.get(type)
    if dec is None:
        dec = _decoders[type] = msgspec.msgpack.Decoder(type)
    return dec.decode(data)
