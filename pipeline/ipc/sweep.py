"""Transport: removing the names of dead instances (the gateway and the in-process `LLM`, at
start-up).

Owns the staleness rule, for this user's instances only (another user's are mode 0600 in a
sticky /dev/shm: neither readable nor removable by us): an instance is dead when the process
its owner record names (pipeline/ipc/instance.py writes `/pipeline.<id>.owner`: pid and start
time) is gone or was reused. Every instance has one (`Instance.join` makes a lone segment
creator the owner), so a killed process's segments go at the next sweep. Entries without an
owner record (a view's segment outliving its owner's cleanup, names made by hand) are dead when
a default id's pid is gone, and for any other id once every one of them is older than
`ORPHAN_GRACE_S`. Holds no state.
"""
from __future__ import annotations

import os
import re
import time

from pipeline.ipc.instance import PREFIX, list_entries, owner_alive, pid_alive, unlink_entries
from pipeline.ipc.segment import SHM_DIR

ORPHAN_GRACE_S = 600.0  # age after which entries without an owner record count as debris


def _owner_alive(instance_id: str, entries: list[str]) -> bool:
    alive = owner_alive(instance_id)
    if alive is not None:
        return alive
    # No owner record (it is created first and unlinked last): a view's segment that outlived
    # its owner's cleanup, or names made outside an Instance. A default id names its creator's
    # pid; for any other id only old entries are taken for debris.
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


def _mine(entries: list[str]) -> bool:
    """Whether this user made them: another user's names are mode 0600 in a sticky /dev/shm,
    so their owner record cannot be read nor their names unlinked (and are not ours to judge)."""
    uid = os.geteuid()
    for e in entries:
        try:
            if os.stat(f"{SHM_DIR}/{e}").st_uid != uid:
                return False
        except FileNotFoundError:
            pass
    return True


def sweep_stale() -> list[str]:
    """Unlink every `/pipeline.*` segment and semaphore of this user whose instance's owner
    is dead."""
    removed = []
    by_id: dict[str, list[str]] = {}
    for entry in list_entries():
        base = entry[4:] if entry.startswith("sem.") else entry
        by_id.setdefault(base[len(PREFIX):].split(".", 1)[0], []).append(entry)
    for iid, entries in by_id.items():
        if _mine(entries) and not _owner_alive(iid, entries):
            removed += unlink_entries(entries)
    return removed
