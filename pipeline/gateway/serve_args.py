"""`pipeline serve`: its command-line flags and their checked, typed form (``ServeArgs``,
built from the parsed namespace by ``check_args``; the engine's flags become an
``EngineConfig`` in ``config``). Owns no state.
"""
from __future__ import annotations

import argparse
import os
from dataclasses import dataclass

from pipeline.bind import is_loopback
from pipeline.engine_args import add_engine_args, add_node_args, add_pd_args
from pipeline.frontend.args import FrontArgs, add_front_args
from pipeline.http.launcher import parse_http

DEFAULT_LISTEN = "tcp://127.0.0.1:7001"
DEFAULT_HTTP_PORT = 8000  # vLLM's


def add_args(p: argparse.ArgumentParser) -> None:
    add_engine_args(p)
    add_pd_args(p)
    add_node_args(p)
    p.add_argument("--listen", default=None,
                   help=f"ZMQ endpoint to bind (default {DEFAULT_LISTEN} unless only --http is given; "
                        "tcp://0.0.0.0:PORT with --curve-keys to open it)")
    p.add_argument("--http", default=None, metavar="[HOST:]PORT",
                   help="serve the OpenAI API over HTTP too (HOST 127.0.0.1 by default)")
    # vLLM's names for the same thing: `--host H --port P` serves the OpenAI API on H:P.
    p.add_argument("--host", default=None,
                   help="as --http HOST:PORT: the HTTP API's address (default 127.0.0.1, not all "
                        "interfaces as vLLM: beyond loopback needs --api-key)")
    p.add_argument("--port", type=int, default=None,
                   help=f"as --http HOST:PORT: the HTTP API's port (default {DEFAULT_HTTP_PORT} when "
                        "--host is given)")
    p.add_argument("--api-key", default=os.environ.get("PIPELINE_API_KEY"),
                   help="--http requires `Authorization: Bearer KEY` (default: $PIPELINE_API_KEY)")
    p.add_argument("--served-model-name", default=None,
                   help="the `model` HTTP requests name (default: the --model path; \"default\" for "
                        "the embedded model)")
    p.add_argument("--metrics-port", type=int, default=0, help="Prometheus /metrics port (0: off)")
    p.add_argument("--metrics-host", default="127.0.0.1")
    add_front_args(p)


@dataclass(frozen=True, kw_only=True)
class ServeArgs(FrontArgs):
    """The daemon's own flags (``EngineConfig.check`` does the engine's), checked when built:
    ValueError naming the flag and its limit."""
    http: str | None = None
    api_key: str | None = None
    served_model_name: str | None = None
    metrics_port: int = 0
    metrics_host: str = "127.0.0.1"

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.api_key is not None and not self.api_key.strip():
            raise ValueError("--api-key: must not be empty")
        if self.http is not None:
            host, port = parse_http(self.http)
            # The HTTP API's key is --api-key (CURVE keys secure the ZMQ channels only).
            if not (self.api_key or self.allow_insecure_network or is_loopback(tcp(host, port))):
                raise ValueError(f"--http {self.http} is beyond loopback and --api-key is not set: "
                                 "anyone who reaches it would be let in; give --api-key (or "
                                 "$PIPELINE_API_KEY), or --allow-insecure-network on a network you trust")
        if not 0 <= self.metrics_port <= 65535:
            raise ValueError(f"--metrics-port must be in [0, 65535] (0: off), got {self.metrics_port}")
        if self.metrics_port and not (self.allow_insecure_network
                                      or is_loopback(tcp(self.metrics_host, self.metrics_port))):
            raise ValueError(f"--metrics-host {self.metrics_host} is beyond loopback: /metrics has no "
                             "key and tells whoever reaches it the server's load and sizes; keep it "
                             "on loopback (scrape through a proxy) or give --allow-insecure-network")


def tcp(host: str, port: int) -> str:
    return f"tcp://[{host}]:{port}" if ":" in host else f"tcp://{host}:{port}"


def http_address(args: argparse.Namespace) -> str | None:
    """--http, or vLLM's --host/--port as the same [HOST:]PORT (ValueError if both forms)."""
    host, port = getattr(args, "host", None), getattr(args, "port", None)
    if host is None and port is None:
        return args.http
    if args.http is not None:
        raise ValueError(f"--http {args.http} and --host/--port both give the HTTP API's address; "
                         "give one")
    port = DEFAULT_HTTP_PORT if port is None else port
    if not 0 <= port <= 65535:
        raise ValueError(f"--port must be in [0, 65535], got {port}")
    host = host or "127.0.0.1"
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def check_args(args: argparse.Namespace) -> ServeArgs:
    """The parsed flags, checked and typed (the command's edge). ``--listen`` defaults to
    DEFAULT_LISTEN unless only ``--http`` (or ``--host``/``--port``) is given."""
    http = http_address(args)
    listen = DEFAULT_LISTEN if args.listen is None and http is None else args.listen
    return ServeArgs(listen=listen, drain_timeout=args.drain_timeout, max_frame_bytes=args.max_frame_bytes,
                     http=http, api_key=args.api_key, served_model_name=args.served_model_name,
                     curve_keys=args.curve_keys, allow_insecure_network=args.allow_insecure_network,
                     metrics_port=args.metrics_port,
                     metrics_host=args.metrics_host)
