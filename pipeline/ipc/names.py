"""Transport naming and lifetime (every stage; the gateway creates, the others attach).

An `Instance` owns the name prefix `/pipeline.<instance_id>.` and every segment and named
semaphore created under it. Its owner record `/pipeline.<id>.owner` (created first, unlinked
last) holds the creating pid and that process's start time, so `sweep_stale()` can tell a dead
instance from a live one even when a pid was reused. Cleanup runs on `cleanup()`, at normal
exit and on SIGTERM, only in the process that created the instance (never in forked children);
the same holds for segments made with the module-level `create_segment` outside an Instance.
"""
from __future__ import annotations

import atexit
import os
import re
import secrets
import signal
import threading
import time
from types import FrameType

import posix_ipc

from pipeline._ext.shmring import Segment
from pipeline.ipc.errors import ShmSpaceError

SHM_DIR = "/dev/shm"
PREFIX = "pipeline."
_ID_RE = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
_WHAT_RE = re.compile(r"^[A-Za-z0-9_.-]{1,96}$")
ORPHAN_GRACE_S = 600.0  # age after which entries without an owner record count as debris


def _start_time(pid: int) -> int | None:
    """Process start time in clock ticks since boot (field 22 of /proc/PID/stat), None if gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read()
    except (FileNotFoundError, ProcessLookupError):
        return None
    fields = data[data.rfind(b")") + 2:].split()
    if fields[0] in (b"Z", b"X"):
        return None
    return int(fields[19])


def pid_alive(pid: int, start_time: int | None = None) -> bool:
    """True if `pid` runs (not a zombie) and, when given, started at `start_time`."""
    if pid <= 0:
        return False
    if not os.path.isdir("/proc"):
        import psutil
        return psutil.pid_exists(pid)
    st = _start_time(pid)
    return st is not None and (start_time is None or st == start_time)


def shm_free_bytes() -> int:
    st = os.statvfs(SHM_DIR)
    return st.f_bavail * st.f_frsize


def create_segment(name: str, size: int) -> Segment:
    """Create `name` exclusively (mode 0600), reserve its pages and map it pre-faulted.

    Outside an `Instance` (e.g. a worker's KV pool named under its gateway's instance id) the
    name is still unlinked when this process exits or gets SIGTERM; `unlink_segment` earlier."""
    seg = _create(name, size)
    _install_hooks()
    _loose[name] = os.getpid()
    return seg


def unlink_segment(name: str) -> None:
    _unlink(name, "shm")
    _loose.pop(name, None)


def _create(name: str, size: int) -> Segment:
    if size <= 0:
        raise ValueError(f"segment size={size} must be > 0")
    free = shm_free_bytes()
    if size > free:
        raise ShmSpaceError(name, size, free)
    shm = posix_ipc.SharedMemory(name, flags=posix_ipc.O_CREX, mode=0o600)
    try:
        # tmpfs reports a full /dev/shm at allocation, not later as SIGBUS on first touch.
        try:
            os.posix_fallocate(shm.fd, 0, size)
        except OSError as e:
            if e.errno == 28:
                raise ShmSpaceError(name, size, shm_free_bytes()) from None
            raise
        return Segment.map(shm.fd, size, name)
    except BaseException:
        shm.unlink()
        raise
    finally:
        shm.close_fd()


def attach_segment(name: str) -> Segment:
    shm = posix_ipc.SharedMemory(name)
    try:
        return Segment.map(shm.fd, os.fstat(shm.fd).st_size, name)
    finally:
        shm.close_fd()


def _unlink(name: str, kind: str) -> None:
    try:
        if kind == "sem":
            posix_ipc.unlink_semaphore(name)
        else:
            posix_ipc.unlink_shared_memory(name)
    except posix_ipc.ExistentialError:
        pass


class Instance:
    """One serving instance's names: `/pipeline.<instance_id>.<what>`."""

    def __init__(self, instance_id: str | None = None) -> None:
        iid = instance_id or f"{os.getpid()}-{secrets.token_hex(4)}"
        if not _ID_RE.match(iid):
            raise ValueError(f"instance_id={iid!r} must match {_ID_RE.pattern}")
        self.id = iid
        self.prefix = f"/{PREFIX}{iid}."
        self.owner_pid = os.getpid()
        self._created: list[tuple[str, str]] = []
        self._lock = threading.Lock()
        owner = _create(self.name("owner"), 64)
        record = f"{self.owner_pid} {_start_time(self.owner_pid) or 0}\n".encode()
        memoryview(owner)[: len(record)] = record
        owner.close()
        _register(self)

    def name(self, what: str) -> str:
        if not _WHAT_RE.match(what):
            raise ValueError(f"segment name part what={what!r} must match {_WHAT_RE.pattern}")
        return self.prefix + what

    def create_segment(self, what: str, size: int) -> Segment:
        name = self.name(what)
        seg = _create(name, size)
        with self._lock:
            self._created.append((name, "shm"))
        return seg

    def create_semaphore(self, what: str, initial_value: int = 0) -> posix_ipc.Semaphore:
        """A named semaphore under this instance (rings use unnamed ones inside their segment)."""
        name = self.name(what)
        sem = posix_ipc.Semaphore(name, flags=posix_ipc.O_CREX, mode=0o600, initial_value=initial_value)
        with self._lock:
            self._created.append((name, "sem"))
        return sem

    def cleanup(self) -> None:
        """Unlink every name this instance created (mappings stay valid until unmapped)."""
        if os.getpid() != self.owner_pid:
            return
        with self._lock:
            created, self._created = self._created, []
        for name, kind in reversed(created):
            _unlink(name, kind)
        _unlink(self.name("owner"), "shm")
        _unregister(self)

    def __enter__(self) -> Instance:
        return self

    def __exit__(self, *exc: object) -> None:
        self.cleanup()

    def __repr__(self) -> str:
        return f"Instance({self.id!r})"


