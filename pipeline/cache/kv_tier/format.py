"""KV disk tier: the file format of one block, and the names files and namespaces get.

Owns the header layout (``Header``, ``pack_header``, ``parse_header``, ``HeaderCheck``), the key's normal
form (``key_bytes``); the namespace of a layout is ``KVLayout.tier_namespace``. Owns no state.

A file is ``header | payload``. The header, little-endian::

    magic "PLKVBLK\\0" | version u32 | header_len u32 | namespace 16s | key_len u32 |
    key 64s | num_layers u32 | block_size u32 | num_kv_heads u32 | head_dim u32 |
    dtype 16s | block_bytes u64 | payload_len u64 | row checksums (2 * num_layers) u32 |
    header crc32 u32 | zero padding to a multiple of 64

The payload is the block's rows layer-major, ``[num_layers][K, V][block_bytes]``, so a layer
range is one contiguous range of the file. Each row has its own checksum
(``pipeline._ext.kv_io.checksum``: CRC-32C over four stripes), so a layer range is verified
without reading the rest. The namespace is a digest of the fields two instances must share
(``KVLayout.MUST_MATCH``, ``block_bytes``): instances of different models or layouts on one
directory never see each other's files, and a file moved under another namespace's name is
refused by its header.
"""
from __future__ import annotations

import struct
import zlib
from dataclasses import dataclass

from pipeline.messages.kv_layout import KVLayout

MAGIC = b"PLKVBLK\0"
VERSION = 1
MAX_KEY = 64
_FIXED = struct.Struct("<8sII16sI64sIIII16sQQ")
_ALIGN = 64


def key_bytes(key: bytes | int) -> bytes:
    """The normal form of a block key: the prefix cache's chained hash (bytes, as
    ``KVCacheManager`` makes them) or an int hash (vLLM style) as 16 big-endian bytes."""
    if isinstance(key, int) and not isinstance(key, bool):
        if not 0 <= key < 1 << 128:
            raise ValueError(f"block key int {key} must be in [0, 2**128)")
        return key.to_bytes(16, "big")
    if isinstance(key, (bytes, bytearray, memoryview)):
        b = bytes(key)
        if not 1 <= len(b) <= MAX_KEY:
            raise ValueError(f"block key is {len(b)} bytes, must be 1..{MAX_KEY}")
        return b
    raise TypeError(f"block key must be bytes or int, got {type(key).__name__}")


def header_len(layout: KVLayout) -> int:
    n = _FIXED.size + 4 * 2 * layout.num_layers + 4
    return -(-n // _ALIGN) * _ALIGN


def file_len(layout: KVLayout) -> int:
    return header_len(layout) + layout.bytes_per_block


def _fixed(layout: KVLayout, ns: bytes, key: bytes, hl: int) -> bytes:
    return _FIXED.pack(MAGIC, VERSION, hl, ns, len(key), key, layout.num_layers,
                       layout.block_size, layout.num_kv_heads, layout.head_dim,
                       layout.dtype.encode(), layout.block_bytes, layout.bytes_per_block)


def pack_header(layout: KVLayout, ns: bytes, key: bytes, row_crcs: bytes) -> bytes:
    """The header of ``key``'s file; ``row_crcs``: the 2 * num_layers u32 checksums."""
    hl = header_len(layout)
    body = _fixed(layout, ns, key, hl) + row_crcs
    return (body + struct.pack("<I", zlib.crc32(body))).ljust(hl, b"\0")


class HeaderCheck:
    """``parse_header`` for one layout and namespace with its key-independent bytes packed
    once: the per-block check of a chain's loads (DiskTier.load_chain). ``row_crcs(raw,
    key)``: the header's row checksums (bytes, u32 each), or None where ``parse_header``
    would give None."""

    # _FIXED's offsets: magic..namespace, then key_len and key, then the layout fields.
    _KEY_AT, _KEY_END = 32, 100

    def __init__(self, layout: KVLayout, ns: bytes) -> None:
        self.header_len = hl = header_len(layout)
        sample = _fixed(layout, ns, b"\0", hl)
        self._head, self._tail = sample[:self._KEY_AT], sample[self._KEY_END:]
        self._end = _FIXED.size + 8 * layout.num_layers
        self._key = struct.Struct("<I64s")

    def row_crcs(self, raw: memoryview, key: bytes) -> memoryview | None:
        end = self._end
        if (len(raw) < self.header_len or raw[:self._KEY_AT] != self._head
                or raw[self._KEY_END:_FIXED.size] != self._tail
                or raw[self._KEY_AT:self._KEY_END] != self._key.pack(len(key), key)
                or zlib.crc32(raw[:end]) != int.from_bytes(raw[end:end + 4], "little")):
            return None
        return raw[_FIXED.size:end]


@dataclass(frozen=True, slots=True)
class Header:
    row_crcs: memoryview  # u32 per row, layer-major
    header_len: int


def parse_header(raw: bytes | memoryview, layout: KVLayout, ns: bytes, key: bytes) -> Header | None:
    """The header if ``raw`` is a valid header of ``key``'s block in this layout, else None
    (wrong magic, version, namespace, key or field, a bad header crc, a short read)."""
    hl = header_len(layout)
    if len(raw) < hl:
        return None
    # Every fixed field at once: the bytes pack_header writes for this key and layout (its
    # padding zeros included). One compare instead of a field-by-field unpack: this runs
    # once per block loaded (~192 KiB in ~20 us on the 0.5B shape).
    if raw[:_FIXED.size] != _fixed(layout, ns, key, hl):
        return None
    end = _FIXED.size + 8 * layout.num_layers
    (crc,) = struct.unpack_from("<I", raw, end)
    if zlib.crc32(memoryview(raw)[:end]) != crc:
        return None
    return Header(memoryview(raw)[_FIXED.size:end], hl)
