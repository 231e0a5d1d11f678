"""What every ZMQ front end of the daemon's protocol shares (`pipeline serve`, `pipeline
router`): the front flags, their checked and typed form (``FrontArgs``, which ``ServeArgs``
and ``RouterArgs`` extend; built from the parsed namespace at the command's edge, so that no
``argparse.Namespace`` reaches frame handling), the channel security flags (``--curve-keys``,
``--allow-insecure-network``) and the rule they enforce (``bind.check_bind``: nothing binds
beyond loopback without keys unless told to), and the one-line start-up failure (exit status 2).
Owns no state.
"""
from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from typing import Protocol
from urllib.parse import urlparse

from pipeline.bind import check_bind
from pipeline.frontend import protocol as P
from pipeline.sizes import size_arg

FRAME_BYTES_RANGE = (1 << 10, 1 << 30)


def add_front_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--drain-timeout", type=float, default=30.0,
                   help="on SIGTERM/Ctrl-C, seconds to let in-flight requests finish")
    p.add_argument("--max-frame-bytes", type=size_arg, default=P.MAX_FRAME_BYTES,
                   help="larger client frames are answered with an error")
    p.add_argument("--curve-keys", default="", metavar="DIR",
                   help="ZMQ CURVE keys (`pipeline keys DIR`) securing every channel this process "
                        "opens or accepts (docs/security.md)")
    p.add_argument("--allow-insecure-network", action="store_true",
                   help="bind beyond loopback without --curve-keys all the same (a network you trust)")


@dataclass(frozen=True, kw_only=True)
class FrontArgs:
    """The front flags, checked when built: ValueError naming the flag and its limit."""
    listen: str | None  # None: `pipeline serve --http` alone binds no ZMQ endpoint
    drain_timeout: float = 30.0
    max_frame_bytes: int = P.MAX_FRAME_BYTES
    curve_keys: str = ""  # "": no CURVE
    allow_insecure_network: bool = False

    def __post_init__(self) -> None:
        if not self.drain_timeout >= 0:  # NaN too
            raise ValueError(f"--drain-timeout must be >= 0 (seconds), got {self.drain_timeout}")
        lo, hi = FRAME_BYTES_RANGE
        if not lo <= self.max_frame_bytes <= hi:
            raise ValueError(f"--max-frame-bytes must be in [{lo}, {hi}], got {self.max_frame_bytes}")
        if self.listen is not None:
            check_endpoint("--listen", self.listen)
            check_bind("--listen", self.listen, self.curve_keys, self.allow_insecure_network)


def check_endpoint(flag: str, addr: str) -> None:
    if urlparse(addr).scheme not in ("tcp", "ipc"):
        raise ValueError(f"{flag} {addr!r}: expected tcp://HOST:PORT or ipc://PATH")


class Status(Protocol):
    """What start-up failure needs of the systemd notifier (``gateway.systemd.Notifier``)."""

    def status(self, text: str) -> object: ...


def cannot_start(command: str, notify: Status, exc: BaseException) -> int:
    """Start-up failed: one line on stderr (and to systemd), exit status 2."""
    why = " ".join(str(exc).split()) or type(exc).__name__
    print(f"pipeline {command}: cannot start: {why}", file=sys.stderr, flush=True)
    notify.status(f"start-up failed: {why}")
    return 2
