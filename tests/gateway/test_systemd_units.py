"""Issue 25 item 12: every shipped unit (tools/systemd/*.service) works as systemd runs it.

The units are parsed and their exact ExecStart command lines run with the environment a
system unit gets: only the unit's Environment= (no XDG_RUNTIME_DIR, no TMPDIR), its own
private /tmp and /var/tmp (PrivateTmp=yes: a mount namespace with fresh tmpfs, when
``unshare`` can make one; a fresh TMPDIR otherwise). Only what is machine-specific is
substituted: the program path (this checkout's Python), the model, key and working
directories, and the ports (free ones, on the same addresses). The one-host prefill/decode
units must serve through their router what one instance decodes; `pipeline.service` must
come up with its keys and stop cleanly. No unit names a supplementary group (one the host
lacks fails every start with status 216), puts a secret on a command line (readable by
every local user), or binds beyond loopback without keys (the commands would refuse to
start). ``systemd-analyze verify`` checks the files when the tool exists.
"""
from __future__ import annotations

import json
import os
import pwd
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from e2e_helpers import ROOT, free_port, make_tiny_model, run_pipe, wait_for

from pipeline.bind import is_loopback
from pipeline.client import Client
from pipeline.ipc.curve import generate_keys
from pipeline.runtime.process import DIE_WITH_ENV

UNITS = sorted((ROOT / "tools" / "systemd").glob("*.service"))
PROGRAM = "/opt/pipeline/.venv/bin/pipeline"
PD_UNITS = ("pipeline-decode.service", "pipeline-prefill.service", "pipeline-router.service")


def parse(path: Path) -> dict[str, list[str]]:
    """key -> values of a unit file (continuation lines joined, comments dropped)."""
    out: dict[str, list[str]] = {}
    logical = re.sub(r"\\\n", " ", path.read_text())
    for line in logical.splitlines():
        line = line.strip()
        if line and not line.startswith(("#", ";", "[")):
            key, _, value = line.partition("=")
            out.setdefault(key.strip(), []).append(value.strip())
    return out


def test_the_units_ship_and_parse():
    assert {u.name for u in UNITS} >= {"pipeline.service", *PD_UNITS}
    for u in UNITS:
        cmd = shlex.split(parse(u)["ExecStart"][0])
        assert cmd[0] == PROGRAM and cmd[1] in ("serve", "router"), (u.name, cmd)


@pytest.mark.parametrize("unit", UNITS, ids=lambda u: u.name)
def test_no_supplementary_group_no_secret_on_the_command_line_no_open_bind(unit):
    keys = parse(unit)
    assert "SupplementaryGroups" not in keys, unit.name
    cmd = shlex.split(keys["ExecStart"][0])
    assert not {"--api-key", "--api-key-file"} & set(cmd), unit.name
    for flag in ("--listen", "--kv-listen"):
        if flag in cmd:
            assert is_loopback(cmd[cmd.index(flag) + 1]) or "--curve-keys" in cmd, (unit.name, flag)


def test_systemd_analyze_verify_accepts_every_unit(tmp_path):
    tool = shutil.which("systemd-analyze")
    if tool is None:
        pytest.skip("systemd-analyze is not installed")
    # The program must exist for verify: this checkout's venv entry point stands in for it.
    program = Path(sys.executable).parent / "pipeline"
    if not program.exists():
        pytest.skip(f"{program} is not installed")
    for u in UNITS:
        (tmp_path / u.name).write_text(u.read_text().replace(PROGRAM, str(program)))
    p = subprocess.run([tool, "verify", "--man=no", *sorted(map(str, tmp_path.iterdir()))],
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 0 and not p.stderr.strip(), p.stderr


def _private_tmp_works() -> bool:
    if shutil.which("unshare") is None:
        return False
    p = subprocess.run(["unshare", "-m", "sh", "-c", "mount -t tmpfs tmpfs /tmp"],
                       capture_output=True, timeout=10)
    return p.returncode == 0


PRIVATE_TMP = _private_tmp_works()


def private_tmp(cmd: list[str], keep: list[Path], cwd: Path) -> list[str]:
    """``cmd`` with fresh tmpfs on /tmp and /var/tmp (PrivateTmp=yes), and bound back in from
    the old trees what the test itself keeps there (this checkout, its Python, the working
    directory: a clone under /tmp must not vanish): the shell still reaches the old tree
    through its working directory after the tmpfs covers it (--no-canonicalize: mount would
    otherwise resolve the relative source to the new, empty path)."""
    steps = []
    for base in ("/tmp", "/var/tmp"):
        rel = sorted({str(p.resolve().relative_to(base)) for p in keep if p.resolve().is_relative_to(base)})
        steps.append(f"cd {base} && mount -t tmpfs -o mode=1777 tmpfs {base}")
        steps += [f"mkdir -p {base}/{q} && mount --no-canonicalize --bind {q} {base}/{q}"
                  for q in map(shlex.quote, rel)]
    steps.append(f'cd {shlex.quote(str(cwd))} && exec "$@"')
    return ["unshare", "-m", "sh", "-c", " && ".join(steps), "sh", *cmd]


class Unit:
    """One unit's ExecStart, run as systemd would (see the module docstring)."""

    def __init__(self, name: str, subst: dict[str, str], workdir: Path) -> None:
        keys = parse(ROOT / "tools" / "systemd" / name)
        line = keys["ExecStart"][0]
        for old, new in subst.items():
            line = line.replace(old, new)
        cmd = [sys.executable, "-m", "pipeline", *shlex.split(line)[1:]]
        user = pwd.getpwuid(os.getuid())
        env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": str(workdir), "USER": user.pw_name,
               "LOGNAME": user.pw_name, "PYTHONPATH": str(ROOT), DIE_WITH_ENV: str(os.getpid())}
        for assignment in keys.get("Environment", []):
            for kv in shlex.split(assignment):
                k, _, v = kv.partition("=")
                env[k] = v.replace("/var/cache/pipeline", str(workdir))
        self.name = name
        if PRIVATE_TMP:  # PrivateTmp=yes: /tmp and /var/tmp of its own
            cmd = private_tmp(cmd, [ROOT, Path(sys.prefix), workdir], workdir)
        else:
            env["TMPDIR"] = tempfile.mkdtemp(dir=workdir)
        self.log = open(workdir / f"{name}.log", "w+")
        self.proc = subprocess.Popen(cmd, env=env, cwd=workdir, stdout=self.log,
                                     stderr=subprocess.STDOUT, start_new_session=True)

    def output(self) -> str:
        self.log.flush()
        self.log.seek(0)
        return self.log.read()

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(60)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait()


