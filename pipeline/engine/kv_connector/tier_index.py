"""Engine stage, a KV tier's directory as the engine sees it: the hash key every instance on it
shares (``tier_hash_key``) and which chain keys have a file (``TierIndex``, one ``stat`` each,
nothing read). The files themselves are the cache messager's (``cache.kv_tier``).

Owns / State: the namespace directory's path.
"""
from __future__ import annotations

import os
from collections.abc import Sequence

from pipeline.messages.kv_layout import KVLayout

HASH_KEY_FILE = ".hash_key"

def tier_hash_key(root: str) -> bytes:
    """The prefix cache's hash key shared by every instance (and restart) on tier ``root``:
    a file of 32 random bytes made once (mode 0600; created whole by link, so two instances
    starting at once agree on one). Block hashes are the tier's file names."""
    os.makedirs(root, exist_ok=True)
    path = os.path.join(root, HASH_KEY_FILE)
    for _ in range(3):
        try:
            with open(path, "rb") as f:
                key = f.read()
            if len(key) == 32:
                return key
            raise ValueError(f"{path}: {len(key)} bytes, a tier's hash key is 32 (remove it to "
                             f"start the tier afresh)")
        except FileNotFoundError:
            tmp = f"{path}.{os.getpid()}.{os.urandom(4).hex()}"
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            try:
                os.write(fd, os.urandom(32))
            finally:
                os.close(fd)
            try:
                os.link(tmp, path)  # fails if another instance made it first: read theirs
            except FileExistsError:
                pass
            finally:
                os.unlink(tmp)
    raise RuntimeError(f"{path}: could not be read or made")


class TierIndex:
    """Which leading keys of a chain have a file (one ``stat`` each, nothing read): the
    engine's only look at the tier's directory."""

    def __init__(self, root: str, layout: KVLayout) -> None:
        self.dir = os.path.join(root, layout.tier_namespace().hex())

    def lookup(self, keys: Sequence[bytes]) -> int:
        n = 0
        for k in keys:
            try:
                os.stat(os.path.join(self.dir, k.hex()))
            except OSError:
                break
            n += 1
        return n
