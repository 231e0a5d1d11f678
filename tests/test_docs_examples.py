"""The documents' examples run as printed (issue 28): every fenced block of README.md and
docs/*.md is either run here or listed in SKIP with the reason it cannot run on a CPU box in
seconds (a GPU, root, several daemons or hosts, a long benchmark, an output sample, a flag or
config fragment). A block that is neither fails ``test_every_block_is_run_or_skipped``, so a
new block gets classified when it is written.

How they run:
- PYTHON blocks: one subprocess runs them all, each document's blocks in document order in
  one namespace (as a reader pastes them: openai.md's second block uses the first's
  ``client``), against one ``pipeline serve --http`` daemon on the default model this test
  starts; the documents' addresses (``tcp://127.0.0.1:7001``, ``http://127.0.0.1:8000``) are
  replaced by the daemon's.
- CURL blocks: bash, against the same daemon.
- ELSEWHERE: the two tests below (the structured-outputs snippet in this process, the batch
  file through ``pipeline run`` as printed).
Tables are keyed by (file, the beginning of the block's first line); a key must match exactly
one block.
"""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from e2e_helpers import PIPELINE, ROOT, Daemon, env

DOCS = Path(ROOT) / "docs"
FENCE = re.compile(r"^(\s*)```(\S*)\s*$")

# The documents' endpoints -> the test daemon's (see test_runnable_blocks_run).
ZMQ_ADDRESS = "tcp://127.0.0.1:7001"
HTTP_URL = "http://127.0.0.1:8000"

PYTHON = {
    ("README.md", "from pipeline import LLM, SamplingParams"),  # LLM, then a ZMQ Client
    ("README.md", "from openai import OpenAI"),
    ("docs/openai.md", "from openai import OpenAI"),
    ("docs/openai.md", "msgs = "),
    ("docs/python_api.md", "from pipeline import LLM, SamplingParams"),
    ("docs/openai.md", "import openai"),  # /v1/embeddings
    ("docs/python_api.md", "from pipeline import LLM\n"),  # LLM.embed
}
CURL = {("README.md", "curl -N"), ("docs/openai.md", "curl -N")}
ELSEWHERE = {
    ("docs/structured_outputs.md", "from pipeline import LLM"): "test_structured_outputs_snippet_runs_as_printed",
    ("docs/openai.md", "pipeline run --model ./my-model"): "test_openai_batch_example_runs_as_printed",
    ("docs/openai.md", '{"custom_id": "q1"'): "test_openai_batch_example_runs_as_printed",
}
SYSTEMD = "root and systemd: installs the service"
SKIP = {
    ("README.md", "make run"): "sets up .venv and runs the whole suite (make test), this test included",
    ("README.md", ".venv/bin/pipeline run < prompts.txt"):
        "a command list: daemons, routers, benchmarks, placeholders (DIR, KEY, prompts.txt)",
    ("docs/cpu.md", ".venv/bin/pipeline bench cpu"): "a long benchmark",
    ("docs/default_model.md", "nice -n 5"): "trains the default model (a long run)",
    ("docs/default_model.md", "Exceptions are raised"): "output sample",
    ("docs/default_model.md", 'The "try" statement'): "output sample",
    ("docs/default_model.md", 'The "import" statement'): "output sample",
    ("docs/disaggregation.md", "# the decode instance"): "three daemons in the background (prefill, decode, router)",
    ("docs/disaggregation.md", "from pipeline.client import Client"): "a client of the router the block above starts",
    ("docs/disaggregation.md", "pipeline keys /etc/pipeline/keys"): "two hosts",
    ("docs/disaggregation.md", "sudo cp"): SYSTEMD,
    ("docs/disaggregation.md", "# decode host"): "unit-file fragments (two hosts)",
    ("docs/gpu.md", "make gpu-wheels"): "builds the GPU image's wheels (network)",
    ("docs/gpu.md", "command:"): "the device tool's call (a GPU)",
    ("docs/kv_tier.md", "pipeline serve --kv-offload-dir"): "flag fragments ('...', a Python call)",
    ("docs/openai.md", "pipeline serve --http 8000"): "daemons in the foreground (the test starts its own)",
    ("docs/openai.md", '{"id": "batch_req_'): "output sample (placeholders)",
    ("docs/router.md", ".venv/bin/pipeline serve --listen"): "two daemons and a router in the background",
    ("docs/router.md", ".venv/bin/pipeline serve --role prefill"): "daemons and a router ('...')",
    ("docs/security.md", "pipeline keys /etc/pipeline/keys"): "writes /etc (root)",
    ("docs/speculative.md", "pipeline run   --speculative-config"): "flag fragments ('...', a Python call)",
    ("docs/systemd.md", "sudo git clone"): SYSTEMD,
    ("docs/systemd.md", "sudo useradd"): SYSTEMD,
    ("docs/systemd.md", "sudo install -d"): SYSTEMD,
    ("docs/systemd.md", "sudo /opt/pipeline"): SYSTEMD,
    ("docs/systemd.md", "sudo cp"): SYSTEMD,
    ("docs/systemd.md", "/opt/pipeline/.venv/bin/python -c"): "a client of the installed service (CURVE keys in /etc)",
    ("docs/systemd.md", "sudo install -m 0600"): SYSTEMD,
    ("docs/systemd.md", "sudo systemctl edit"): SYSTEMD,
    ("docs/tensor_parallel.md", "# one host: two ranks"): "daemons, two hosts, a fragment ('...')",
}


