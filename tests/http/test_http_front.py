"""The HTTP front end's process life with the daemon (`pipeline serve --http`): drain (503 for
new requests while the old ones finish), a killed front end is restarted and its requests
freed, a busy port fails start-up at once, `--http` alone binds no ZMQ endpoint, and nothing
outlives the instance (its /dev/shm entries and its private socket directory).

Real processes throughout: the daemon, its stages, the uvicorn front end, and HTTP clients.
"""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import tempfile
import threading
from pathlib import Path

import httpx
import pytest
from e2e_helpers import ENGINE_FLAGS, PIPELINE, ROOT, Daemon, env, free_port, make_tiny_model, shm_entries, wait_for


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("http-front") / "tiny")


def http_dir(instance_id: str) -> Path:
    base = Path(os.environ.get("XDG_RUNTIME_DIR") or tempfile.gettempdir())
    return base / f"pipeline-{instance_id}.http"


def start(model: Path, *flags: str) -> tuple[Daemon, str]:
    port = free_port()
    d = Daemon(model, "--http", f"127.0.0.1:{port}", *flags)
    d.wait_ready()
    return d, f"http://127.0.0.1:{port}"


def stats(d: Daemon) -> dict:
    from pipeline.client import Client
    with Client(d.address, timeout=10) as c:
        return c.stats()


def http_detail(d: Daemon) -> dict:
    from pipeline.client import Client
    with Client(d.address, timeout=10) as c:
        return c.health().detail["http"]


LONG = {"prompt": "once upon a time", "max_tokens": 2000, "temperature": 0, "ignore_eos": True, "stream": True}


def start_slow() -> tuple[Daemon, str]:
    """The embedded model with a long context: a LONG request still runs seconds later (the
    tiny model would finish it before the test acts)."""
    from pipeline.config import DEFAULT_MODEL
    return start(Path(DEFAULT_MODEL), "--max-model-len", "2048", "--num-blocks", "512")


def test_drain_answers_503_while_the_old_requests_finish():
    d, url = start_slow()
    lines: list[str] = []
    first = threading.Event()

    def old_request() -> None:
        with httpx.stream("POST", f"{url}/v1/completions", json=LONG, timeout=60) as r:
            for line in r.iter_lines():
                if line:
                    lines.append(line)
                    first.set()

    t = threading.Thread(target=old_request)
    t.start()
    assert first.wait(60)
    d.proc.send_signal(signal.SIGTERM)
    wait_for(lambda: httpx.get(f"{url}/health").status_code == 503, "health to say draining")
    r = httpx.post(f"{url}/v1/completions", json={"prompt": "x", "max_tokens": 2})
    assert r.status_code == 503 and r.json()["error"]["code"] == "draining", r.text
    t.join(60)
    assert lines[-1] == "data: [DONE]"
    finals = [json.loads(x[6:])["choices"][0]["finish_reason"] for x in lines[:-1]]
    assert finals[-1] == "length" and all(f is None for f in finals[:-1])
    assert d.stop() == 0
    assert not shm_entries(d.instance_id) and not http_dir(d.instance_id).exists()


def test_a_killed_front_end_is_restarted_and_its_requests_freed():
    d, url = start_slow()
    try:
        used_idle = stats(d)["kv_blocks_used"]
        pid = http_detail(d)["pid"]
        got = threading.Event()
        broke: list[BaseException] = []

        def doomed() -> None:
            try:
                with httpx.stream("POST", f"{url}/v1/completions", json=LONG,
                                  timeout=60) as r:
                    for _ in r.iter_lines():
                        got.set()
            except httpx.HTTPError as exc:
                broke.append(exc)

        t = threading.Thread(target=doomed)
        t.start()
        assert got.wait(60)
        os.kill(pid, signal.SIGKILL)
        t.join(60)
        assert broke, "the stream of a killed front end must break"
        wait_for(lambda: stats(d)["kv_blocks_used"] == used_idle and stats(d)["num_requests_running"] == 0,
                 "the killed front end's request to be aborted and its blocks freed")
        wait_for(lambda: http_detail(d)["pid"] not in (None, pid), "the front end to be restarted")
        r = httpx.post(f"{url}/v1/completions", json={"prompt": "x", "max_tokens": 2, "temperature": 0},
                       timeout=60)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2
        assert http_detail(d)["restarts"] == 1
    finally:
        assert d.stop() == 0
    assert not shm_entries(d.instance_id) and not http_dir(d.instance_id).exists()


def test_a_busy_http_port_fails_start_up_naming_the_flag(model):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        p = subprocess.run([*PIPELINE, "serve", "--model", str(model), "--http", f"127.0.0.1:{port}",
                            *ENGINE_FLAGS], capture_output=True, text=True, timeout=120, cwd=ROOT, env=env())
    assert p.returncode == 2, p.stderr
    assert f"--http 127.0.0.1:{port}" in p.stderr and "cannot start" in p.stderr


@pytest.mark.parametrize("value", ["http://x:80", "127.0.0.1:99999", "host:"])
def test_a_bad_http_flag_is_refused_before_loading(model, value):
    p = subprocess.run([*PIPELINE, "serve", "--model", str(model), "--http", value, *ENGINE_FLAGS],
                       capture_output=True, text=True, timeout=60, cwd=ROOT, env=env())
    assert p.returncode == 2 and "--http" in p.stderr, p.stderr


def test_http_alone_binds_no_zmq_endpoint(model):
    port = free_port()
    with tempfile.TemporaryFile("w+") as log:
        proc = subprocess.Popen([*PIPELINE, "serve", "--model", str(model), "--http", str(port), *ENGINE_FLAGS],
                                stdout=log, stderr=subprocess.STDOUT, cwd=ROOT, env=env(), start_new_session=True)
        try:
            def output() -> str:
                log.seek(0)
                return log.read()
            wait_for(lambda: "serving on" in output() or proc.poll() is not None, "the daemon to serve", 120)
            assert f"serving on http://127.0.0.1:{port}\n" in output(), output()
            assert "tcp://" not in output()
            r = httpx.get(f"http://127.0.0.1:{port}/v1/models")
            assert r.json()["data"][0]["root"] == str(model)
        finally:
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(60) == 0
    iid = f"{proc.pid:x}"
    assert not shm_entries(iid) and not http_dir(iid).exists()


def test_curve_keys_still_guard_listen_while_http_serves(model, tmp_path):
    from pipeline.client import Client
    from pipeline.ipc.curve import generate_keys

    keys = generate_keys(tmp_path / "curve")
    port = free_port()
    d = Daemon(model, "--http", f"127.0.0.1:{port}", curve_keys=keys)
    try:
        d.wait_ready()
        r = httpx.post(f"http://127.0.0.1:{port}/v1/completions",
                       json={"prompt": "x", "max_tokens": 2, "temperature": 0}, timeout=60)
        assert r.status_code == 200, r.text
        with Client(d.address, timeout=10, connect_timeout=5) as c:  # no client keys
            assert c.generate("x", max_tokens=2).error.code == "handshake_failed"
    finally:
        assert d.stop() == 0
