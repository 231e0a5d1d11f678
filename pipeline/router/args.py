"""Router: its command-line flags and their checked, typed form (``RouterArgs``, built from
the parsed namespace by ``check_args``). Owns no state.

Two ways to run: ``--instance ADDR...`` (mixed replicas, data parallel) or ``--prefill
ADDR... --decode ADDR...`` (disaggregated pools); exactly one of them.
"""
from __future__ import annotations

import argparse
import os
from dataclasses import dataclass
from pathlib import Path

from pipeline.config import CURVE_FILES
from pipeline.frontend.args import FrontArgs, add_front_args, check_endpoint
from pipeline.http.launcher import parse_http

POOL_FLAGS = ("instance", "prefill", "decode")


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--listen", required=True,
                   help="ZMQ endpoint to bind for clients (tcp://HOST:PORT or ipc://PATH)")
    p.add_argument("--instance", nargs="+", action="extend", metavar="ADDR",
                   help="the ZMQ endpoint of a running `pipeline serve` (mixed role); repeatable")
    p.add_argument("--prefill", nargs="+", action="extend", metavar="ADDR",
                   help="disaggregated: a `pipeline serve --role prefill` endpoint; repeatable, "
                        "needs --decode")
    p.add_argument("--decode", nargs="+", action="extend", metavar="ADDR",
                   help="disaggregated: a `pipeline serve --role decode` endpoint; repeatable, "
                        "needs --prefill")
    p.add_argument("--http", default=None, metavar="[HOST:]PORT",
                   help="serve the OpenAI API over HTTP too, as `pipeline serve --http` does "
                        "(HOST 127.0.0.1 by default)")
    p.add_argument("--api-key", default=os.environ.get("PIPELINE_API_KEY"),
                   help="--http requires `Authorization: Bearer KEY` (default: $PIPELINE_API_KEY)")
    add_front_args(p)


@dataclass(frozen=True, kw_only=True)
class RouterArgs(FrontArgs):
    """`pipeline router`'s flags, checked when built: ValueError naming the flag and its limit."""
    listen: str
    instance: tuple[str, ...] = ()  # mixed replicas
    prefill: tuple[str, ...] = ()  # disaggregated pools
    decode: tuple[str, ...] = ()
    http: str | None = None  # the OpenAI API's [HOST:]PORT
    api_key: str | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.http is not None:
            parse_http(self.http)
        if self.api_key is not None and not self.api_key.strip():
            raise ValueError("--api-key: must not be empty")
        if self.instance and (self.prefill or self.decode):
            raise ValueError("--instance (mixed replicas) cannot be combined with --prefill/--decode "
                             "(disaggregated pools): give one or the other")
        if not self.instance:
            if not self.prefill and not self.decode:
                raise ValueError("no instances: give --instance ADDR... (mixed replicas) or "
                                 "--prefill ADDR... --decode ADDR... (disaggregated pools)")
            if not self.decode:
                raise ValueError("--prefill needs --decode ADDR... (the decode pool)")
            if not self.prefill:
                raise ValueError("--decode needs --prefill ADDR... (the prefill pool)")
        for flag in POOL_FLAGS:
            addrs = getattr(self, flag)
            for addr in addrs:
                check_endpoint(f"--{flag}", addr)
            if len(set(addrs)) != len(addrs):
                raise ValueError(f"--{flag}: an address is given twice: {' '.join(addrs)}")
            if self.listen in addrs:
                raise ValueError(f"--listen {self.listen} is also an --{flag}")
        if self.curve_keys:  # the router is both ends: a server to clients, a client to instances
            missing = [f for f in CURVE_FILES if not (Path(self.curve_keys) / f).is_file()]
            if missing:
                raise ValueError(f"--curve-keys {self.curve_keys}: missing {', '.join(missing)} "
                                 "(make the keys with `pipeline keys DIR`)")
        both = sorted(set(self.prefill) & set(self.decode))
        if both:
            raise ValueError(f"--prefill/--decode: an address may not be in both pools: {' '.join(both)}")


def check_args(args: argparse.Namespace) -> RouterArgs:
    """The parsed flags, checked and typed (the command's edge)."""
    def pool(flag: str) -> tuple[str, ...]:
        return tuple(getattr(args, flag, None) or ())

    return RouterArgs(listen=args.listen, drain_timeout=args.drain_timeout,
                      max_frame_bytes=args.max_frame_bytes, curve_keys=args.curve_keys,
                      allow_insecure_network=args.allow_insecure_network, http=args.http,
                      api_key=args.api_key, instance=pool("instance"),
                      prefill=pool("prefill"), decode=pool("decode"))
