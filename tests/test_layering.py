"""The layout holds the design's table (../shared/design.md, "Layout"): packages in the order
data flows, each importing only what is below it. Walks the AST of every module of
`pipeline/` (lazy imports inside functions included) and checks:

- no import cycle between packages;
- each package imports only the packages its row of LAYERS allows (and itself);
- only the engine imports the block pool (one owner of the block table);
- the client imports the messages and the wire protocol (``frontend``), never a stage
  package; the router (a front end over daemons) the client, ``frontend`` and the messages,
  plus the gateway's systemd notifier;
- the HTTP front end is a client of the daemon; the gateway imports only its launcher and
  the OpenAI models and conversions (pipe mode's batch files), never the app.
"""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent / "pipeline"
STAGE_BASE = {"runtime", "ipc", "messages", "config", "spec_config", "sampling_params"}
# The grammars of structured outputs (xgrammar): the tokenizer stage validates with them, the
# worker masks with them.
# package -> the packages of ours it may import (besides itself)
LAYERS: dict[str, set[str]] = {
    "_ext": set(),
    "sizes": set(),
    "version": set(),
    "bind": set(),
    "spec_config": set(),
    "config_checks": set(),
    "config": {"sizes", "bind", "spec_config", "config_checks"},
    "sampling_params": set(),
    "reasoning": set(),
    # a chat answer's parts (reasoning, tool calls, content): the front ends' and LLM.chat's
    "chat_parse": {"tool_parsers", "reasoning"},
    "ipc": {"_ext"},
    "messages": {"config", "sampling_params"},
    "runtime": {"ipc", "messages", "config", "sampling_params"},
    "structured_outputs": {"sampling_params"},
    "tool_parsers": set(),  # tool-call parsers: a leaf, used by the front ends and the LLM
    "tokenizer": STAGE_BASE | {"structured_outputs"},
    "engine": STAGE_BASE,
    "output": STAGE_BASE,
    "cache": STAGE_BASE | {"_ext"},  # kv_tier: the disk tier's file I/O and checksum (kv_io)
    "worker": STAGE_BASE | {"models", "layers", "structured_outputs"},
    "layers": {"_ext", "config"},
    "models": {"layers", "config", "sizes"},  # make_model's --max-shard-size
    # the wire protocol, client sessions, the one ZMQ server base (CURVE keys: ipc.curve)
    "frontend": {"messages", "sampling_params", "config", "bind", "ipc", "sizes"},
    "client": {"messages", "frontend", "sampling_params", "config", "ipc"},
    # of the gateway, its systemd notifier only (ROUTER_MAY_USE)
    "router": {"client", "frontend", "messages", "sampling_params", "config", "bind", "gateway", "http",
               "ipc"},
    # the OpenAI HTTP front end: a client of the daemon (and its Tokenizer for /tokenize; the
    # launcher, the daemon's side, sweeps the ipc directories of dead instances)
    "http": {"client", "frontend", "messages", "sampling_params", "config", "tokenizer", "ipc",
             "version", "chat_parse"},
    # the in-process LLM's TP ranks: stage processes it starts itself, never through the gateway
    "llm_tp": STAGE_BASE | {"worker"},
}
STAGES = {"tokenizer", "engine", "worker", "output", "cache"}
CLIENT_MAY_USE = {"pipeline.frontend.protocol", "pipeline.ipc.curve"}
# The router is a front end over daemons: of the gateway, its systemd notifier only.
ROUTER_MAY_USE = {"pipeline.gateway.systemd"}
# The HTTP front end: of the tokenizer, the Tokenizer class and the byte limits every way in
# checks (validate), never a stage's loop; of ipc, the instances' liveness (the launcher) and
# prctl (its process dies with the daemon's, and is named pl-http).
HTTP_MAY_USE = {"pipeline.tokenizer.tokenizer", "pipeline.tokenizer.validate", "pipeline.ipc.instance",
                "pipeline.ipc.prctl"}
# What of the HTTP front end the gateway imports (the app, FastAPI, never).
# (The launcher is the router's too: `pipeline router --http`.)
HTTP_SHARED = {"pipeline.http.launcher", "pipeline.http.openai_api", "pipeline.http.openai_convert",
               "pipeline.http.openai_response"}


def modules() -> dict[str, Path]:
    out = {}
    for path in ROOT.rglob("*.py"):
        parts = ("pipeline",) + path.relative_to(ROOT).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


