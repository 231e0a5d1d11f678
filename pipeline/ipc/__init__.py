"""Transport: shared-memory rings, broadcast ring, layer signal, naming and lifetime.

- names: `Instance` (per-instance name prefix, creation, cleanup on exit/SIGTERM), `sweep_stale`
- ring: `Ring` (SPSC), `Doorbell` and `wait_any` (one reader blocking on several rings)
- broadcast: `BroadcastRing` (engine -> TP workers, the writer waits for the slowest reader)
- signal: `LayerSignal` (worker -> cache messager, per-layer "KV written")
- codec: msgspec msgpack encode/decode, token ids as raw little-endian int32 bytes
"""
from pipeline.ipc.errors import PeerDied, ShmSpaceError

__all__ = ["PeerDied", "ShmSpaceError"]
