"""End to end: the daemons a test starts do not outlive a killed test run.

A child Python process plays pytest: it starts a `pipeline serve` daemon and a `pipeline
router` over it with ``e2e_helpers`` (as every test does), reports their pids, and is then
SIGKILLed. The daemon and the router get SIGTERM from the kernel (PIPELINE_DIE_WITH:
prctl PR_SET_PDEATHSIG), the daemon stops its stages and unlinks its shared memory: no process
of either is left, and nothing of the instance in /dev/shm.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest
from e2e_helpers import ROOT, alive, env, make_tiny_model, shm_entries, wait_for

CHILD = """
import json, sys
from pathlib import Path
sys.path.insert(0, sys.argv[2])
from e2e_helpers import Daemon, RouterProc, wait_for
from pipeline.client import Client

d = Daemon(Path(sys.argv[1]))
d.wait_ready()
r = RouterProc("--instance", d.address)
with Client(r.address, timeout=60) as c:  # the router is up and reaches the daemon
    wait_for(lambda: c.health().status == "ok", "the router to see the daemon", timeout=60)
print(json.dumps({"instance": d.instance_id, "daemon": d.proc.pid, "router": r.proc.pid,
                  "stages": d.stage_pids()}), flush=True)
sys.stdin.read()  # until killed
"""


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.getbasetemp() / "e2e-tiny")  # one per session


def test_a_killed_test_process_takes_its_daemons_and_their_shared_memory_with_it(model):
    child = subprocess.Popen([sys.executable, "-c", CHILD, str(model), str(ROOT / "tests")],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=ROOT,
                             env=env())
    started: dict = {}
    try:
        line = child.stdout.readline()  # type: ignore[union-attr]
        assert line, f"the child exited {child.wait()} before its daemons were ready"
        started = json.loads(line)
        pids = [started["daemon"], started["router"], *started["stages"].values()]
        assert set(started["stages"]) >= {"worker0", "engine", "tokenizer", "output"}
        assert all(alive(p) for p in pids) and shm_entries(started["instance"])
        child.kill()
        child.wait()
        wait_for(lambda: not any(alive(p) for p in pids), "the daemon, its stages and the router to exit",
                 timeout=60)
        # The daemon drained (nothing in flight) and cleaned up before it exited.
        assert shm_entries(started["instance"]) == []
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
        for pid in [started.get("daemon"), started.get("router")]:
            if pid and alive(pid):  # the feature failed: do not leave them running
                os.kill(pid, signal.SIGKILL)
