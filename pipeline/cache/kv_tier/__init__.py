"""KV disk tier (issue 26): a prefix cache of KV blocks in files that outlives the pool and
the process, shared by the instances of one host.

- format: one block's file (header with the key, the layout fields and per-row checksums;
  the rows layer-major) and the namespace of a layout
- budget: the directory's size budget under a lock file, LRU eviction by a scan
- store: `DiskTier` (save, lookup, load a block or a layer range, touch)

The hot path (scatter/gather file I/O of a block's rows, the checksum) is
`pipeline._ext.kv_io`. Not wired into the engine yet: the connector comes next (docs/kv_tier.md).
"""
from pipeline.cache.kv_tier.store import DiskTier

__all__ = ["DiskTier"]
