"""Transport: removing the names of dead instances (the gateway, at start-up).

Owns the staleness rule: an instance is dead when the process its owner record names
(pipeline/ipc/instance.py writes `/pipeline.<id>.owner`: pid and start time) is gone or was
reused. Entries without an owner record (debris of a crash during cleanup, or segments a view
made outside an owning Instance) are dead when a default id's pid is gone, and for any other id
once every one of them is older than `ORPHAN_GRACE_S`. Holds no state.
"""
from __future__ import annotations

import os
import re
import time

from pipeline.ipc.instance import PREFIX, list_entries, pid_alive, unlink_entries
from pipeline.ipc.segment import SHM_DIR

ORPHAN_GRACE_S = 600.0  # age after which entries without an owner record count as debris


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
