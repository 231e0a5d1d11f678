"""Transport: one POSIX shared-memory segment by name, and what this process unlinks on exit
(every stage).

Owns creating a segment (exclusive, mode 0600, pages reserved up front so a full /dev/shm is
a `ShmSpaceError` now rather than a SIGBUS later, mapped pre-faulted; or, for a large pool such
as the CPU KV cache, mapped page by page at first touch), attaching one by name,
unlinking a name, and the process-wide exit hooks (atexit, SIGTERM) that unlink this
process's names: the segments `create_segment` made and every registered owning `Instance`
(pipeline/ipc/instance.py), only in the process that created them, never in forked children.

State: `_loose` (name -> creating pid of each `create_segment` segment not yet unlinked),
`_instances` (owning Instances to clean up), whether the hooks are installed and the SIGTERM
handler they replaced.
"""
from __future__ import annotations

import atexit
import mmap
import os
import signal
import threading
from collections.abc import Callable
from types import FrameType
from typing import Protocol, TypeVar

import posix_ipc

from pipeline._ext.shmring import Segment
from pipeline.ipc.errors import ShmSpaceError

SHM_DIR = "/dev/shm"


def shm_free_bytes() -> int:
    st = os.statvfs(SHM_DIR)
    return st.f_bavail * st.f_frsize


def create_segment(name: str, size: int) -> Segment:
    """Create `name` exclusively (mode 0600), reserve its pages and map it pre-faulted.

    Outside an owning `Instance` (e.g. a worker's KV pool, named through `Instance.view`) the
    name is still unlinked when this process exits or gets SIGTERM; `unlink_segment` earlier."""
    seg = create_exclusive(name, size)
    _install_hooks()
    _loose[name] = os.getpid()
    return seg


def unlink_segment(name: str) -> None:
    unlink_name(name, "shm")
    _loose.pop(name, None)


def create_exclusive(name: str, size: int) -> Segment:
    """`create_segment` without the exit hook: the caller owns the name's lifetime."""
    return _create(name, size, Segment.map)


def create_lazy_segment(name: str, size: int) -> mmap.mmap:
    """`create_segment` for a large pool (the CPU KV cache): its pages are reserved the same
    way, but mapped without MAP_POPULATE. Populating costs ~0.4 s per GiB of page-table work
    before start-up can end; at first touch it is paid a block at a time, as blocks come into
    use. Rings keep MAP_POPULATE: they are small and on every message's path."""
    seg = _create(name, size, lambda fd, n, _name: mmap.mmap(fd, n))
    _install_hooks()
    _loose[name] = os.getpid()
    return seg


_Mapping = TypeVar("_Mapping", Segment, mmap.mmap)


def _create(name: str, size: int, map_fd: Callable[[int, int, str], _Mapping]) -> _Mapping:
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
        return map_fd(shm.fd, size, name)
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


def unlink_name(name: str, kind: str) -> None:
    """Unlink a segment (kind "shm") or a named semaphore ("sem"); gone already is fine."""
    try:
        if kind == "sem":
            posix_ipc.unlink_semaphore(name)
        else:
            posix_ipc.unlink_shared_memory(name)
    except posix_ipc.ExistentialError:
        pass


# ---- process-wide cleanup hooks -------------------------------------------------------------
class _Cleanup(Protocol):
    def cleanup(self) -> None: ...


_instances: list[_Cleanup] = []
_prev_sigterm: object = None
_hooks_installed = False


_loose: dict[str, int] = {}  # segments made by create_segment outside an Instance -> creator


def register_exit_cleanup(inst: _Cleanup) -> None:
    """Run inst.cleanup() at exit and on SIGTERM (an owning Instance registers itself)."""
    _instances.append(inst)
    _install_hooks()


def unregister_exit_cleanup(inst: _Cleanup) -> None:
    if inst in _instances:
        _instances.remove(inst)


def _install_hooks() -> None:
    global _hooks_installed, _prev_sigterm
    if _hooks_installed:
        return
    atexit.register(_cleanup_all)
    if threading.current_thread() is threading.main_thread():
        _prev_sigterm = signal.signal(signal.SIGTERM, _on_sigterm)
    _hooks_installed = True


def _cleanup_all() -> None:
    for inst in list(_instances):
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