@dataclass(frozen=True)
class Block:
    file: str  # relative to the repository
    line: int  # of the opening fence
    lang: str
    code: str

    @property
    def where(self) -> str:
        return f"{self.file}:{self.line}"


def doc_blocks() -> list[Block]:
    """Every fenced block of README.md and docs/*.md; an indented fence (a list item's
    block) has its indent removed."""
    out = []
    for path in [Path(ROOT) / "README.md", *sorted(DOCS.glob("*.md"))]:
        lines = path.read_text().split("\n")
        i = 0
        while i < len(lines):
            m = FENCE.match(lines[i])
            if not m:
                i += 1
                continue
            indent, start = len(m.group(1)), i
            i += 1
            while lines[i].strip() != "```":
                i += 1
            body = "\n".join(line[indent:] for line in lines[start + 1:i]) + "\n"
            out.append(Block(str(path.relative_to(ROOT)), start + 1, m.group(2), body))
            i += 1
    return out


def matching(key: tuple[str, str], blocks: list[Block]) -> list[Block]:
    return [b for b in blocks if b.file == key[0] and b.code.startswith(key[1])]


def the_block(key: tuple[str, str]) -> Block:
    (block,) = matching(key, doc_blocks())
    return block


def test_every_block_is_run_or_skipped():
    found = doc_blocks()
    tables = [*PYTHON, *CURL, *ELSEWHERE, *SKIP]
    assert len(tables) == len(set(tables)), "a key in two tables"
    stale = [k for k in tables if len(matching(k, found)) != 1]
    assert not stale, f"keys matching no block or several: {stale}"
    unclassified = [f"{b.where}: {b.code.splitlines()[0] if b.code.strip() else ''}"
                    for b in found if not any(b in matching(k, found) for k in tables)]
    assert not unclassified, f"blocks neither run nor in SKIP (classify them): {unclassified}"
    assert all(the_block(k).lang == "python" for k in PYTHON)
    assert all(reason for reason in SKIP.values())
    assert all(callable(globals().get(name)) for name in ELSEWHERE.values())


def for_daemon(code: str, daemon: Daemon) -> str:
    """``code`` with the documents' addresses replaced by the daemon's; any other loopback
    address in it is a document that drifted (it would only print an error answer)."""
    assert daemon.http_url
    code = code.replace(ZMQ_ADDRESS, daemon.address).replace(HTTP_URL, daemon.http_url)
    ours = {daemon.address.rsplit(":", 1)[1], daemon.http_url.rsplit(":", 1)[1]}
    others = [m for m in re.findall(r"(?:127\.0\.0\.1|localhost):(\d+)", code) if m not in ours]
    assert not others, f"an address the test does not serve (ZMQ {ZMQ_ADDRESS}, HTTP {HTTP_URL}): {others}"
    return code