def list_entries(instance_id: str | None = None) -> list[str]:
    """/dev/shm file names (segments and `sem.` semaphores) of one instance or of all."""
    want = f"{PREFIX}{instance_id}." if instance_id else PREFIX
    try:
        names = os.listdir(SHM_DIR)
    except FileNotFoundError:
        return []
    return sorted(n for n in names if n.startswith(want) or n.startswith("sem." + want))


def _owner_alive(instance_id: str, entries: list[str]) -> bool:
    try:
        with open(f"{SHM_DIR}/{PREFIX}{instance_id}.owner", "rb") as f:
            pid, start = (int(x) for x in f.read(64).rstrip(b"\0").split())
        return pid_alive(pid, start or None)
    except (FileNotFoundError, ValueError):
        pass
    # No owner record (it is created first and unlinked last): debris of a crash during
    # cleanup, or segments made outside an Instance. A default id names its creator's pid;
    # for any other id only old entries are taken for debris.
    m = re.match(r"^(\d+)-[0-9a-f]+$", instance_id)
    if m:
        return pid_alive(int(m.group(1)))
    now = time.time()
    for e in entries:
        try:
            if now - os.stat(f"{SHM_DIR}/{e}").st_mtime < ORPHAN_GRACE_S:
                return True
        except FileNotFoundError:
            pass
    return False


def unlink_entries(entries: list[str]) -> list[str]:
    """Unlink /dev/shm entries (as list_entries names them), the owner record last."""
    for entry in sorted(entries, key=lambda e: e.endswith(".owner")):
        if entry.startswith("sem."):
            _unlink("/" + entry[4:], "sem")
        else:
            _unlink("/" + entry, "shm")
    return entries


def unlink_instance(instance_id: str) -> list[str]:
    """Unlink what is left of an instance, e.g. the KV segment of a killed worker."""
    return unlink_entries(list_entries(instance_id))


def sweep_stale() -> list[str]:
    """Unlink every `/pipeline.*` segment and semaphore whose instance's owner is dead."""
    removed = []
    by_id: dict[str, list[str]] = {}
    for entry in list_entries():
        base = entry[4:] if entry.startswith("sem.") else entry
        by_id.setdefault(base[len(PREFIX):].split(".", 1)[0], []).append(entry)
    for iid, entries in by_id.items():
        if not _owner_alive(iid, entries):
            removed += unlink_entries(entries)
    return removed


# ---- process-wide cleanup hooks -------------------------------------------------------------
_live: list[Instance] = []
_prev_sigterm: object = None
_hooks_installed = False


_loose: dict[str, int] = {}  # segments made by create_segment outside an Instance -> creator


def _register(inst: Instance) -> None:
    _live.append(inst)
    _install_hooks()


def _install_hooks() -> None:
    global _hooks_installed, _prev_sigterm
    if _hooks_installed:
        return
    atexit.register(_cleanup_all)
    if threading.current_thread() is threading.main_thread():
        _prev_sigterm = signal.signal(signal.SIGTERM, _on_sigterm)
    _hooks_installed = True


def _unregister(inst: Instance) -> None:
    if inst in _live:
        _live.remove(inst)


def _cleanup_all() -> None:
    for inst in list(_live):
        inst.cleanup()
    for name, pid in list(_loose.items()):
        if pid == os.getpid():
            unlink_segment(name)


def _on_sigterm(signum: int, frame: FrameType | None) -> None:
    prev = _prev_sigterm
    if prev == signal.SIG_IGN:
        return
    _cleanup_all()
    if callable(prev):
        prev(signum, frame)
        return
    # Default action: die by SIGTERM, as the supervisor expects, with the names already gone.
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    os.kill(os.getpid(), signal.SIGTERM)
