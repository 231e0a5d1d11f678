"""Transport naming (every stage; the gateway owns the instance, the others view it).

An owning `Instance` owns the name prefix `/pipeline.<instance_id>.` and every segment and
named semaphore it created under it. Its owner record `/pipeline.<id>.owner` (created first,
unlinked last) holds the creating pid and that process's start time, so `sweep_stale()`
(pipeline/ipc/sweep.py) can tell a dead instance from a live one even when a pid was reused.
Cleanup runs on `cleanup()`, at normal exit and on SIGTERM (the hooks of pipeline/ipc/
segment.py), only in the process that created the instance, never in forked children.

A view (`Instance.view(instance_id)`, another process of the same instance, e.g. a worker)
names things under the same prefix and owns only the segments it creates: this process
unlinks them on `cleanup()`, `unlink_segment`, exit or SIGTERM, like `create_segment`'s.
`Instance.join(instance_id)` is what a process that creates segments under a given id uses
(the worker's KV cache): a view when a live process owns the instance (the gateway), else it
becomes the owner itself (in-process `LLM`, benchmarks), so every segment has an owner record
and `sweep_stale` removes it as soon as that owner is dead.
`unlink_instance` removes whatever is left under a prefix, whoever made it.

State: per Instance, the names it created. Owner records are written and read here.
"""
from __future__ import annotations

import os
import re
import secrets
import threading

import posix_ipc

from pipeline._ext.shmring import Segment
from pipeline.ipc.segment import (
    SHM_DIR,
    create_exclusive,
    create_segment,
    register_exit_cleanup,
    unlink_name,
    unlink_segment,
    unregister_exit_cleanup,
)

PREFIX = "pipeline."
_ID_RE = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
_WHAT_RE = re.compile(r"^[A-Za-z0-9_.-]{1,96}$")


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


def new_instance_id() -> str:
    """"<pid>-<hex>": unique across processes, and names its creator even without a record."""
    return f"{os.getpid()}-{secrets.token_hex(4)}"


def pid_alive(pid: int, start_time: int | None = None) -> bool:
    """True if `pid` runs (not a zombie) and, when given, started at `start_time`."""
    if pid <= 0:
        return False
    if not os.path.isdir("/proc"):
        import psutil
        return psutil.pid_exists(pid)
    st = _start_time(pid)
    return st is not None and (start_time is None or st == start_time)


class Instance:
    """One serving instance's names: `/pipeline.<instance_id>.<what>`.

    `Instance(id)` (id None: a fresh "<pid>-<hex>") creates and owns the instance;
    `Instance.view(id)` only names things in an instance another process owns."""

    def __init__(self, instance_id: str | None = None, *, owner: bool = True) -> None:
        if not owner and not instance_id:
            raise ValueError("a view of an instance needs its instance_id")
        iid = instance_id or new_instance_id()
        if not _ID_RE.match(iid):
            raise ValueError(f"instance_id={iid!r} must match {_ID_RE.pattern}")
        self.id = iid
        self.prefix = f"/{PREFIX}{iid}."
        self.owner = owner
        self.owner_pid = os.getpid()  # the process whose cleanup() unlinks this object's names
        self._created: list[tuple[str, str]] = []
        self._lock = threading.Lock()
        if owner:
            record_seg = create_exclusive(self.name("owner"), 64)
            record = f"{self.owner_pid} {_start_time(self.owner_pid) or 0}\n".encode()
            memoryview(record_seg)[: len(record)] = record
            record_seg.close()
            register_exit_cleanup(self)

    @classmethod
    def view(cls, instance_id: str) -> Instance:
        """A non-owning view of instance `instance_id`, for another process of it."""
        return cls(instance_id, owner=False)

    @classmethod
    def join(cls, instance_id: str) -> Instance:
        """A view of `instance_id` when a live process owns it, else an owning Instance of it
        (after unlinking what a dead owner left under that id): whoever creates a segment
        under an id that nobody owns records itself as the owner."""
        alive = owner_alive(instance_id)
        if alive:
            return cls.view(instance_id)
        if alive is False:
            unlink_instance(instance_id)
        return cls(instance_id)

    def name(self, what: str) -> str:
        if not _WHAT_RE.match(what):
            raise ValueError(f"segment name part what={what!r} must match {_WHAT_RE.pattern}")
        return self.prefix + what

    def create_segment(self, what: str, size: int) -> Segment:
        """Create `/pipeline.<id>.<what>` (exclusive, mode 0600, pre-faulted). The owner unlinks
        it on cleanup(); for a view it is this process's to unlink (also at exit/SIGTERM)."""
        name = self.name(what)
        seg = create_exclusive(name, size) if self.owner else create_segment(name, size)
        with self._lock:
            self._created.append((name, "shm"))
        return seg

    def create_semaphore(self, what: str, initial_value: int = 0) -> posix_ipc.Semaphore:
        """A named semaphore under this instance (rings use unnamed ones inside their segment)."""
        if not self.owner:
            raise ValueError(f"{self!r}: named semaphores are created by the instance's owner")
        name = self.name(what)
        sem = posix_ipc.Semaphore(name, flags=posix_ipc.O_CREX, mode=0o600, initial_value=initial_value)
        with self._lock:
            self._created.append((name, "sem"))
        return sem

    def cleanup(self) -> None:
        """Unlink every name this object created (mappings stay valid until unmapped)."""
        if os.getpid() != self.owner_pid:
            return
        with self._lock:
            created, self._created = self._created, []
        for name, kind in reversed(created):
            if kind == "shm":
                unlink_segment(name)
            else:
                unlink_name(name, kind)
        if self.owner:
            unlink_name(self.name("owner"), "shm")
            unregister_exit_cleanup(self)

    def __enter__(self) -> Instance:
        return self

    def __exit__(self, *exc: object) -> None:
        self.cleanup()

    def __repr__(self) -> str:
        return f"Instance({self.id!r})" if self.owner else f"Instance.view({self.id!r})"


def read_owner(instance_id: str) -> tuple[int, int] | None:
    """(pid, start time; 0 if unknown) from the instance's owner record, None without one
    (or while its creator is still writing it)."""
    try:
        with open(f"{SHM_DIR}/{PREFIX}{instance_id}.owner", "rb") as f:
            pid, start = (int(x) for x in f.read(64).rstrip(b"\0").split())
    except (FileNotFoundError, ValueError):
        return None
    return pid, start


def owner_alive(instance_id: str) -> bool | None:
    """Whether the process the owner record names still runs; None without a record."""
    owner = read_owner(instance_id)
    return None if owner is None else pid_alive(owner[0], owner[1] or None)


def list_entries(instance_id: str | None = None) -> list[str]:
    """/dev/shm file names (segments and `sem.` semaphores) of one instance or of all."""
    want = f"{PREFIX}{instance_id}." if instance_id else PREFIX
    try:
        names = os.listdir(SHM_DIR)
    except FileNotFoundError:
        return []
    return sorted(n for n in names if n.startswith(want) or n.startswith("sem." + want))


def unlink_entries(entries: list[str]) -> list[str]:
    """Unlink /dev/shm entries (as list_entries names them), the owner record last."""
    for entry in sorted(entries, key=lambda e: e.endswith(".owner")):
        if entry.startswith("sem."):
            unlink_name("/" + entry[4:], "sem")
        else:
            unlink_name("/" + entry, "shm")
    return entries


def unlink_instance(instance_id: str) -> list[str]:
    """Unlink what is left of an instance, e.g. the KV segment of a killed worker."""
    return unlink_entries(list_entries(instance_id))