def _left(unit: Unit) -> list[str]:
    """/dev/shm entries (segments, the KV socket) of the instance a unit ran (its pid's)."""
    iid = f"{unit.proc.pid:x}"
    return sorted(n for n in os.listdir("/dev/shm")
                  if n.startswith((f"pipeline.{iid}.", f"sem.pipeline.{iid}.", f"pipeline-{iid}.kv")))


@pytest.fixture
def place(tmp_path_factory):
    """A model, keys and working directory outside /tmp (the units' /tmp is private)."""
    d = Path(tempfile.mkdtemp(prefix="systemd-units-", dir=ROOT / "build" if (ROOT / "build").is_dir()
                              else Path.home()))
    try:
        model = make_tiny_model(tmp_path_factory.mktemp("units") / "model")
        shutil.copytree(model, d / "model")
        keys = generate_keys(d / "curve")
        yield d, d / "model", keys
    finally:
        shutil.rmtree(d, ignore_errors=True)


def _subst(model: Path, keys: Path, ports: dict[int, int]) -> dict[str, str]:
    out = {"/var/lib/pipeline/models/default": str(model), "/etc/pipeline/curve": str(keys)}
    out |= {f":{old}": f":{new}" for old, new in ports.items()}
    out |= {f"--metrics-port {old}": f"--metrics-port {new}" for old, new in ports.items()}
    return out


def test_one_host_prefill_decode_units_serve_through_their_router(place):
    workdir, model, keys = place
    prompts = [[(11 * i + 5 * j) % 1500 + 40 for j in range(12 + 7 * i)] for i in range(3)]
    lines = [json.dumps({"id": i, "prompt_token_ids": p, "max_tokens": 8, "temperature": 0,
                         "ignore_eos": True}) for i, p in enumerate(prompts)]
    rc, ref, err = run_pipe(model, lines, "--ordered")
    assert rc == 0, err
    subst = _subst(model, keys, {7001: free_port(), 7101: free_port(), 7201: free_port()})
    units = [Unit(n, subst, workdir) for n in PD_UNITS]
    router = f"tcp://127.0.0.1:{subst[':7001'][1:]}"
    try:
        def up() -> bool:
            for u in units:
                assert u.proc.poll() is None, f"{u.name} exited:\n{u.output()}"
            try:
                with Client(router, timeout=5) as c:
                    return sum(i["up"] for i in c.health().detail["instances"].values()) == 2
            except (TimeoutError, ConnectionError):
                return False
        wait_for(up, "both instances up behind the router", 180)
        # Well under the 30 s kv_transfer_timeout a KV socket the prefill unit cannot see costs.
        with Client(router, timeout=20) as c:
            got = [c.generate(prompt_token_ids=p, max_tokens=8, temperature=0, ignore_eos=True)
                   for p in prompts]
        assert [r.error for r in got] == [None] * len(prompts), [u.output() for u in units]
        assert [list(r.token_ids) for r in got] == [a["token_ids"] for a in ref]
    finally:
        codes = {u.name: u.stop() for u in reversed(units)}
    assert codes == dict.fromkeys(codes, 0), [u.output() for u in units]
    assert [_left(u) for u in units] == [[], [], []]


def test_pipeline_service_starts_with_its_keys_and_stops_cleanly(place):
    workdir, model, keys = place
    subst = _subst(model, keys, {5555: free_port(), 9400: free_port()})
    unit = Unit("pipeline.service", subst, workdir)
    address = f"tcp://127.0.0.1:{subst[':5555'][1:]}"
    try:
        wait_for(lambda: unit.proc.poll() is not None or "serving on" in unit.output(),
                 "pipeline.service to serve", 180)
        assert unit.proc.poll() is None, unit.output()
        with Client(address, timeout=20, curve_keys_dir=keys) as c:
            assert c.health().status == "ok"
            assert c.generate(prompt_token_ids=[5, 6, 7], max_tokens=4, ignore_eos=True).error is None
    finally:
        assert unit.stop() == 0, unit.output()
    assert _left(unit) == []
