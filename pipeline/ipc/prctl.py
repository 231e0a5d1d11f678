"""Linux prctl(2) for the processes of an instance: dying with the parent that started them
(PR_SET_PDEATHSIG; stages, the HTTP front end, grammar compilers) and a name that top, ps -o
comm, pgrep and perf show (PR_SET_NAME). A leaf: every process kind may use it.
Owns no state.
"""
from __future__ import annotations

import ctypes

PR_SET_PDEATHSIG = 1
PR_SET_NAME = 15
# An instance's process names (15 bytes at most): "pl-" and the process's role, e.g.
# pl-worker0, pl-http. The threads a process starts afterwards (the worker's OpenMP team)
# inherit it, so `top -H` names them too.
PROCESS_NAME_PREFIX = "pl-"


def prctl(option: int, arg: int | bytes) -> bool:
    """prctl(2) with one argument; False where it failed or there is none (not Linux)."""
    try:
        return ctypes.CDLL(None, use_errno=True).prctl(option, arg) == 0
    except (OSError, AttributeError):
        return False


def name_process(name: str) -> None:
    """Set this thread's (for the main thread: the process's) name to ``pl-<name>``."""
    prctl(PR_SET_NAME, (PROCESS_NAME_PREFIX + name).encode()[:15])
