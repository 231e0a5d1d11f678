"""Router: its command-line flags and their checks. Owns no state.

Two ways to run: ``--instance ADDR...`` (mixed replicas, data parallel) or ``--prefill
ADDR... --decode ADDR...`` (disaggregated pools); exactly one of them.
"""
from __future__ import annotations

import argparse

from pipeline.gateway.front import add_front_args, check_endpoint, check_front_args

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
    add_front_args(p)


def check_args(args: argparse.Namespace) -> None:
    """ValueError naming the flag and its limit."""
    check_front_args(args)
    for flag in POOL_FLAGS:
        if getattr(args, flag, None) is None:
            setattr(args, flag, [])
    if args.instance and (args.prefill or args.decode):
        raise ValueError("--instance (mixed replicas) cannot be combined with --prefill/--decode "
                         "(disaggregated pools): give one or the other")
    if not args.instance:
        if not args.prefill and not args.decode:
            raise ValueError("no instances: give --instance ADDR... (mixed replicas) or "
                             "--prefill ADDR... --decode ADDR... (disaggregated pools)")
        if not args.decode:
            raise ValueError("--prefill needs --decode ADDR... (the decode pool)")
        if not args.prefill:
            raise ValueError("--decode needs --prefill ADDR... (the prefill pool)")
    for flag in POOL_FLAGS:
        addrs = getattr(args, flag)
        for addr in addrs:
            check_endpoint(f"--{flag}", addr)
        if len(set(addrs)) != len(addrs):
            raise ValueError(f"--{flag}: an address is given twice: {' '.join(addrs)}")
        if args.listen in addrs:
            raise ValueError(f"--listen {args.listen} is also an --{flag}")
    both = sorted(set(args.prefill) & set(args.decode))
    if both:
        raise ValueError(f"--prefill/--decode: an address may not be in both pools: {' '.join(both)}")