MODULES = modules()


def imports_of(path: Path) -> set[str]:
    """Every module of ours that `path` imports, at module granularity."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.split(".")[0] == "pipeline"}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module.split(".")[0] != "pipeline":
                continue
            for a in node.names:
                sub = f"{node.module}.{a.name}"
                found.add(sub if sub in MODULES else node.module)
    return found


def package(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "pipeline"


GRAPH = {m: imports_of(p) for m, p in MODULES.items()}


def package_graph() -> dict[str, set[str]]:
    g: dict[str, set[str]] = {}
    for mod, deps in GRAPH.items():
        g.setdefault(package(mod), set()).update(package(d) for d in deps if package(d) != package(mod))
    return g


def test_the_walk_sees_the_tree():
    assert {"pipeline.messages.tags", "pipeline.runtime.rings", "pipeline.gateway.serve",
            "pipeline.tokenizer.validate", "pipeline.layers.fused_decoder"} <= set(MODULES)
    assert "pipeline.engine.scheduler" in GRAPH["pipeline.engine.stage"]
    assert "pipeline.frontend.protocol" in GRAPH["pipeline.client.base"]  # `from X import mod`


def test_no_package_level_import_cycles():
    g = package_graph()
    state: dict[str, int] = {}
    cycles = []

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(g.get(node, ())):
            if state.get(nxt) == 1:
                cycles.append(path[path.index(nxt):] + [nxt])
            elif nxt not in state:
                visit(nxt, path + [nxt])
        state[node] = 2

    for node in sorted(g):
        if node not in state:
            visit(node, [node])
    assert not cycles, cycles


def test_each_package_imports_only_what_is_below_it():
    bad = []
    for mod, deps in GRAPH.items():
        pkg = package(mod)
        if pkg not in LAYERS:
            continue  # gateway, llm, cli, bench: the top, may import anything below
        bad += [f"{mod} -> {d}" for d in sorted(deps)
                if package(d) != pkg and package(d) not in LAYERS[pkg]]
    assert not bad, bad


def test_no_stage_imports_the_gateway_or_another_stage():
    bad = [f"{m} -> {d}" for m, deps in GRAPH.items() if package(m) in STAGES
           for d in deps if package(d) in (STAGES - {package(m)}) | {"gateway", "client"}]
    assert not bad, bad


def test_only_the_engine_imports_the_block_pool():
    users = {m for m, deps in GRAPH.items() if "pipeline.engine.block_pool" in deps}
    assert users and all(package(m) == "engine" for m in users), users


def test_the_client_uses_only_messages_and_the_wire_protocol():
    bad = [f"{m} -> {d}" for m, deps in GRAPH.items() if package(m) == "client"
           for d in deps if package(d) in {"frontend", "ipc"} and d not in CLIENT_MAY_USE]
    assert not bad, bad
    # and what those modules import is below the client too
    for mod in CLIENT_MAY_USE:
        assert all(package(d) in {"messages", "sampling_params", "frontend"} for d in GRAPH[mod]), GRAPH[mod]


def test_the_router_uses_only_the_client_frontend_messages_and_systemd():
    bad = [f"{m} -> {d}" for m, deps in GRAPH.items() if package(m) == "router"
           for d in deps if package(d) == "gateway" and d not in ROUTER_MAY_USE]
    assert not bad, bad


def test_the_http_front_end_is_a_client_of_the_daemon():
    """It reaches the daemon through the client only: no stage loop, no ring, no gateway
    internals; and the gateway imports only its launcher and the OpenAI models and
    conversions, never the app."""
    bad = [f"{m} -> {d}" for m, deps in GRAPH.items() if package(m) == "http"
           for d in deps if package(d) in {"gateway", "tokenizer", "ipc"} and d not in HTTP_MAY_USE]
    assert not bad, bad
    assert not [m for m, deps in GRAPH.items() if package(m) != "http"
                and any(package(d) == "http" and d not in HTTP_SHARED for d in deps)]
    assert not [m for m, deps in GRAPH.items() if package(m) not in {"http", "gateway", "router"}
                and any(package(d) == "http" for d in deps)]


def test_the_frontend_serves_the_protocol_without_the_gateway():
    """The ZMQ server base and the protocol are below the daemon and the router."""
    assert "pipeline.frontend.zmq_server" in GRAPH["pipeline.gateway.serve"]
    assert "pipeline.frontend.zmq_server" in GRAPH["pipeline.router.table"]
