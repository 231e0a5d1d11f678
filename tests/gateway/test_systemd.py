"""sd_notify over real AF_UNIX datagram sockets (a path and an abstract name)."""
from __future__ import annotations

import os
import socket
import threading

import pytest

from pipeline.gateway.systemd import Notifier


@pytest.fixture(params=["path", "abstract"])
def listener(request, tmp_path):
    s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    if request.param == "path":
        name = str(tmp_path / "notify.sock")
        s.bind(name)
    else:
        name = f"@pipeline-test-{os.getpid()}-{id(s)}"
        s.bind("\0" + name[1:])
    s.settimeout(10)
    yield name, s
    s.close()


def recv(s: socket.socket) -> list[str]:
    return s.recv(4096).decode().split("\n")


def test_ready_status_stopping(listener):
    name, s = listener
    n = Notifier.from_env({"NOTIFY_SOCKET": name})
    assert n.enabled
    assert n.status("loading weights 3/10")
    assert recv(s) == ["STATUS=loading weights 3/10"]
    assert n.ready("serving\non tcp://127.0.0.1:5555")
    assert recv(s) == ["READY=1", "STATUS=serving on tcp://127.0.0.1:5555"]  # one datagram, no stray lines
    assert n.stopping("draining 4 requests")
    assert recv(s) == ["STOPPING=1", "STATUS=draining 4 requests"]
    n.close()
    assert not n.ready()


def test_watchdog_pings_while_healthy(listener):
    name, s = listener
    n = Notifier.from_env({"NOTIFY_SOCKET": name, "WATCHDOG_USEC": "20000", "WATCHDOG_PID": str(os.getpid())})
    assert n.watchdog_interval_s == 0.01
    calls = 0
    went_bad = threading.Event()

    def healthy() -> bool:
        nonlocal calls
        calls += 1
        if calls >= 3:
            went_bad.set()
            return False
        return True

    assert n.start_watchdog(healthy)
    assert went_bad.wait(10)
    s.setblocking(False)
    assert [recv(s), recv(s)] == [["WATCHDOG=1"], ["WATCHDOG=1"]]
    with pytest.raises(BlockingIOError):  # no ping once unhealthy
        s.recv(4096)
    n.close()


def test_watchdog_for_another_pid_is_ignored(listener):
    name, _ = listener
    n = Notifier.from_env({"NOTIFY_SOCKET": name, "WATCHDOG_USEC": "20000", "WATCHDOG_PID": "1"})
    assert n.watchdog_interval_s is None and not n.start_watchdog()
    n.close()


def test_noop_without_systemd(monkeypatch):
    monkeypatch.delenv("NOTIFY_SOCKET", raising=False)
    n = Notifier.from_env()
    assert not n.enabled and not n.ready() and not n.start_watchdog()
    n.close()


def test_env_is_consumed(monkeypatch, listener):
    name, s = listener
    monkeypatch.setenv("NOTIFY_SOCKET", name)
    monkeypatch.setenv("WATCHDOG_USEC", "1000000")
    n = Notifier.from_env()
    assert "NOTIFY_SOCKET" not in os.environ and "WATCHDOG_USEC" not in os.environ
    assert n.enabled and n.watchdog_interval_s == 0.5
    n.close()


def test_systemd_gone_does_not_raise(tmp_path):
    n = Notifier(str(tmp_path / "nobody-listens.sock"))
    assert n.ready() is False
    n.close()
