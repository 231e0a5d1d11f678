"""The daemon's side of ``pipeline serve --http [HOST:]PORT``: the listening socket, the
private ipc endpoint the front end reaches the daemon on, and the front-end process.

Owns (state): the bound TCP socket (bound at start-up, before the model loads, so a busy
port costs no load time; connections wait in its backlog until the front end serves), the
directory ``$XDG_RUNTIME_DIR/pipeline-<instance>.http`` (mode 0700: only this user reaches
the daemon through it, so ``--api-key`` cannot be bypassed) holding the ipc socket, and the
``pipeline.http.process`` child. A front end that dies is restarted (its requests in flight were aborted
by the daemon when its connection dropped); one that cannot start fails the start-up.
Directories of dead instances are swept at start.
"""
from __future__ import annotations

import os
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

import msgspec

from pipeline.ipc.instance import owner_alive, pid_alive


class HttpSpec(msgspec.Struct, kw_only=True):
    fd: int  # the listening TCP socket
    ready_fd: int  # one byte is written here once serving
    endpoint: str  # the daemon's ZMQ socket for this process
    model_path: str
    model: str  # served model name
    max_model_len: int
    fingerprint: str
    chat_template: str | None = None
    api_key: str | None = None
    answer_limit: int = 0  # the answers ring's message limit (bytes)
    # How the model's chat answers are parsed (--tool-call-parser and co; chat_parse)
    tool_call_parser: str | None = None
    enable_auto_tool_choice: bool = False
    reasoning_parser: str | None = None
    hidden_size: int = 0  # the model's: an embedding's length (/v1/embeddings `dimensions`)


# The daemon stops the front end with this (it ignores SIGTERM/SIGINT: see pipeline.http.process).
STOP_SIGNAL = signal.SIGUSR1
READY_TIMEOUT_S = 60.0
BACKLOG = 4096


def run_dir() -> Path:
    return Path(os.environ.get("XDG_RUNTIME_DIR") or tempfile.gettempdir())


def parse_http(addr: str) -> tuple[str, int]:
    """``[HOST:]PORT`` (HOST may be ``[v6]``; loopback by default); ValueError naming --http."""
    host, sep, port = addr.rpartition(":")
    host = host.strip("[]") if sep else "127.0.0.1"
    if not port.isdigit() or not 0 <= int(port) <= 65535 or not host or "/" in host:
        raise ValueError(f"--http {addr!r}: expected [HOST:]PORT with PORT in [0, 65535]")
    return host, int(port)


ROUTER_ID = "router-"  # `pipeline router --http`: "pipeline-router-<pid>.http" (no owner record)


def sweep_http_dirs(base: Path) -> None:
    for d in base.glob("pipeline-*.http"):
        iid = d.name[len("pipeline-"):-len(".http")]
        if iid.startswith(ROUTER_ID):
            pid = iid[len(ROUTER_ID):]
            alive = pid.isdigit() and pid_alive(int(pid))
        else:
            alive = owner_alive(iid) is True
        if not alive and d.is_dir() and d.stat().st_uid == os.geteuid():
            shutil.rmtree(d, ignore_errors=True)


class HttpFront:
    def __init__(self, addr: str, instance_id: str) -> None:
        self.host, self.port = parse_http(addr)
        base = run_dir()
        sweep_http_dirs(base)
        self.dir = base / f"pipeline-{instance_id}.http"
        self.dir.mkdir(mode=0o700)
        self.endpoint = f"ipc://{self.dir}/gateway"
        self.sock: socket.socket | None = None
        self.proc: subprocess.Popen | None = None
        self.spec: HttpSpec | None = None
        self.restarts = 0

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    def detail(self) -> dict:
        return {"url": self.url, "pid": None if self.proc is None else self.proc.pid,
                "restarts": self.restarts}

    def bind(self) -> None:
        try:
            info = socket.getaddrinfo(self.host, self.port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
            family, _, _, _, sockaddr = info[0]
            sock = socket.socket(family, socket.SOCK_STREAM)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                sock.bind(sockaddr)
                sock.listen(BACKLOG)
            except OSError:
                sock.close()
                raise
        except OSError as exc:
            raise ValueError(f"--http {self.host}:{self.port}: {exc.strerror or exc}") from None
        sock.set_inheritable(True)
        self.sock = sock
        self.port = sock.getsockname()[1]

    def start(self, spec: dict) -> None:
        """Start the front end and wait until it serves; RuntimeError saying why not."""
        ready_r = self._spawn(spec)
        try:
            ok = select.select([ready_r], [], [], READY_TIMEOUT_S)[0] and os.read(ready_r, 1) == b"1"
        finally:
            os.close(ready_r)
        if not ok:
            assert self.proc is not None
            code = self.proc.poll()
            self.stop(0.0)
            why = f"exit code {code}" if code is not None else f"no answer within {READY_TIMEOUT_S:.0f}s"
            raise RuntimeError(f"the HTTP front end did not start ({why}); see its output above")

    def _spawn(self, spec: dict) -> int:
        """Start the process; returns the read end of its ready pipe."""
        assert self.sock is not None
        ready_r, ready_w = os.pipe()
        self.spec = HttpSpec(fd=self.sock.fileno(), ready_fd=ready_w, endpoint=self.endpoint, **spec)
        try:
            self.proc = subprocess.Popen([sys.executable, "-m", "pipeline.http.process"],
                                         stdin=subprocess.PIPE, pass_fds=(self.sock.fileno(), ready_w))
            assert self.proc.stdin is not None
            self.proc.stdin.write(msgspec.json.encode(self.spec))
            self.proc.stdin.close()
        except BaseException:
            os.close(ready_r)
            raise
        finally:
            os.close(ready_w)
        return ready_r

    def check(self, log: Callable[[str], None]) -> None:
        """Restart the front end if it died (from the daemon's loop, so without waiting for
        it: connections wait in the socket's backlog meanwhile)."""
        if self.proc is None or self.spec is None or self.proc.poll() is None:
            return
        self.restarts += 1
        log(f"the HTTP front end exited ({self.proc.returncode}); restarting it (restart {self.restarts})")
        spec = msgspec.structs.asdict(self.spec)
        for k in ("fd", "ready_fd", "endpoint"):
            spec.pop(k)
        os.close(self._spawn(spec))

    def stop(self, timeout: float = 10.0) -> None:
        proc, self.proc = self.proc, None
        if proc is None or proc.poll() is not None:
            return
        proc.send_signal(STOP_SIGNAL)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.send_signal(signal.SIGKILL)
            proc.wait()

    def close(self) -> None:
        self.stop()
        if self.sock is not None:
            self.sock.close()
            self.sock = None
        shutil.rmtree(self.dir, ignore_errors=True)
