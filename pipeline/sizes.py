"""Sizes in bytes as users write them (``20GiB``, ``512MB``, ``1.5G``): every flag that takes
bytes (``--kv-cache-memory``, ``--max-frame-bytes``, ...: ``size_arg``) and ``LLM(...)``'s
string values. Owns no state.
"""
from __future__ import annotations

import argparse

_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "kib": 1 << 10, "m": 10**6, "mb": 10**6,
          "mib": 1 << 20, "g": 10**9, "gb": 10**9, "gib": 1 << 30, "t": 10**12, "tb": 10**12,
          "tib": 1 << 40}


def parse_size(text: str | int) -> int:
    """Bytes from ``20GiB``, ``512MB``, ``1.5G`` or a plain count (ValueError naming the text)."""
    if isinstance(text, int):
        return text
    t = text.strip().lower().replace(" ", "")
    num = t.rstrip("kmgtib")
    unit = t[len(num):]
    try:
        value = float(num)
    except ValueError:
        value = -1.0
    if unit not in _UNITS or value < 0 or value != value or value == float("inf"):
        raise ValueError(f"{text!r} is not a size: a number of bytes with an optional unit "
                         f"(KB, MB, GB, TB, KiB, MiB, GiB, TiB), e.g. 20GiB")
    return int(value * _UNITS[unit])


def size_arg(text: str) -> int:
    """``parse_size`` as an argparse ``type=``: every flag that takes bytes takes ``2GiB``."""
    try:
        return parse_size(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