# Runs the blocks it reads from stdin in order, a namespace per document.
RUNNER = """
import json, sys
spaces = {}
for b in json.load(sys.stdin):
    print("=== run", b["where"], flush=True)
    exec(compile(b["code"], b["where"], "exec"), spaces.setdefault(b["file"], {"__name__": "__main__"}))
print("=== all ran", flush=True)
"""


def test_runnable_blocks_run():
    daemon = Daemon(Path(ROOT) / "pipeline" / "default_model", http=True)
    try:
        daemon.wait_ready()
        py = sorted((the_block(k) for k in PYTHON), key=lambda b: (b.file, b.line))
        todo = [{"file": b.file, "where": b.where, "code": for_daemon(b.code, daemon)} for b in py]
        p = subprocess.run([sys.executable, "-c", RUNNER], input=json.dumps(todo), capture_output=True,
                           text=True, timeout=180, cwd=ROOT, env=env())
        assert p.returncode == 0 and "=== all ran" in p.stdout, p.stdout[-3000:] + p.stderr[-6000:]

        curl_requests = 0
        for key in sorted(CURL):
            block = the_block(key)
            code = for_daemon(block.code, daemon)
            c = subprocess.run(["bash", "-euo", "pipefail", "-c", code], capture_output=True, text=True,
                               timeout=60, cwd=ROOT, env=env())
            answers = [json.loads(x.removeprefix("data: ")) for x in c.stdout.splitlines()
                       if x.strip() and x.strip() != "data: [DONE]"]
            assert c.returncode == 0 and answers, f"{block.where}: {c.stdout[-2000:]} {c.stderr[-2000:]}"
            assert all("choices" in a for a in answers), f"{block.where}: {c.stdout[-2000:]}"
            curl_requests += code.count("curl ")

        # Every block that talks to the daemon reached it (a wrong address would only print an
        # error answer): each asked at least once.
        from pipeline.client import Client

        with Client(daemon.address, timeout=10) as c:
            finished = sum(c.stats()["requests_finished"].values())
        talkers = [b for b in py if for_daemon(b.code, daemon) != b.code]
        assert finished >= len(talkers) + curl_requests, (finished, [b.where for b in talkers])
    finally:
        code = daemon.stop(signal.SIGTERM)
    assert code == 0, daemon.output()[-3000:]


def test_structured_outputs_snippet_runs_as_printed():
    block = the_block(("docs/structured_outputs.md", "from pipeline import LLM")).code
    assert "S(json=schema)" in block
    scope: dict = {}
    exec(compile(block, "docs/structured_outputs.md", "exec"), scope)
    (out,) = scope["outs"]
    json.loads(out.outputs[0].text)  # a JSON object, as constrained
    scope["llm"].close()


def test_openai_batch_example_runs_as_printed(tmp_path):
    """The command as printed, in a directory holding the input as printed and ./my-model
    (the default model), with ``pipeline`` on PATH."""
    command = the_block(("docs/openai.md", "pipeline run --model ./my-model")).code
    (tmp_path / "batch_input.jsonl").write_text(the_block(("docs/openai.md", '{"custom_id": "q1"')).code)
    (tmp_path / "my-model").symlink_to(Path(ROOT) / "pipeline" / "default_model")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "pipeline").write_text(f'#!/bin/sh\nexec {" ".join(PIPELINE)} "$@"\n')
    (bin_dir / "pipeline").chmod(0o755)
    e = env()
    e["PATH"] = f"{bin_dir}{os.pathsep}{e['PATH']}"
    p = subprocess.run(["bash", "-euo", "pipefail", "-c", command], capture_output=True, text=True,
                       timeout=240, cwd=tmp_path, env=e)
    assert p.returncode == 0, p.stderr
    lines = [json.loads(line) for line in (tmp_path / "batch_output.jsonl").read_text().splitlines()
             if line.strip()]
    assert [(x["custom_id"], x["response"]["status_code"]) for x in lines] == [("q1", 200), ("q2", 200)]
