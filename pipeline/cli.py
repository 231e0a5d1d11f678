"""Entry point: the `pipeline` command. Each subcommand lives in its own module, imported lazily
so that `pipeline bench ipc` does not pay for torch.

A subcommand module exposes ``add_args(parser)`` and ``main(args) -> int``.
"""
from __future__ import annotations

import argparse
import difflib
import importlib
import sys

COMMANDS = {
    "run": ("pipeline.gateway.pipe", "pipe mode: prompts or JSON lines on stdin, JSON lines out"),
    "serve": ("pipeline.gateway.serve", "the daemon (ZMQ, systemd Type=notify)"),
    "router": ("pipeline.router.server", "one address over several daemons (replicas or prefill/decode pools)"),
    "make-model": ("pipeline.models.make_model", "write a random-initialised checkpoint"),
    "keys": ("pipeline.ipc.curve", "make the CURVE keys of a deployment (docs/security.md)"),
}
BENCHES = {
    "ipc": "pipeline.bench.ipc",
    "worker": "pipeline.bench.worker",
    "scheduler": "pipeline.bench.scheduler",
    "serve": "pipeline.bench.serve",
    "offline": "pipeline.bench.offline",
    "pd": "pipeline.bench.pd",
    "startup": "pipeline.bench.startup",
    "threads": "pipeline.bench.threads",
    "tp": "pipeline.bench.tp",
    "structured": "pipeline.bench.structured",
    "cpu": "pipeline.bench.cpu",
    "gemm": "pipeline.bench.gemm",
    "attention": "pipeline.bench.attention",
    "kvtier": "pipeline.bench.kvtier",
    "spec": "pipeline.bench.spec",
}


def build_parser(argv: list[str]) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pipeline")
    sub = p.add_subparsers(dest="command", required=True)
    # Only import the module of the subcommand actually asked for.
    wanted = argv[0] if argv else None
    for name, (mod, helptext) in COMMANDS.items():
        sp = sub.add_parser(name, help=helptext)
        if name == wanted:
            m = importlib.import_module(mod)
            m.add_args(sp)
            sp.set_defaults(_main=m.main)
    bp = sub.add_parser("bench", help="benchmarks: " + ", ".join(BENCHES))
    bsub = bp.add_subparsers(dest="bench", required=True)
    want_bench = argv[1] if wanted == "bench" and len(argv) > 1 else None
    for name, mod in BENCHES.items():
        sp = bsub.add_parser(name)
        sp.add_argument("--json", action="store_true", help="print one JSON object")
        if name == want_bench:
            m = importlib.import_module(mod)
            m.add_args(sp)
            sp.set_defaults(_main=m.main)
    return p


def chosen_parser(p: argparse.ArgumentParser, args: argparse.Namespace) -> argparse.ArgumentParser:
    """The (sub)parser of the command asked for: the one whose flags a stray argument missed."""
    for dest in ("command", "bench"):
        name = getattr(args, dest, None)
        sub = next((a for a in p._actions if isinstance(a, argparse._SubParsersAction)), None)
        if name is None or sub is None or name not in sub.choices:
            break
        p = sub.choices[name]
    return p


def unrecognized(p: argparse.ArgumentParser, extra: list[str]) -> str:
    """argparse's message for arguments no flag took, with the nearest flag for a misspelt one
    (`--max-num-seq` -> `--max-num-seqs`), as vLLM's parser suggests."""
    flags = [s for a in p._actions for s in a.option_strings]
    hints = []
    for arg in extra:
        name = arg.split("=", 1)[0]
        if name.startswith("-"):
            near = difflib.get_close_matches(name, flags, n=1, cutoff=0.6)
            if near:
                hints.append(f"{name} (did you mean {near[0]}?)")
    msg = "unrecognized arguments: " + " ".join(extra)
    return msg + ("; " + ", ".join(hints) if hints else "")


def main(argv: list[str] | None = None) -> int:
    if argv is None:  # a command, not a call in another program's process
        from pipeline.runtime.process import die_with_parent_env

        die_with_parent_env()  # PIPELINE_DIE_WITH=<parent pid>: the test suite's daemons
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser(argv)
    args, extra = parser.parse_known_args(argv)
    if extra:  # exit status 2, as argparse's own error
        sub = chosen_parser(parser, args)
        sub.error(unrecognized(sub, extra))
    return int(args._main(args) or 0)


if __name__ == "__main__":
    raise SystemExit(main())
