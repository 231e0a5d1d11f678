"""Gateway (daemon): the sd_notify protocol, spoken directly on ``$NOTIFY_SOCKET``.

State: the datagram socket to systemd and the watchdog keep-alive thread. Everything is a
no-op when ``NOTIFY_SOCKET`` is unset (not started by systemd, or ``Type=simple``), so
``pipeline serve`` calls it unconditionally:

    notifier = Notifier.from_env()
    notifier.status("loading weights"); ...; notifier.ready("serving on tcp://...")
    notifier.start_watchdog(is_healthy)   # WATCHDOG=1 every WATCHDOG_USEC/2 while healthy
    ...; notifier.stopping("draining"); notifier.close()

The protocol is one datagram of newline-separated KEY=VALUE lines to an AF_UNIX socket whose
path is in NOTIFY_SOCKET; a leading '@' means the Linux abstract namespace ('\\0' + rest).
"""
from __future__ import annotations

import os
import socket
import threading
from collections.abc import Callable


class Notifier:
    """Speaks to systemd; every method returns False (and does nothing) without it."""

    def __init__(self, address: str | None, watchdog_usec: int | None = None) -> None:
        self.address = address or None
        self.watchdog_usec = watchdog_usec if watchdog_usec and watchdog_usec > 0 else None
        self._sock: socket.socket | None = None
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        if self.address is not None:
            self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
            self._target = "\0" + self.address[1:] if self.address.startswith("@") else self.address

    @classmethod
    def from_env(cls, env: dict[str, str] | None = None, unset: bool = True) -> Notifier:
        """Read NOTIFY_SOCKET / WATCHDOG_USEC / WATCHDOG_PID. ``unset`` removes them from
        os.environ so the stage processes we spawn do not talk to systemd as well."""
        e = os.environ if env is None else env
        address = e.get("NOTIFY_SOCKET")
        usec = e.get("WATCHDOG_USEC")
        pid = e.get("WATCHDOG_PID")
        watchdog = int(usec) if usec and usec.isdigit() else None
        if pid and pid.isdigit() and int(pid) != os.getpid():
            watchdog = None  # the watchdog is meant for another process
        if unset and env is None:
            for key in ("NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID"):
                os.environ.pop(key, None)
        return cls(address, watchdog)

    @property
    def enabled(self) -> bool:
        return self._sock is not None

    def notify(self, *lines: str) -> bool:
        """Send KEY=VALUE lines in one datagram. Errors are swallowed: systemd being gone
        must never take the daemon down."""
        if self._sock is None:
            return False
        payload = "\n".join(line.replace("\n", " ") for line in lines).encode()
        with self._lock:
            try:
                self._sock.sendto(payload, self._target)
            except OSError:
                return False
        return True

    def ready(self, status: str | None = None) -> bool:
        return self.notify("READY=1", *([f"STATUS={status}"] if status else []))

    def status(self, text: str) -> bool:
        return self.notify(f"STATUS={text}")

    def stopping(self, status: str | None = None) -> bool:
        return self.notify("STOPPING=1", *([f"STATUS={status}"] if status else []))

    def watchdog(self) -> bool:
        return self.notify("WATCHDOG=1")

    @property
    def watchdog_interval_s(self) -> float | None:
        """Half of WATCHDOG_USEC, as sd_watchdog_enabled(3) recommends."""
        return None if self.watchdog_usec is None else self.watchdog_usec / 2e6

    def start_watchdog(self, healthy: Callable[[], bool] | None = None) -> bool:
        """Ping WATCHDOG=1 every WATCHDOG_USEC/2 while ``healthy()`` holds; when it fails
        the pings stop and systemd restarts the unit (WatchdogSec)."""
        interval = self.watchdog_interval_s
        if self._sock is None or interval is None or self._thread is not None:
            return False

        def loop() -> None:
            while True:
                if healthy is None or healthy():
                    self.watchdog()
                if self._stop.wait(interval):
                    return

        self._thread = threading.Thread(target=loop, name="sd-watchdog", daemon=True)
        self._thread.start()
        return True

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._sock is not None:
            self._sock.close()
            self._sock = None
