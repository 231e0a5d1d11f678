"""End to end, start-up: a bad flag value, a busy or invalid --listen or --metrics-port, and a
SIGTERM while the stages start. Real `pipeline serve` / `pipeline run` processes.

Each failure must be found before the model loads (no stage ever starts), end with exit
status 2 and ONE line saying what is wrong (naming the flag and its limit), and leave nothing
in /dev/shm; a SIGTERM during start-up stops cleanly (exit 0, nothing left).
"""
from __future__ import annotations

import signal
import socket
import subprocess
import time

import pytest
from e2e_helpers import ENGINE_FLAGS, PIPELINE, ROOT, Daemon, env, free_port, make_tiny_model, shm_entries

from pipeline.config import EngineConfig
from pipeline.engine_args import config_from_args


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.getbasetemp() / "e2e-tiny")  # one per session


@pytest.fixture
def busy_port():
    """A TCP port something else listens on."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield s.getsockname()[1]


def start(command: str, model, *flags: str) -> tuple[int, str, str]:
    p = subprocess.Popen([*PIPELINE, command, "--model", str(model), *ENGINE_FLAGS, *flags],
                         stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True, cwd=ROOT, env=env())
    try:
        out, err = p.communicate(timeout=120)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    assert shm_entries(f"{p.pid:x}") == []  # the instance is named after the gateway's pid
    return p.returncode, out, err


def assert_refused(rc: int, err: str, command: str, *names: str) -> None:
    lines = [line for line in err.splitlines() if line.strip()]
    assert rc == 2, err
    assert len(lines) == 1 and lines[0].startswith(f"pipeline {command}: "), err
    assert "Traceback" not in err and "loading weights" not in err  # before the model loads
    for name in names:
        assert name in lines[0], (name, lines[0])


@pytest.mark.parametrize(("flags", "names"), [
    (["--max-num-seqs", "0"], ["--max-num-seqs", ">= 1", "got 0"]),
    (["--block-size", "7"], ["--block-size", "power of two", "got 7"]),
    (["--gpu-memory-utilization", "1.5"], ["--gpu-memory-utilization", "(0, 1]"]),
    (["--drain-timeout", "-1"], ["--drain-timeout", ">= 0", "got -1"]),
    (["--max-frame-bytes", "0"], ["--max-frame-bytes", "got 0"]),
    (["--metrics-port", "70000"], ["--metrics-port", "65535", "got 70000"]),
    (["--listen", "127.0.0.1:7001"], ["--listen", "tcp://HOST:PORT"]),
    (["--listen", "tcp://127.0.0.1:notaport"], ["--listen", "tcp://127.0.0.1:notaport"]),
    (["--curve-keys", "/nonexistent/keys"], ["--curve-keys", "/nonexistent/keys", "missing server.key"]),
])
def test_serve_bad_flag_values(model, flags, names):
    rc, _, err = start("serve", model, "--listen", f"tcp://127.0.0.1:{free_port()}", *flags)
    assert_refused(rc, err, "serve", *names)


def test_serve_busy_listen_port(model, busy_port):
    """Before: a ZMQError traceback with exit status 1."""
    rc, _, err = start("serve", model, "--listen", f"tcp://127.0.0.1:{busy_port}")
    assert_refused(rc, err, "serve", "--listen", str(busy_port), "in use")


def test_serve_busy_metrics_port(model, busy_port):
    """Before: a traceback after the model loaded, then a hang with every stage alive (and,
    on SIGTERM, the KV cache left in /dev/shm)."""
    rc, _, err = start("serve", model, "--listen", f"tcp://127.0.0.1:{free_port()}",
                       "--metrics-port", str(busy_port))
    assert_refused(rc, err, "serve", "--metrics-port", str(busy_port), "in use")


def test_pipe_mode_checks_engine_flags_too(model):
    rc, out, err = start("run", model, "--block-size", "7")
    assert out == ""
    assert_refused(rc, err, "run", "--block-size", "power of two")


def test_config_check_names_the_flag_and_limit():
    for fields, expected in [({"max_num_seqs": 0}, "--max-num-seqs must be >= 1, got 0"),
                             ({"block_size": 512}, "--block-size must be 0 (automatic) or a power "
                                                   "of two up to 256, got 512"),
                             ({"seed": -1}, "--seed must be in [0, 18446744073709551615], got -1"),
                             ({"dtype": "float8"}, "--dtype must be one of auto, float32, bfloat16, "
                                                   "float16, got 'float8'")]:
        with pytest.raises(ValueError) as e:
            EngineConfig.of(**fields).check()
        assert str(e.value) == expected
    for block_size in (0, 1, 16, 256):
        EngineConfig.of(block_size=block_size).check()
    args = type("Args", (), {"max_num_seqs": -3})()
    with pytest.raises(ValueError, match="--max-num-seqs"):
        config_from_args(args)


def test_sigterm_during_startup_leaves_nothing(model):
    """Before: SIGTERM's default action killed the gateway mid start-up; the stages followed
    it, and the instance's shared memory stayed in /dev/shm until the next start."""
    d = Daemon(model)
    try:
        deadline = time.monotonic() + 120
        while "loading weights" not in d.output():  # the stages are starting, shm exists
            assert d.proc.poll() is None and time.monotonic() < deadline, d.output()
            time.sleep(0.01)  # polling a log file: nothing to wait on
        assert shm_entries(d.instance_id)
        d.proc.send_signal(signal.SIGTERM)
        rc = d.proc.wait(60)
        out = d.output()
    finally:
        d.stop(signal.SIGKILL)
    assert rc == 0, out
    assert shm_entries(d.instance_id) == []
